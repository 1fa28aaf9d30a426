"""Which weight format a draft loads in for the methods that expand token trees with it level by level: `auto`
picks the fastest PyTorch format where the GGUF file (which llama.cpp's runner cannot expand so) is fastest
(fake probe timings, no real probe)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from accelgen.cli import app
from accelgen.drafters import draft_tree
from accelgen.drafters.draft_tree import draft_weights_for

# t(1) and t(8) in seconds: the GGUF file fastest, then int8, then bf16
TIMINGS = {"gguf": {"t1": 0.01, "t8": 0.03}, "int8": {"t1": 0.02, "t8": 0.05}, "bf16": {"t1": 0.03, "t8": 0.04},
           "fp32": {"t1": 0.05, "t8": 0.09}}


@pytest.fixture
def probed(monkeypatch):
    """probed(timings): the weights probe of any model answers as if it had measured these timings here."""

    def use(timings: dict) -> list:
        asked = []

        def choose(name_or_path, threads=None):
            asked.append(name_or_path)
            return {"timings": timings, **draft_tree.decide(timings)}

        monkeypatch.setattr(draft_tree, "choose_weights", choose)
        return asked

    return use


def test_auto_is_the_fastest_pytorch_format_for_tree_drafters(probed, capsys):
    asked = probed(TIMINGS)
    for method in ("specinfer", "mcsd", "spectr", "online", "triforce"):
        assert draft_weights_for([method], "some-draft", "auto") == "int8", method
    assert asked == ["some-draft"] * 5
    assert "int8 for the draft" in capsys.readouterr().err
    assert draft_weights_for(["speculative", "specinfer"], "some-draft", "auto") == "int8"  # a server's methods


def test_other_choices_are_kept(probed):
    asked = probed(TIMINGS)
    assert draft_weights_for(["speculative"], "some-draft", "auto") == "auto"  # a chain drafts on llama.cpp too
    assert draft_weights_for(["specinfer"], "some-draft", "gguf") == "gguf"  # asked for: the drafter says why not
    assert draft_weights_for(["specinfer"], "some-draft", None) is None
    assert draft_weights_for(["specinfer"], None, "auto") == "auto"  # no draft
    assert draft_weights_for(["specinfer"], "some-draft", "auto", device="cuda:0") == "auto"  # bf16 there anyway
    assert asked == []
    probed({fmt: TIMINGS[fmt] for fmt in ("int8", "bf16")})  # a probe that found a PyTorch format fastest
    assert draft_weights_for(["specinfer"], "some-draft", "auto") == "auto"


def test_a_draft_with_no_pytorch_format_is_refused_by_name(probed):
    probed({"gguf": TIMINGS["gguf"]})
    with pytest.raises(ValueError, match="specinfer needs the draft as a PyTorch model, .* no PyTorch format of "
                                         "'draft.gguf'"):
        draft_weights_for(["specinfer"], "draft.gguf", "auto")


def test_specinfer_runs_with_draft_weights_auto(probed):
    """The command line: the draft that `--draft-weights auto` would load as its GGUF file loads in int8."""
    asked = probed(TIMINGS)
    result = CliRunner().invoke(app, ["generate", "-m", "smollm2-135m", "--dtype", "float32", "--method", "specinfer",
                                      "--draft", "smollm2-135m", "--draft-weights", "auto", "-n", "8", "--json",
                                      "The capital of France is"])
    assert result.exit_code == 0, result.output
    assert asked == ["smollm2-135m"] and "int8 for the draft" in result.stderr

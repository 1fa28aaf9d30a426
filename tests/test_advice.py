"""`accelgen advise`: the format and method follow the measured timings (fake ones here, both kinds of CPU)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from accelgen.advice import advice_markdown, advise, format_rows
from accelgen.cli import app
from accelgen.models import probe

# an AVX2-only CPU: bf16 converted on the fly, the packed int8 kernel fastest, verifying 8 tokens ≈ 4–6 steps
AVX2 = {"int8": {"t1": 0.20, "t8": 0.80}, "bf16": {"t1": 0.30, "t8": 1.9}, "fp32": {"t1": 0.55, "t8": 2.1}}
# native bf16 matrix units: bf16 fastest, verification nearly free
NATIVE_BF16 = {"int8": {"t1": 0.09, "t8": 0.14}, "bf16": {"t1": 0.08, "t8": 0.09}, "fp32": {"t1": 0.16, "t8": 0.20}}


@pytest.fixture
def folders(tmp_path, monkeypatch, make_tiny_model, tokenizer):
    monkeypatch.setenv("ACCELGEN_CACHE", str(tmp_path / "cache"))
    paths = []
    for name, layers in (("target", 4), ("draft", 1)):
        path = tmp_path / name
        make_tiny_model("qwen2", seed=0, layers=layers).save_pretrained(path)
        tokenizer.save_pretrained(path)
        paths.append(str(path))
    return paths


def probed(path: str, timings: dict) -> None:
    """The format probe's cache as if measured so on this machine."""
    probe.choose_weights(path, measure=lambda name, fmt, threads: timings[fmt], candidates=list(timings))


def test_rows_are_ordered_by_plain_speed_with_the_drafted_speed_beside():
    rows = format_rows(AVX2)
    assert [row["weights"] for row in rows] == ["int8", "bf16", "fp32"]
    assert rows[0]["plain_tps"] == pytest.approx(5.0) and rows[0]["r8"] == pytest.approx(4.0)
    assert rows[0]["drafted_tps"] == pytest.approx(5.0)  # 3 tokens / 0.8 s is less than plain: plain decoding
    native = {row["weights"]: row for row in format_rows(NATIVE_BF16)}
    assert native["bf16"]["drafted_tps"] == pytest.approx(3 / 0.09)


@pytest.mark.parametrize("timings, verify_ratio, weights, method", [
    (AVX2, {1: 1.0, 2: 1.9, 16: 15.0}, "int8", "autoregressive"),  # r(k) ≈ k: no draft pays
    (NATIVE_BF16, {1: 1.0, 16: 1.2}, "bf16", "speculative"),  # verification nearly free, a cheap draft
])
def test_advice_follows_the_measurements(folders, measured_costs, timings, verify_ratio, weights, method):
    from accelgen.models.loading import load_model

    target, draft = folders
    probed(target, timings)
    probed(draft, timings)
    target_model = load_model(target, weights=weights)[0]
    draft_model = load_model(draft, weights=weights)[0]
    measured_costs({target_model: (0.1, verify_ratio), draft_model: (0.005, {1: 1.0})})
    advice = advise(target, draft)
    assert advice["target"]["weights"] == weights and advice["draft_choice"]["weights"] == weights
    assert advice["method"]["method"] == method
    markdown = advice_markdown(advice)
    assert f"picks `{weights}`" in markdown and f"`auto` picks `{method}`" in markdown
    assert f"--weights {weights} -d {draft} --draft-weights {weights} --method auto" in markdown
    assert "flags:" in markdown and markdown.count("\n| ") == 1 + len(timings)  # header + one row per format


def test_advise_command_prints_the_section(folders, measured_costs):
    target, _ = folders
    probed(target, NATIVE_BF16)
    measured_costs({})
    result = CliRunner().invoke(app, ["advise", "--model", target])
    assert result.exit_code == 0, result.output
    assert "| weights | t(1) ms" in result.output and "`auto` picks" in result.output
    missing = CliRunner().invoke(app, ["advise", "--model", f"{target}-missing"])
    assert missing.exit_code == 2 and "no model at" in " ".join(missing.output.split())


def test_advice_on_a_gpu_needs_no_format_table(folders, measured_costs, monkeypatch):
    """On a GPU the format is bf16 without a probe (it times CPU formats): the section says why, names the GPU and
    puts --device in the command. Here the CPU stands in for the GPU, so that its costs can be faked."""
    from accelgen import advice as advice_module
    from accelgen.models import loading

    target, draft = folders
    monkeypatch.setattr(probe, "choose_weights", lambda *args, **kwargs: pytest.fail("probed the CPU formats"))
    monkeypatch.setattr(loading, "resolve_device", lambda device: FakeGpu())
    gpu = {"type": "cuda", "device": "cuda:0", "name": "NVIDIA H200", "cuda": "12.8", "driver": None, "torch": "2.13"}
    monkeypatch.setattr(advice_module.hardware, "describe_device", lambda device: gpu)
    monkeypatch.setattr(loading, "load_model", lambda name, **kwargs: (loaded.setdefault(name, kwargs), None))
    monkeypatch.setattr("accelgen.drafters.auto.uncalibrated_choice",
                        lambda target_model, draft_model: {"method": "speculative", "reason": "measured on the GPU"})
    loaded = {}
    advice = advise(target, draft, device="cuda")
    assert advice["target"]["weights"] == "bf16" and advice["draft_choice"]["weights"] == "bf16"
    assert loaded[target]["device"] == loaded[draft]["device"] and loaded[draft]["weights"] == "bf16"
    markdown = advice_markdown(advice)
    assert "| weights |" not in markdown and "without a probe" in markdown and "NVIDIA H200" in markdown
    assert f"accelgen generate -m {target} --device cuda:0 --weights bf16 -d {draft} --draft-weights bf16" in markdown


class FakeGpu:
    """A device of type cuda, for code that only asks the type."""

    type = "cuda"

    def __str__(self):
        return "cuda:0"


def test_quantized_self_draft_is_predicted_from_the_probe():
    """qspec: the bf16 target verifying 7 tokens its fastest quantized copy drafted, at auto's assumed acceptance."""
    from accelgen.advice import self_draft_estimate
    from accelgen.drafters.auto import SELF_DRAFT_PRIOR_ALPHA
    from accelgen.theory import expected_tokens_per_forward

    native = {**NATIVE_BF16, "gguf": {"t1": 0.02, "t8": 0.12}}
    estimate = self_draft_estimate(native)
    assert (estimate["target"], estimate["copy"], estimate["gamma"]) == ("bf16", "gguf", 7)
    tokens = expected_tokens_per_forward(SELF_DRAFT_PRIOR_ALPHA, 7)
    assert estimate["drafted_tps"] == pytest.approx(tokens / (7 * 0.02 + 0.09))
    assert estimate["speedup"] == pytest.approx(estimate["drafted_tps"] * 0.08)
    assert self_draft_estimate({"int8": AVX2["int8"]}) is None  # no full-precision target to verify in
    markdown = advice_markdown({"model": "m", "draft": None, "machine": {"torch_threads": 2}, "target":
                                {"weights": "bf16", "timings": native}, "method": {"method": "pld", "reason": "r"},
                                "self_draft": estimate})
    assert "**Quantized self-draft** (`qspec`" in markdown and "--weights bf16 --method qspec" in markdown

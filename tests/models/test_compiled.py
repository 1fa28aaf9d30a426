"""The static runner's compiled forwards (models/static.py, compile=True) on the CPU, through inductor's C++ backend:
token-identical to the eager forwards in fp32, an eager fallback that says why, and the option's plumbing.

Compiling costs: one bucket of a 2-layer model takes about 40 s on this project's 2-core CI machine with a cold
inductor cache (about 8 s warm), so the default run compiles one bucket (the one-token step after an eager
prompt); the slow test compiles the buckets that drafts and trees use."""

import warnings

import pytest
import torch

import accelgen
from accelgen.models import static
from accelgen.models.engines import runner_for
from accelgen.models.runner import ModelRunner
from accelgen.models.static import StaticRunner, compile_choice

pytestmark = pytest.mark.usefixtures("one_thread")

LONG_PROMPT = [(7 * i) % 500 + 3 for i in range(70)]  # wider than the widest bucket: an eager forward
PROMPT = [5, 17, 923, 4410, 77, 12, 5, 17, 923]
SHORT_PROMPT = [5, 17, 92, 441, 77, 12, 5, 17, 92]  # within a 512-token vocabulary


def decode(runner, prompt: list[int], steps: int) -> list[int]:
    """Greedy tokens from a runner, one forward per token."""
    logits = runner.forward(torch.tensor(prompt), logits_for_last=1)
    tokens = []
    for _ in range(steps):
        tokens.append(int(logits[-1].argmax()))
        logits = runner.forward(torch.tensor(tokens[-1:]))
    return tokens


def test_the_compiled_step_is_token_identical_to_eager(make_tiny_model):
    model = make_tiny_model("llama", seed=0, vocab_size=512)
    compiled = StaticRunner(model, compile=True)
    expected = decode(ModelRunner(model), LONG_PROMPT, 8)
    assert decode(compiled, LONG_PROMPT, 8) == expected == decode(StaticRunner(model, compile=False), LONG_PROMPT, 8)
    assert compiled.describe() == {"cache": "static", "cuda_graphs": False, "compiled": True}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_compiled_generation_is_token_identical_for_chains_trees_and_heads(make_tiny_model, tokenizer, greedy,
                                                                           tmp_path, kind):
    """Every bucket a chain, a draft model's chain or tree, and Medusa's kept hidden states use, compiled."""
    from accelgen.heads.medusa import MedusaHeads

    model = make_tiny_model(kind, seed=0)
    MedusaHeads(3, 64, 49152).save(tmp_path / "medusa")
    expected = greedy(model, tokenizer, PROMPT * 2, 24).token_ids
    for method, options in [("autoregressive", {}), ("speculative", {"gamma": 4, "draft_model": model}),
                            ("specinfer", {"draft_model": model}), ("medusa", {"heads": str(tmp_path / "medusa")})]:
        result = accelgen.generate(model, tokenizer, PROMPT * 2, method=method, max_new_tokens=24, cache="static",
                                   compile=True, **options)
        assert result.token_ids == expected, method
        assert result.stats["compiled"] is True


def test_a_failed_compile_warns_and_runs_eagerly(make_tiny_model, monkeypatch):
    def refuses(model, inputs):
        raise RuntimeError("inductor could not build this\nmore detail")

    monkeypatch.setattr(static, "compiled_forward", lambda: refuses)
    model = make_tiny_model("qwen2", seed=0, vocab_size=512)
    runner = StaticRunner(model, compile=True)
    with pytest.warns(UserWarning, match=r"torch.compile of Qwen2ForCausalLM's forward failed \(RuntimeError: "
                                         r"inductor could not build this\); its forwards run eagerly"):
        tokens = decode(runner, SHORT_PROMPT, 6)
    assert tokens == decode(ModelRunner(model), SHORT_PROMPT, 6)
    assert runner.describe()["compiled"] is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per slot: the next runner of this slot says nothing again
        runner.close()
        assert decode(StaticRunner(model, compile=True), SHORT_PROMPT, 2) == tokens[:2]


def test_the_choice_of_compile(tiny_target, tokenizer):
    cpu = torch.device("cpu")
    assert compile_choice("auto", cpu) is False and compile_choice("auto", torch.device("cuda")) is True
    assert compile_choice(True, cpu) is True and compile_choice(False, torch.device("cuda")) is False
    with pytest.raises(ValueError, match="unknown compile 'fast'; choose 'auto', True or False"):
        compile_choice("fast", cpu)
    assert type(runner_for(tiny_target, compile=True)) is StaticRunner  # compile=True asks for the static cache
    assert type(runner_for(tiny_target, compile=False)) is ModelRunner  # "auto" on the CPU: the dynamic cache
    with pytest.raises(ValueError, match="compile=True compiles the static cache's forwards; cache='dynamic'"):
        runner_for(tiny_target, "dynamic", compile=True)
    with pytest.raises(ValueError, match="method 'calm' runs the model's layers itself; it cannot take compile=True"):
        accelgen.generate(tiny_target, tokenizer, PROMPT, method="calm", max_new_tokens=4, compile=True)
    result = accelgen.generate(tiny_target, tokenizer, PROMPT, max_new_tokens=4, cache="static", compile=False)
    assert result.stats["cache"] == "static" and result.stats["compiled"] is False


def test_cache_and_compile_are_options_of_every_method():
    spec = accelgen.get_method("pld")
    assert spec.check_options({"cache": "static", "compile": False})["compile"] is False
    from accelgen.method_options import parse_method_options, parse_options

    assert parse_options(["compile=true", "cache=static"], spec.options) == {"compile": True, "cache": "static"}
    assert parse_method_options(["autoregressive.compile=false"]) == {"autoregressive": {"compile": False}}

"""Weight formats: int8/int4 weight-only linears against their dequantized reference, methods exact against
`autoregressive` with the same quantized weights, the quantized-tensor cache, clear errors, and the format
probe's choice on fake timings of both kinds of CPU."""

from __future__ import annotations

import pytest
import torch

import accelgen
from accelgen.models import probe
from accelgen.models.formats import QuantizedLinear, quantize, quantize_int8, quantized_layer, weight_format
from accelgen.models.loading import load_model, quantized_cache_path

PROMPT = [5, 17, 923, 4410, 77, 12, 5, 17, 923]


def dequantized_int4(weight: torch.Tensor, group: int = 64) -> torch.Tensor:
    """The weights int4 quantization stands for, computed the plain way (the kernel's layout aside)."""
    out_features, in_features = weight.shape
    groups = weight.reshape(out_features, in_features // group, group)
    low, high = groups.amin(-1), groups.amax(-1)
    scales = (high - low).clamp(min=1e-8) / 15
    levels = ((groups - low[..., None]) / scales[..., None]).round().clamp(0, 15)
    return (levels * scales[..., None] + low[..., None]).reshape(out_features, in_features)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantized_linear_matches_its_dequantized_reference(fmt):
    torch.manual_seed(0)
    layer = torch.nn.Linear(256, 96)
    x = torch.randn(5, 256)
    quantized = quantized_layer(layer, fmt, torch.bfloat16)
    if fmt == "int8":
        weight, scales = quantize_int8(layer.weight)
        reference = x @ (weight.float() * scales[:, None]).T + layer.bias
    else:
        reference = x @ dequantized_int4(layer.weight.detach()).T + layer.bias
    # bf16 activations: a few parts in a thousand of the output's scale
    assert (quantized(x) - reference).abs().max() < 0.02 * reference.abs().max()
    assert quantized(x).dtype == x.dtype


@pytest.fixture(scope="module", params=["int8", "int4"])
def quantized_target(request, make_tiny_model):
    """Quantized weights with fp32 activations: exactness is tested in fp32 (in bf16 the packed kernels round a
    block of tokens differently from one token, as dense bf16 does)."""
    model = make_tiny_model("qwen2", seed=0)
    quantize(model, request.param, compute_dtype=torch.float32)
    return model


def test_quantized_model_reports_its_format(quantized_target):
    assert weight_format(quantized_target) in ("int8", "int4")
    assert any(isinstance(module, QuantizedLinear) for module in quantized_target.modules())
    assert not any(type(module) is torch.nn.Linear for module in quantized_target.modules())


@pytest.mark.parametrize("method", ["speculative", "specinfer", "pld"])
def test_methods_are_exact_against_autoregressive_in_the_same_format(quantized_target, make_tiny_model, tokenizer,
                                                                     method):
    plain = accelgen.generate(quantized_target, tokenizer, PROMPT, max_new_tokens=24)
    self_draft = accelgen.generate(quantized_target, tokenizer, PROMPT, method=method, max_new_tokens=24,
                                   draft_model=quantized_target)
    assert self_draft.token_ids == plain.token_ids
    if method != "pld":  # a random draft model, in another format: (almost) nothing accepted
        random_draft = make_tiny_model("llama", seed=1)
        result = accelgen.generate(quantized_target, tokenizer, PROMPT, method=method, max_new_tokens=24,
                                   draft_model=random_draft)
        assert result.token_ids == plain.token_ids


def test_quantized_tensors_are_cached_and_reloaded(tmp_path, monkeypatch, make_tiny_model, tokenizer):
    monkeypatch.setenv("ACCELGEN_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "tiny"
    make_tiny_model("qwen2", seed=0).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    first, _ = load_model(str(folder), weights="int4")
    path = quantized_cache_path(folder, "int4")
    assert path.is_file() and not list(path.parent.glob("*.partial"))
    second, _ = load_model(str(folder), weights="int4")  # reads the cached tensors
    assert weight_format(second) == "int4"
    assert accelgen.generate(first, tokenizer, PROMPT, max_new_tokens=12).token_ids == \
        accelgen.generate(second, tokenizer, PROMPT, max_new_tokens=12).token_ids
    assert quantized_cache_path(folder, "int8") != path


def test_clear_errors(make_tiny_model):
    with pytest.raises(ValueError, match="unknown weights format 'int3'"):
        load_model("anything", weights="int3")
    model = torch.nn.Sequential(torch.nn.Linear(100, 10))
    with pytest.raises(ValueError, match="groups of 64.*100 inputs.*int8"):
        quantize(model, "int4")


AVX2 = {"gguf": {"t1": 0.12, "t8": 0.85}, "int4": {"t1": 0.20, "t8": 0.85}, "int8": {"t1": 0.22, "t8": 0.80},
        "bf16": {"t1": 0.30, "t8": 1.9}, "fp32": {"t1": 0.55, "t8": 2.1}}
NATIVE_BF16 = {"gguf": {"t1": 0.09, "t8": 0.30}, "int8": {"t1": 0.10, "t8": 0.13}, "bf16": {"t1": 0.08, "t8": 0.09},
               "fp32": {"t1": 0.16, "t8": 0.20}}


@pytest.mark.parametrize("timings,expected", [(AVX2, "gguf"), (NATIVE_BF16, "bf16")])
def test_probe_chooses_by_measurement_and_caches_the_choice(tmp_path, monkeypatch, timings, expected):
    monkeypatch.setenv("ACCELGEN_CACHE", str(tmp_path))
    measured = []

    def fake_measure(name, fmt, threads):
        measured.append(fmt)
        return timings[fmt]

    choice = probe.choose_weights("some-model", measure=fake_measure, candidates=list(timings))
    assert choice["weights"] == expected and expected in choice["reason"]
    assert "flags" in choice["machine"]
    again = probe.choose_weights("some-model", measure=fake_measure, candidates=list(timings))
    assert again["weights"] == expected and len(measured) == len(timings)  # the second call read the cache
    assert probe.cached_choice("some-model")["weights"] == expected


def test_probe_skips_formats_that_cannot_load(tmp_path, monkeypatch):
    monkeypatch.setenv("ACCELGEN_CACHE", str(tmp_path))

    def fake_measure(name, fmt, threads):
        if fmt == "int4":
            raise ValueError("layer has 100 inputs")
        return {"t1": 0.3 if fmt == "int8" else 0.5, "t8": 1.0}

    assert probe.choose_weights("m", measure=fake_measure, candidates=["int4", "int8", "bf16"])["weights"] == "int8"

"""Weight formats: int8/int4 weight-only linears against their dequantized reference, methods exact against
`autoregressive` with the same quantized weights, tied embeddings, the quantized-tensor cache, clear errors,
and the format probe's choice on fake timings of both kinds of CPU."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

import accelgen
from accelgen.models import formats, probe
from accelgen.models.formats import (QuantizedLinear, int4_levels, quantize, quantize_int4, quantize_int8,
                                     quantized_layer, unpack_int4, weight_format)
from accelgen.models.loading import load_model, quantized_cache_path

PROMPT = [5, 17, 923, 4410, 77, 12, 5, 17, 923]
SMALL_PROMPT = [5, 17, 923, 441, 77, 12, 5, 17, 923]  # for vocabularies of 1024


def dequantized_int4(weight: torch.Tensor, group: int = 64) -> torch.Tensor:
    """The weights int4 quantization stands for, computed the plain way (the kernel's layout aside)."""
    out_features, in_features = weight.shape
    groups = weight.reshape(out_features, in_features // group, group)
    low, high = groups.amin(-1), groups.amax(-1)
    scales = (high - low).clamp(min=1e-8) / 15
    levels = ((groups - low[..., None]) / scales[..., None]).round().clamp(0, 15)
    return (levels * scales[..., None] + low[..., None]).reshape(out_features, in_features)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("out_features", [96, 208])  # 208: whole packing blocks and a shorter last one
def test_quantized_linear_matches_its_dequantized_reference(fmt, out_features):
    torch.manual_seed(0)
    layer = torch.nn.Linear(256, out_features)
    x = torch.randn(5, 256)
    quantized = quantized_layer(layer, fmt, torch.bfloat16)
    if fmt == "int8":
        weight, scales = quantize_int8(layer.weight)
        reference_weight = weight.float() * scales[:, None]
    else:
        reference_weight = dequantized_int4(layer.weight.detach())
    reference = x @ reference_weight.T + layer.bias
    # bf16 activations and scales: a few parts in a thousand of the output's scale
    assert (quantized(x) - reference).abs().max() < 0.02 * reference.abs().max()
    assert quantized(x).dtype == x.dtype
    # .weight reads the dense weight back out of the packed layout (draft heads use the LM head's rows)
    assert (quantized.weight.float() - reference_weight).abs().max() < 0.01 * reference_weight.abs().max()


def test_int4_packing_reads_back_exactly():
    torch.manual_seed(0)
    weight = torch.randn(3 * 64 + 16, 128)
    packed, scales_and_zeros = quantize_int4(weight)
    levels, scales, lows = int4_levels(weight)
    assert packed.shape == (208, 64) and scales_and_zeros.shape == (2, 208, 2)
    assert torch.equal(unpack_int4(packed), levels)
    # the kernel computes (q − 8) · scale + zero
    assert torch.allclose(scales_and_zeros[..., 1].T, lows + 8 * scales)


def test_gradients_reach_the_input_through_a_quantized_layer(assert_reordered):
    """Heads train on a frozen quantized target: the gradient with respect to the input is grad · W."""
    torch.manual_seed(0)
    layer = quantized_layer(torch.nn.Linear(64, 32), "int4", torch.float32)
    x = torch.randn(3, 64, requires_grad=True)
    (layer(x) ** 2).sum().backward()
    expected = torch.randn(3, 64, requires_grad=True)
    with torch.no_grad():
        expected.copy_(x)
    (torch.nn.functional.linear(expected, layer.weight, layer.bias) ** 2).sum().backward()
    assert_reordered(x.grad, expected.grad)


@pytest.fixture(scope="module", params=["int8", "int4"])
def quantized_target(request, make_tiny_model):
    """Quantized weights with fp32 activations: exactness is tested in fp32 (in bf16 a block of tokens rounds
    differently from one token in attention, as in dense bf16)."""
    model = make_tiny_model("qwen2", seed=0, vocab_size=1024)  # a small LM head: fp32 activations are slow in the kernels
    quantize(model, request.param, compute_dtype=torch.float32)
    return model


def test_quantized_model_reports_its_format(quantized_target):
    assert weight_format(quantized_target) in ("int8", "int4")
    assert any(isinstance(module, QuantizedLinear) for module in quantized_target.modules())
    assert not any(type(module) is torch.nn.Linear for module in quantized_target.modules())


@pytest.mark.parametrize("method", ["speculative", "specinfer", "pld"])
def test_methods_are_exact_against_autoregressive_in_the_same_format(quantized_target, make_tiny_model, tokenizer,
                                                                     method):
    plain = accelgen.generate(quantized_target, tokenizer, SMALL_PROMPT, max_new_tokens=24)
    self_draft = accelgen.generate(quantized_target, tokenizer, SMALL_PROMPT, method=method, max_new_tokens=24,
                                   draft_model=quantized_target)
    assert self_draft.token_ids == plain.token_ids
    if method != "pld":  # a random draft model, in another format: (almost) nothing accepted
        random_draft = make_tiny_model("llama", seed=1, vocab_size=1024)
        result = accelgen.generate(quantized_target, tokenizer, SMALL_PROMPT, method=method, max_new_tokens=24,
                                   draft_model=random_draft)
        assert result.token_ids == plain.token_ids


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_tied_embeddings_keep_a_dense_lookup_and_get_a_quantized_head(fmt):
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    dense = Qwen2ForCausalLM(config).eval()
    model = copy.deepcopy(dense)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    quantize(model, fmt)
    assert isinstance(model.lm_head, QuantizedLinear)
    assert type(model.model.embed_tokens) is torch.nn.Embedding
    assert torch.equal(model.model.embed_tokens.weight, dense.model.embed_tokens.weight.to(torch.bfloat16))
    ids = torch.tensor([PROMPT[:6]]) % 256
    with torch.no_grad():
        logits, reference = model(ids).logits.float(), dense(ids).logits
    assert (logits - reference).abs().max() < 0.15 * reference.abs().max()


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_quantized_tensors_are_cached_and_reloaded(tiny_folder, tokenizer, monkeypatch, capsys, fmt):
    """The second load reads the cache, and its kernels run on what it read (int8 from the file's memory map
    crashed: its kernel needs aligned weights)."""
    first, _ = load_model(str(tiny_folder), weights=fmt)
    assert "quantized" in capsys.readouterr().err  # progress of the first conversion
    path = quantized_cache_path(tiny_folder, fmt)
    assert path.is_file() and [p.name for p in path.parent.iterdir()] == [path.name]  # no partial file left

    def no_quantizing(*args, **kwargs):
        raise AssertionError("the second load quantized again instead of reading the cache")

    monkeypatch.setattr(formats, "quantized_tensors", no_quantizing)
    second, _ = load_model(str(tiny_folder), weights=fmt)
    assert "quantizing" not in capsys.readouterr().err
    assert weight_format(second) == fmt
    for name, buffer in first.named_buffers():
        assert torch.equal(buffer, dict(second.named_buffers())[name]), name
    assert accelgen.generate(first, tokenizer, PROMPT, max_new_tokens=12).token_ids == \
        accelgen.generate(second, tokenizer, PROMPT, max_new_tokens=12).token_ids
    assert quantized_cache_path(tiny_folder, "int8" if fmt == "int4" else "int4") != path


def test_a_failed_cache_write_leaves_no_file(tiny_folder, monkeypatch):
    import safetensors.torch

    def dies_halfway(tensors, filename, metadata=None):
        with open(filename, "wb") as handle:
            handle.write(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(safetensors.torch, "save_file", dies_halfway)
    with pytest.raises(KeyboardInterrupt):
        load_model(str(tiny_folder), weights="int8")
    path = quantized_cache_path(tiny_folder, "int8")
    assert not path.exists() and not list(path.parent.iterdir())


def test_dense_formats_and_compute_dtype(tiny_folder):
    assert weight_format(load_model(str(tiny_folder), weights="bf16", dtype="float32")[0]) == "bf16"
    assert weight_format(load_model(str(tiny_folder), weights="fp32")[0]) == "fp32"
    model, _ = load_model(str(tiny_folder), weights="int8", dtype="float32")  # int8 weights, fp32 activations
    assert weight_format(model) == "int8" and model.model.embed_tokens.weight.dtype == torch.float32
    assert load_model(str(tiny_folder), weights="int8")[0].model.norm.weight.dtype == torch.bfloat16


@pytest.fixture
def fresh_kernel_probe():
    formats.kernel_error.cache_clear()
    yield
    formats.kernel_error.cache_clear()


def test_clear_errors(fresh_kernel_probe, monkeypatch):
    with pytest.raises(ValueError, match="unknown weights format 'int3'.*fp32, bf16, int8, int4"):
        load_model("anything", weights="int3")
    with pytest.raises(ValueError, match=r"layer '0' of shape \(out 10, in 100\).*groups of 64$"):
        quantize(torch.nn.Sequential(torch.nn.Linear(100, 10)), "int4")
    with pytest.raises(ValueError, match=r"layer '1' of shape \(out 16, in 72\).*groups of 64; use weights=int8"):
        quantize(torch.nn.Sequential(torch.nn.Linear(64, 16), torch.nn.Linear(72, 16)), "int4")
    with pytest.raises(ValueError, match=r"\(out 24, in 64\).*multiple of 16 outputs"):
        quantize(torch.nn.Sequential(torch.nn.Linear(64, 24)), "int4")
    with pytest.raises(ValueError, match=r"\(out 16, in 100\).*blocks of 8"):
        quantize(torch.nn.Sequential(torch.nn.Linear(100, 16)), "int8")
    monkeypatch.delattr(torch, "_weight_int4pack_mm_for_cpu")
    formats.kernel_error.cache_clear()  # the kernels are probed once per process
    with pytest.raises(ValueError, match="weights=int4 cannot run.*torch._weight_int4pack_mm_for_cpu is missing"):
        quantize(torch.nn.Sequential(torch.nn.Linear(64, 16)), "int4")

    def not_for_this_cpu(*args):
        raise NotImplementedError("Could not run '_weight_int8pack_mm' with arguments from the 'CPU' backend")

    monkeypatch.setattr(torch, "_weight_int8pack_mm", not_for_this_cpu)
    formats.kernel_error.cache_clear()
    with pytest.raises(ValueError, match="weights=int8 cannot run.*_weight_int8pack_mm failed.*CPU' backend"):
        load_model("smollm2-135m", weights="int8")  # said before anything is loaded


def test_real_model_in_int8_and_int4(smollm, tokenizer):
    """SmolLM2-135M (tied embeddings) as loaded by default (bf16 activations): quantized, it still predicts what
    the dense model does on plain text, and its LM head reads back as a dense weight for draft heads."""
    dense = smollm[0]
    ids = tokenizer("def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)",
                    return_tensors="pt").input_ids
    with torch.no_grad():
        reference = dense(ids).logits[0].argmax(-1)
    for fmt, least in (("int8", 0.9), ("int4", 0.7)):
        model = copy.deepcopy(dense)
        quantize(model, fmt)
        with torch.no_grad():
            agreement = (model(ids).logits[0].argmax(-1) == reference).float().mean().item()
        assert agreement >= least, (fmt, agreement)
        head = model.get_output_embeddings().weight.float()
        assert (head - dense.lm_head.weight).abs().mean() < 0.2 * dense.lm_head.weight.abs().mean()


# t(1), t(8) in seconds. AVX2-like (the 1.5B's linears on an AVX2 EPYC, plus the rest of the forward): the
# packed formats win plain decoding, and int8's cheaper 8-token forward wins once speculation yields 5 tokens.
AVX2 = {"int4": {"t1": 0.20, "t8": 0.85}, "int8": {"t1": 0.22, "t8": 0.80},
        "bf16": {"t1": 0.30, "t8": 1.9}, "fp32": {"t1": 0.55, "t8": 2.1}}
AVX2_GGUF = {"gguf": {"t1": 0.12, "t8": 0.85}, **AVX2}
# native-bf16-like (AMX / AVX-512 BF16): bf16 is fast and verification nearly free
NATIVE_BF16 = {"int4": {"t1": 0.085, "t8": 0.16}, "int8": {"t1": 0.09, "t8": 0.14},
               "bf16": {"t1": 0.08, "t8": 0.09}, "fp32": {"t1": 0.16, "t8": 0.20}}


@pytest.mark.parametrize("timings,plain,speculative", [(AVX2, "int4", "int8"), (AVX2_GGUF, "gguf", "gguf"),
                                                       (NATIVE_BF16, "bf16", "bf16")])
def test_probe_chooses_by_measurement_and_caches_the_timings(tmp_path, monkeypatch, timings, plain, speculative):
    monkeypatch.setenv("ACCELGEN_CACHE", str(tmp_path))
    measured = []

    def fake_measure(name, fmt, threads):
        measured.append(fmt)
        return timings[fmt]

    choice = probe.choose_weights("some-model", measure=fake_measure, candidates=list(timings))
    assert choice["weights"] == plain and choice["formula"] == "1 / t(1)" and plain in choice["reason"]
    assert choice["timings"] == timings and "flags" in choice["machine"]
    again = probe.choose_weights("some-model", measure=fake_measure, candidates=list(timings), tokens_per_verify=5)
    assert len(measured) == len(timings)  # the second call read the cached timings
    assert again["weights"] == speculative and "5 / t(8)" in again["formula"]
    assert probe.cached_choice("some-model")["weights"] == plain
    assert f"weights=auto picks {plain}" in probe.probe_report("some-model")
    files = list((tmp_path / "weights-probe").rglob("*"))
    assert [f.suffix for f in files if f.is_file()] == [".json"]  # written atomically: no partial file


def test_probe_skips_formats_that_cannot_load(tmp_path, monkeypatch):
    monkeypatch.setenv("ACCELGEN_CACHE", str(tmp_path))

    def fake_measure(name, fmt, threads):
        if fmt == "int4":
            raise ValueError("layer has 100 inputs")
        return {"t1": 0.3 if fmt == "int8" else 0.5, "t8": 1.0}

    choice = probe.choose_weights("m", measure=fake_measure, candidates=["int4", "int8", "bf16"])
    assert choice["weights"] == "int8" and "int4" not in choice["timings"]


def test_probe_measures_a_real_model(tiny_folder, monkeypatch):
    """The real measurement on a tiny model: both timings, keyed by the model's folder."""
    monkeypatch.setattr(probe, "PROBE_REPEATS", 1)
    choice = probe.choose_weights(str(tiny_folder), candidates=["int8", "bf16"])
    assert set(choice["timings"]) == {"int8", "bf16"} and choice["weights"] in ("int8", "bf16")
    assert all(timing["t1"] > 0 and timing["t8"] > 0 for timing in choice["timings"].values())
    saved = json.loads(probe.probe_path(str(tiny_folder)).read_text())
    assert saved["model"] == str(tiny_folder) and "weights" not in saved  # timings are cached, the choice is made per call
    model, _ = load_model(str(tiny_folder), weights="auto")
    assert weight_format(model) == choice["weights"]


def test_models_command_shows_the_choice(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from accelgen.cli import app

    monkeypatch.setenv("ACCELGEN_CACHE", str(tmp_path))
    probe.choose_weights("smollm2-135m", measure=lambda name, fmt, threads: AVX2[fmt], candidates=list(AVX2))
    result = CliRunner().invoke(app, ["models"])
    assert result.exit_code == 0, result.output
    assert "smollm2-135m: weights=auto picks int4 on this machine" in result.output


def test_a_head_trains_on_a_quantized_target(tiny_folder, tmp_path):
    """`train eagle --weights int8`: features, the LM head's rows and the gradient through it from the target as
    loaded; training rejects formats that are not PyTorch models."""
    from typer.testing import CliRunner

    from accelgen.cli import app

    texts = tmp_path / "texts.jsonl"
    texts.write_text("".join(json.dumps({"text": f"line {i}: the quick brown fox"}) + "\n" for i in range(40)))
    arguments = ["train", "eagle", "--model", str(tiny_folder), "--dataset", f"jsonl:{texts}", "--windows", "4",
                 "--held-out", "2", "--seq-len", "12", "--steps", "2", "--batch-size", "2", "--ce-positions", "8",
                 "--draft-vocab", "300", "--out", str(tmp_path / "head")]
    result = CliRunner().invoke(app, [*arguments, "--weights", "int8"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "head" / "evaluation.json").exists()
    refused = CliRunner().invoke(app, [*arguments, "--weights", "gguf"])
    assert refused.exit_code == 2 and "training needs the PyTorch model" in refused.output

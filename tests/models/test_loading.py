"""Where a model is loaded: resolve_device's answers and errors, load_model(device=...) on the CPU here, and on a
CUDA device (skipped without one) the model moved there, bf16 by default, int8/int4 and weights=auto on it.

On a GPU machine without the embedded models: `ACCELGEN_TOKENIZER=<a saved tokenizer folder of vocabulary 49152>
python -m pytest tests/models/test_loading.py` (as tests/test_cuda.py)."""

from __future__ import annotations

import os
import re

import pytest
import torch

import accelgen
from accelgen.models import checkpoints, formats, probe
from accelgen.models.loading import load_model, resolve_device

PROMPT = [5, 17, 923, 4410, 77, 12, 5, 17, 923]
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def tokenizer(request):
    """SmolLM2's tokenizer (the tiny models' vocabulary), or the one ACCELGEN_TOKENIZER names."""
    from transformers import AutoTokenizer

    folder = os.environ.get("ACCELGEN_TOKENIZER")
    return AutoTokenizer.from_pretrained(folder) if folder else request.getfixturevalue("smollm")[1]


@pytest.fixture
def one_gpu(monkeypatch):
    """torch as if it saw one CUDA device (nothing is run on it)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


@pytest.mark.parametrize("asked", [None, "cpu", "CPU", " cpu ", "cpu:0", torch.device("cpu")])
def test_the_cpu_by_default_and_by_name(asked):
    assert resolve_device(asked) == torch.device("cpu")


def test_auto_is_cuda_only_where_torch_sees_a_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert resolve_device("auto") == torch.device("cuda", 1)  # the current device, with its index


def test_cuda_names_the_device_it_means(one_gpu):
    assert resolve_device("cuda") == torch.device("cuda", 0)
    assert resolve_device("cuda:0") == torch.device("cuda", 0)
    assert resolve_device(torch.device("cuda")) == torch.device("cuda", 0)
    with pytest.raises(ValueError, match=r"^device 'cuda:3' asked for, but torch sees 1 CUDA device \(cuda:0\)$"):
        resolve_device("cuda:3")


@pytest.mark.parametrize("asked", ["gpu", "cuda:x", "cuda:", "mps", "", "cuda0"])
def test_an_unknown_device_is_named_with_the_choices(asked):
    with pytest.raises(ValueError, match=rf"^unknown device '{asked}': choose cpu, cuda, cuda:N or auto$"):
        resolve_device(asked)


def test_a_torch_device_accelgen_does_not_run_on_is_named():
    with pytest.raises(ValueError, match="^device 'meta' is not supported: choose cpu, cuda, cuda:N or auto$"):
        resolve_device(torch.device("meta"))


def test_cuda_without_a_cuda_device_says_what_torch_sees(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(ValueError, match=rf"^device 'cuda' asked for, but torch sees no CUDA device "
                                         rf"\(torch {re.escape(torch.__version__)}, built for CPU\)$"):
        resolve_device("cuda")
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    with pytest.raises(ValueError, match=r"device 'cuda:1' asked for.*built for CUDA 12.8\)$"):
        resolve_device("cuda:1")


def test_load_model_on_the_cpu_explicitly(tiny_folder, tokenizer):
    model, _ = load_model(str(tiny_folder), device="cpu")
    assert model.device == torch.device("cpu") and model.dtype == torch.float32  # the checkpoint's own dtype
    default, _ = load_model(str(tiny_folder))
    assert accelgen.generate(model, tokenizer, PROMPT, max_new_tokens=8).token_ids == \
        accelgen.generate(default, tokenizer, PROMPT, max_new_tokens=8).token_ids
    assert load_model(str(tiny_folder), device=torch.device("cpu"))[0].device == torch.device("cpu")


def test_a_device_that_is_not_there_is_refused_before_loading(tiny_folder, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(checkpoints, "prepare_embedded", lambda name: pytest.fail("converted a model"))
    with pytest.raises(ValueError, match="device 'cuda' asked for, but torch sees no CUDA device"):
        load_model("smollm2-135m", device="cuda")
    with pytest.raises(ValueError, match="unknown device 'gpu'"):
        load_model(str(tiny_folder), device="gpu")


def test_gguf_on_a_gpu_is_refused_by_name(tiny_folder, one_gpu, monkeypatch):
    monkeypatch.setattr(probe, "choose_weights", lambda *args, **kwargs: pytest.fail("probed the CPU formats"))
    with pytest.raises(ValueError, match=r"weights=gguf runs on llama.cpp's CPU engine only, not on cuda:0"):
        load_model(str(tiny_folder), weights="gguf", device="cuda")


def test_auto_on_a_gpu_is_bf16_without_a_probe():
    choice = probe.device_choice(torch.device("cuda", 0))
    assert choice["weights"] == "bf16" and choice["timings"] == {}
    assert "on cuda:0" in choice["reason"] and "CPU" in choice["reason"]


def test_an_int4_layer_packed_for_the_cpu_cannot_be_packed_for_another_device():
    layer = formats.quantized_layer(torch.nn.Linear(64, 16), "int4")
    assert layer.packing == "cpu"
    assert formats.move_to(layer, "cpu") is layer and layer.packing == "cpu"  # already there: nothing to pack
    with pytest.raises(ValueError, match="int4 weights packed for the cpu cannot be packed for meta"):
        formats.move_to(layer, "meta")


# --- on a CUDA device ------------------------------------------------------------------------------------


@cuda
def test_load_model_moves_the_model_to_cuda_in_bf16(tiny_folder, tokenizer):
    model, _ = load_model(str(tiny_folder), device="cuda")
    assert model.device.type == "cuda" and model.dtype == torch.bfloat16  # bf16 by default on a GPU
    assert all(p.device.type == "cuda" for p in model.parameters())
    fp32, _ = load_model(str(tiny_folder), device="cuda", dtype="float32")
    cpu, _ = load_model(str(tiny_folder), device="cpu")
    assert fp32.dtype == torch.float32
    on_gpu = accelgen.generate(fp32, tokenizer, PROMPT, max_new_tokens=12).token_ids
    assert on_gpu == accelgen.generate(cpu, tokenizer, PROMPT, max_new_tokens=12).token_ids


@cuda
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantized_formats_run_on_cuda_as_on_the_cpu(tiny_folder, tokenizer, fmt):
    on_cpu, _ = load_model(str(tiny_folder), weights=fmt)
    on_gpu, _ = load_model(str(tiny_folder), weights=fmt, device="cuda")
    assert on_gpu.device.type == "cuda" and formats.weight_format(on_gpu) == fmt
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        expected = on_cpu(ids).logits.float()
        logits = on_gpu(ids.to(on_gpu.device)).logits.float().cpu()
    assert (logits - expected).abs().max() < 0.05 * expected.abs().max()  # bf16 kernels of two devices
    head = on_gpu.lm_head
    assert (head.weight.float().cpu() - on_cpu.lm_head.weight.float()).abs().max() < 1e-2 * \
        on_cpu.lm_head.weight.float().abs().max()  # the dense weight read back from either packing
    result = accelgen.generate(on_gpu, tokenizer, PROMPT, method="pld", max_new_tokens=12)
    assert result.token_ids == accelgen.generate(on_gpu, tokenizer, PROMPT, max_new_tokens=12).token_ids


@cuda
def test_an_int4_model_moved_by_hand_says_how_to_load_it(tiny_folder):
    model, _ = load_model(str(tiny_folder), weights="int4")
    model.to("cuda")  # .to cannot repack
    with pytest.raises(ValueError, match="packed for the cpu's kernel but runs on cuda"):
        model(torch.tensor([PROMPT], device="cuda"))


@cuda
def test_auto_on_cuda_picks_bf16_and_says_so(tiny_folder, monkeypatch, capsys):
    monkeypatch.setattr(probe, "choose_weights", lambda *args, **kwargs: pytest.fail("probed the CPU formats"))
    model, _ = load_model(str(tiny_folder), weights="auto", device="cuda")
    assert model.dtype == torch.bfloat16 and model.device.type == "cuda"
    assert "weights=auto on cuda:" in capsys.readouterr().err


# --- the default format of an embedded model (neither weights nor dtype given) ---------------------------------


def loaded_format(model) -> str:
    from accelgen.costs import model_format

    return model_format(model)


@pytest.mark.skipif("gguf" not in probe.available_candidates("smollm2-135m"), reason="needs xllamacpp")
def test_an_embedded_model_loads_as_shipped_before_any_probe_and_says_why(smollm, monkeypatch, capsys):
    monkeypatch.setattr(probe, "cached_choice", lambda name, threads=None: None)  # this machine never probed
    model, _ = load_model("smollm2-135m")
    assert loaded_format(model) == "gguf"
    said = capsys.readouterr().err
    assert "smollm2-135m loads as weights=gguf: its GGUF file as shipped" in said and "--weights" in said


def test_an_embedded_model_loads_in_the_format_measured_fastest(smollm, monkeypatch, capsys):
    measured = {"weights": "fp32", "reason": "most tokens/s by 1 / t(1) on this machine: fp32 9.0 tok/s"}
    monkeypatch.setattr(probe, "cached_choice", lambda name, threads=None: measured)
    model, _ = load_model("smollm2-135m")
    assert model.dtype == torch.float32
    assert "loads as weights=fp32: the fastest format measured on this machine (most tokens/s" in capsys.readouterr().err


def test_explicit_weights_or_dtype_win_and_other_models_keep_their_dtype(smollm, tiny_folder, monkeypatch, capsys):
    monkeypatch.setattr(probe, "cached_choice", lambda name, threads=None: pytest.fail("chose a default format"))
    assert load_model("smollm2-135m", weights="bf16")[0].dtype == torch.bfloat16
    assert load_model("smollm2-135m", dtype="float32")[0].dtype == torch.float32
    assert load_model(str(tiny_folder))[0].dtype == torch.float32  # a checkpoint of the user's: its own dtype
    assert "loads as weights=" not in capsys.readouterr().err


def test_default_weights_only_for_embedded_models_on_the_cpu():
    from accelgen.models.loading import default_weights, pytorch_weights

    assert default_weights("some/hub-model", torch.device("cpu"), None) is None
    assert default_weights("smollm2-135m", torch.device("cuda"), None) is None  # a GPU: bf16, as before
    assert pytorch_weights("smollm2-135m", None) == "bf16"  # training and layer walks need a PyTorch model
    assert pytorch_weights("smollm2-135m", None, "float32") is None  # the dtype decides
    assert pytorch_weights("smollm2-135m", "int8") == "int8" and pytorch_weights("some/hub-model", None) is None

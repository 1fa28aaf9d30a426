"""The GGUF writer: a tiny Llama and a tiny Qwen2 written as GGUF files that llama.cpp loads and whose logits match
PyTorch's (closely at F32, to the top token at Q8_0); the vocabulary llama.cpp needs; the cache; a clear error for
an architecture the writer does not know."""

from __future__ import annotations

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM

pytest.importorskip("gguf", reason="writing GGUF files needs `pip install 'accelgen[gguf]'`")
pytest.importorskip("xllamacpp", reason="the llama.cpp engine needs `pip install 'accelgen[llamacpp]'`")

from accelgen.models import gguf_writer  # noqa: E402
from accelgen.models.gguf_writer import UnsupportedArchitecture, vocabulary, write_gguf, written_gguf  # noqa: E402
from accelgen.models.llamacpp import LlamaCppModel  # noqa: E402

PROMPT = torch.tensor([5, 17, 923, 441, 77, 12, 300, 41])  # ids below 1024: every tiny model has them
# llama.cpp's F32 file still keeps its KV cache in f16 and sums in its own order: measured 1e-3 of the largest logit
F32_TOLERANCE = 5e-3
# Q8_0 rounds every weight (and llama.cpp each activation) to 8 bits: measured up to 0.08 of the largest logit on
# these random models; a wrong layout (e.g. llama's q/k rows not permuted) moves logits by about that magnitude
Q8_TOLERANCE = 0.15


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny(request, make_tiny_model):
    """A tiny model over the first 1024 tokens of SmolLM2's tokenizer (quick to write)."""
    return make_tiny_model(request.param, seed=0, vocab_size=1024)


@pytest.fixture(scope="module")
def small_llama(make_tiny_model):
    return make_tiny_model("llama", seed=0, vocab_size=1024)


def llamacpp_logits(path) -> torch.Tensor:
    """(len(PROMPT), vocab) float32 logits of llama.cpp over PROMPT."""
    return LlamaCppModel(path, threads=1).new_runner().forward(PROMPT)


def torch_logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(PROMPT[None]).logits[0].float()


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).abs().max() / expected.abs().max())


def test_f32_round_trip_matches_pytorch(tiny, tokenizer, tmp_path):
    path = write_gguf(tiny, tokenizer, tmp_path / "tiny.gguf", "f32")
    assert relative_error(llamacpp_logits(path), torch_logits(tiny)) < F32_TOLERANCE


def test_q8_0_round_trip_keeps_the_best_tokens(tiny, tokenizer, tmp_path):
    path = write_gguf(tiny, tokenizer, tmp_path / "tiny.gguf", "q8_0")
    written, expected = llamacpp_logits(path), torch_logits(tiny)
    assert relative_error(written, expected) < Q8_TOLERANCE
    # llama.cpp's top token is one of PyTorch's best five at every position (ties among those are within Q8_0's
    # rounding); a wrong layout lands anywhere in the vocabulary
    top_five = expected.topk(5, dim=-1).indices  # (positions, 5)
    assert (top_five == written.argmax(-1, keepdim=True)).any(-1).all()


def test_q4_0_is_smaller_and_loads(small_llama, tokenizer, tmp_path):
    model = small_llama
    q8, q4 = (write_gguf(model, tokenizer, tmp_path / f"{kind}.gguf", kind) for kind in ("q8_0", "q4_0"))
    assert q4.stat().st_size < q8.stat().st_size
    assert llamacpp_logits(q4).shape == (len(PROMPT), model.config.vocab_size)


def test_llama_needs_its_rotary_rows_permuted(small_llama, tokenizer, tmp_path, monkeypatch):
    """The check above fails when the writer leaves llama's q/k rows as transformers stores them."""
    model = small_llama
    monkeypatch.setattr(gguf_writer, "permute_rotary", lambda values, heads: values)
    path = write_gguf(model, tokenizer, tmp_path / "unpermuted.gguf", "f32")
    assert relative_error(llamacpp_logits(path), torch_logits(model)) > F32_TOLERANCE


def test_vocabulary_has_one_token_per_embedding_row(tokenizer):
    import gguf

    tokens, types, merges = vocabulary(tokenizer, len(tokenizer) + 3)
    assert tokens[:len(tokenizer)] == [tokenizer.convert_ids_to_tokens(i) for i in range(len(tokenizer))]
    assert tokens[-3:] == [f"[PAD{len(tokenizer) + i}]" for i in range(3)]
    assert types[-1] == gguf.TokenType.UNUSED and types[tokenizer.eos_token_id] == gguf.TokenType.CONTROL
    assert merges and all(len(merge.split(" ")) == 2 for merge in merges[:100])
    small, _, small_merges = vocabulary(tokenizer, 300)  # a model smaller than its tokenizer: ids beyond left out
    assert small == [tokenizer.convert_ids_to_tokens(i) for i in range(300)]
    assert small_merges and all(set(merge.split(" ")) <= set(small) for merge in small_merges)


def test_written_once_then_read_from_the_cache(make_tiny_model, tokenizer, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ACCELGEN_CACHE", str(tmp_path))
    model = make_tiny_model("qwen2", seed=0, vocab_size=1024)
    path = written_gguf(model, tokenizer, "q8_0")
    assert "writing" in capsys.readouterr().err
    assert written_gguf(model, tokenizer, "q8_0") == path and "writing" not in capsys.readouterr().err
    assert [entry.name for entry in path.parent.iterdir()] == [path.name]  # no partial file left behind
    other = make_tiny_model("qwen2", seed=1, vocab_size=1024)  # other weights, another file
    assert written_gguf(other, tokenizer, "q8_0") != path


def test_an_unknown_architecture_is_refused_by_name(tokenizer, tmp_path):
    config = MistralConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(UnsupportedArchitecture, match=r"model type 'mistral'.*quantized=int8"):
        write_gguf(MistralForCausalLM(config), tokenizer, tmp_path / "mistral.gguf")
    assert not (tmp_path / "mistral.gguf").exists()


def test_an_unknown_type_is_refused(small_llama, tokenizer, tmp_path):
    with pytest.raises(ValueError, match="unknown gguf_type 'q3_k'"):
        write_gguf(small_llama, tokenizer, tmp_path / "x.gguf", "q3_k")

"""Write a transformers causal LM as a GGUF file that llama.cpp runs: the quantized self-draft of any checkpoint.

A Hugging Face checkpoint (a folder of safetensors, or a model built in memory) has no GGUF file; `qspec`
(drafters/qspec.py) drafts with the target's own copy run by llama.cpp, so one is written here with the `gguf`
package's writer: its tensor-name maps (gguf.TensorNameMap) turn the checkpoint's names into llama.cpp's, and its
numpy quantizers (gguf.quants) store the layers as Q8_0 or Q4_0 (blocks of 32 inputs, one scale each).

    gguf_type   decoder layers   token embedding, LM head   norms, biases
    f32         F32              F32                        F32
    q8_0        Q8_0             Q8_0                       F32
    q4_0        Q4_0             Q8_0                       F32

Architectures written: llama (SmolLM2, Llama, TinyLlama, ...) and qwen2. Llama's q/k projections are permuted
(llama.cpp's llama rotates interleaved pairs, transformers rotates halves); qwen2 rotates halves in both, so it
keeps its weights. Another architecture is refused by name (UnsupportedArchitecture).

The tokenizer is written as a byte-level BPE vocabulary (tokens, token types, merges) with the pre-tokenizer
"default": accelgen passes token ids between the engines and never lets llama.cpp tokenize text, so the
vocabulary only has to load, with one entry per row of the embedding (padded like transformers' vocab_size).

Written files are cached (`written_gguf`): keyed by the checkpoint's weight files (or by a hash of the weights of
a model built in memory) and the type, written to a temporary file and renamed, with progress on stderr.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import torch

from accelgen.atomic import write_atomically
from accelgen.errors import InputError
from accelgen.models.checkpoints import stderr_progress

GGUF_TYPES = ("q8_0", "q4_0", "f32")
WRITER_VERSION = 1  # part of the cache key: a change to what is written makes files written before stale
BLOCK = 32  # inputs per Q8_0 / Q4_0 block: a row length that is not a multiple of it stays F32
SKIPPED_TENSORS = ("rotary_emb.inv_freq",)  # buffers some checkpoints carry that llama.cpp recomputes


class UnsupportedArchitecture(ValueError):
    """The writer does not know this model type; the draft can still be a PyTorch int8/int4 copy."""


def architectures() -> dict[str, object]:
    """transformers model_type -> gguf.MODEL_ARCH of the architectures this writer knows."""
    import gguf

    return {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2}


def check_writable(config) -> None:
    """An UnsupportedArchitecture naming the model type (or rope scaling) the writer cannot write."""
    model_type = getattr(config, "model_type", None)
    if model_type not in architectures():
        raise UnsupportedArchitecture(
            f"accelgen cannot write a GGUF file for model type {model_type!r} (it writes {', '.join(architectures())}); "
            "draft with a PyTorch copy instead: qspec's option quantized=int8 (or int4)")
    rope = rope_parameters(config)
    if rope.get("rope_type", "default") not in ("default", "linear"):
        raise UnsupportedArchitecture(f"accelgen cannot write a GGUF file for rope scaling {rope['rope_type']!r}; "
                                      "draft with quantized=int8 (or int4) instead")


def rope_parameters(config) -> dict:
    """{"rope_theta", "rope_type", "factor"?}: transformers 5's rope_parameters, or the older separate fields."""
    parameters = dict(getattr(config, "rope_parameters", None) or {})
    parameters.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    scaling = getattr(config, "rope_scaling", None) or {}
    parameters.setdefault("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if "factor" in scaling:
        parameters.setdefault("factor", scaling["factor"])
    return parameters


def write_gguf(model, tokenizer, path: Path, gguf_type: str = "q8_0", progress=None) -> Path:
    """Write `model` (a transformers llama or qwen2 causal LM) and its tokenizer as a GGUF file at `path` (written
    there directly: `written_gguf` makes it atomic). progress(done, total, name) after each tensor."""
    import gguf

    if gguf_type not in GGUF_TYPES:
        raise InputError(f"unknown gguf_type {gguf_type!r}; choose one of {', '.join(GGUF_TYPES)}")
    config = model.config
    check_writable(config)
    arch = architectures()[config.model_type]
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    add_hyperparameters(writer, config, gguf_type)
    add_vocabulary(writer, tokenizer, config)
    tensors = list(gguf_tensors(model, arch))
    for done, (name, values) in enumerate(tensors, 1):
        data, raw_type = encode(name, values, gguf_type)
        writer.add_tensor(name, data, raw_dtype=raw_type)
        if progress is not None:
            progress(done, len(tensors), name)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def add_hyperparameters(writer, config, gguf_type: str) -> None:
    import gguf

    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    rope = rope_parameters(config)
    writer.add_name(Path(str(getattr(config, "_name_or_path", "") or config.model_type)).name or config.model_type)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_head_count(heads)
    writer.add_head_count_kv(getattr(config, "num_key_value_heads", None) or heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    if rope["rope_type"] == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type({"f32": gguf.LlamaFileType.ALL_F32, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
                          "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}[gguf_type])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def vocabulary(tokenizer, vocab_size: int) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) for llama.cpp's byte-level BPE vocabulary: one token per embedding row, ids as
    the tokenizer's; rows the tokenizer has no token for are [PAD<id>] (UNUSED), and its ids beyond the embedding
    are left out (the model never produces them). A tokenizer that is not BPE (or none) gives its vocabulary
    without merges: llama.cpp never tokenizes text for accelgen."""
    import gguf

    by_id: dict[int, str] = {}
    types: dict[int, int] = {}
    merges: list[str] = []
    if tokenizer is not None:
        by_id = {index: token for token, index in tokenizer.get_vocab().items()}
        for index, added in getattr(tokenizer, "added_tokens_decoder", {}).items():
            by_id[index] = added.content
            types[index] = gguf.TokenType.CONTROL if added.special else gguf.TokenType.USER_DEFINED
        kept = {token for index, token in by_id.items() if index < vocab_size}
        merges = [merge for merge in bpe_merges(tokenizer)  # those whose parts and result the vocabulary keeps
                  if {*merge.split(" "), merge.replace(" ", "")} <= kept]
    tokens = [by_id.get(index, f"[PAD{index}]") for index in range(vocab_size)]
    token_types = [types.get(index, gguf.TokenType.NORMAL if index in by_id else gguf.TokenType.UNUSED)
                   for index in range(vocab_size)]
    return tokens, [int(kind) for kind in token_types], merges


def bpe_merges(tokenizer) -> list[str]:
    """The BPE merges of a fast tokenizer, as "left right" strings ([] for another tokenizer model)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return []
    model = json.loads(backend.to_str()).get("model", {})
    if model.get("type") != "BPE":
        return []
    return [" ".join(pair) if isinstance(pair, list) else pair for pair in model.get("merges", [])]


def add_vocabulary(writer, tokenizer, config) -> None:
    tokens, token_types, merges = vocabulary(tokenizer, config.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")  # loads; llama.cpp's own tokenizing is never used
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_merges(merges or [f"{tokens[0]} {tokens[0]}"])  # llama.cpp refuses a BPE vocabulary without any
    special = {"bos": getattr(config, "bos_token_id", None), "eos": getattr(config, "eos_token_id", None),
               "pad": getattr(config, "pad_token_id", None)}
    if tokenizer is not None:
        special = {kind: getattr(tokenizer, f"{kind}_token_id", None) if getattr(tokenizer, f"{kind}_token_id", None)
                   is not None else value for kind, value in special.items()}
    for kind, value in special.items():
        if isinstance(value, list):
            value = value[0] if value else None
        if value is not None:
            getattr(writer, f"add_{kind}_token_id")(int(value))
    writer.add_add_bos_token(False)  # accelgen encodes prompts itself
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str):
        writer.add_chat_template(template)


def gguf_tensors(model, arch):
    """(llama.cpp name, float32 numpy array) of every tensor of the model, llama's q/k rows permuted."""
    import gguf

    config = model.config
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    tied = bool(getattr(config, "tie_word_embeddings", False))
    for hf_name, tensor in model.state_dict().items():
        if hf_name.endswith(SKIPPED_TENSORS) or (tied and hf_name == "lm_head.weight"):
            continue
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise UnsupportedArchitecture(f"accelgen's GGUF writer does not know tensor {hf_name!r} of this "
                                          f"{config.model_type} model; draft with quantized=int8 instead")
        values = tensor.detach().to("cpu", torch.float32)
        if arch == gguf.MODEL_ARCH.LLAMA and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            values = permute_rotary(values, heads)
        elif arch == gguf.MODEL_ARCH.LLAMA and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            values = permute_rotary(values, kv_heads)
        yield name, values.numpy()


def permute_rotary(values: torch.Tensor, heads: int) -> torch.Tensor:
    """(heads · head_dim, ...) rows of a q or k projection, each head's halves interleaved: transformers rotates
    dimension i with i + head_dim/2, llama.cpp's llama rotates 2i with 2i + 1 (as llama.cpp's converter permutes)."""
    rows = values.shape[0]
    return values.reshape(heads, 2, rows // heads // 2, *values.shape[1:]).swapaxes(1, 2).reshape(values.shape)


def encode(name: str, values: np.ndarray, gguf_type: str):
    """(data, raw type) of one tensor as gguf_type stores it (see the module's table)."""
    from gguf import GGMLQuantizationType, quants

    if gguf_type == "f32" or values.ndim < 2 or values.shape[-1] % BLOCK:
        return np.ascontiguousarray(values, dtype=np.float32), GGMLQuantizationType.F32
    kind = GGMLQuantizationType.Q8_0
    if gguf_type == "q4_0" and name not in ("token_embd.weight", "output.weight"):
        kind = GGMLQuantizationType.Q4_0
    return quants.quantize(np.ascontiguousarray(values, dtype=np.float32), kind), kind


# --- the cache ------------------------------------------------------------------------------------------------


def written_gguf(model, tokenizer, gguf_type: str = "q8_0") -> Path:
    """The GGUF file of `model` at gguf_type, written once into the cache folder and reused after."""
    from accelgen.models.loading import cache_dir

    check_writable(model.config)
    if gguf_type not in GGUF_TYPES:
        raise InputError(f"unknown gguf_type {gguf_type!r}; choose one of {', '.join(GGUF_TYPES)}")
    path = cache_dir() / "gguf-written" / f"{model_name(model)}-{gguf_type}-{weights_key(model)}.gguf"
    if path.is_file():
        return path
    print(f"accelgen: writing {path.name} for llama.cpp once; later drafts read it from the cache", file=sys.stderr)
    progress = stderr_progress("wrote", "tensors")
    write_atomically(path, lambda partial: write_gguf(model, tokenizer, partial, gguf_type, progress))
    return path


def model_name(model) -> str:
    source = str(getattr(model, "name_or_path", "") or getattr(model.config, "_name_or_path", "") or "")
    return Path(source).name or model.config.model_type


def weights_key(model) -> str:
    """What the written file depends on: the checkpoint's weight files (path, size, time) where the model was read
    from a folder, else the weights themselves (a model built in memory); and the writer's version."""
    source = Path(str(getattr(model, "name_or_path", "") or ""))
    files = sorted([*source.glob("*.safetensors"), *source.glob("*.bin")]) if source.is_dir() else []
    digest = hashlib.sha1(f"v{WRITER_VERSION}".encode())
    if files:
        digest.update(";".join(f"{f.resolve()}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files).encode())
    else:
        for name, tensor in model.state_dict().items():
            digest.update(name.encode())
            digest.update(tensor.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]

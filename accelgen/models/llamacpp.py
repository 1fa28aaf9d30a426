"""A runner over llama.cpp's own engine, for GGUF files: every draft/verify method on llama.cpp's kernels.

On CPUs without native bf16 matrix instructions, PyTorch's dense and weight-only formats read or convert far
more than llama.cpp's quantized kernels do, so the same GGUF file decodes several times faster in llama.cpp.
This runner gives accelgen's loop that engine: it implements the `ModelRunner` interface (forward over a
chain or a token tree on top of the KV cache, logits per new token, `keep` to roll back) with llama.cpp's
C API, which the `xllamacpp` wheel ships and exports (called here through ctypes; no compiler needed).

Token trees map onto llama.cpp's sequences: the committed context is sequence 0; each leaf of a draft tree
gets a sequence of its own that first shares the context (a copy of the cells' sequence sets, no data
copied), and every node belongs to the sequences of the leaves below it, so it attends to exactly its
ancestors. `keep` then hands the accepted path's cells to sequence 0 and drops the leaf sequences.

Only what llama.cpp exposes is available: logits, not hidden states or per-layer access, so methods that
read the target's features (Medusa, EAGLE) or walk its layers (layer skipping, early exit) need the PyTorch
model. Lossless claims hold relative to this engine: a method is exact against `autoregressive` on the same
engine and file; where a batched forward rounds differently from a one-token forward the audit names it.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import os
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from accelgen.errors import InputError
from accelgen.models.block import Block

CONTEXT_TOKENS = 4096
BATCH_TOKENS = 512
MAX_SEQUENCES = 64  # sequence 0 + up to 63 leaves per draft tree

# xllamacpp's versions are <year>.<month>.<llama.cpp build>[.<patch>]: each wheel bundles that llama.cpp build, and
# the parameter structs below are those of the builds in LLAMA_BUILDS (llama.cpp changes them between builds, and a
# struct passed by value must match the library's exactly). Supporting another build: transcribe its
# include/llama.h structs, add its number here and widen the llamacpp extra in pyproject.toml to match.
LLAMA_BUILDS = range(11549, 11550)
XLLAMACPP_REQUIREMENT = ">=2026.10.11549,<2026.10.11550"  # the wheels bundling those builds (and their patches)


class LlamaCppError(RuntimeError):
    """llama.cpp could not be loaded, or refused a call; the message says what to do."""


class LlamaModelParams(ctypes.Structure):
    """`struct llama_model_params` of llama.cpp's include/llama.h (builds b11222 to b11549 at least)."""

    _fields_ = [
        ("devices", ctypes.c_void_p), ("tensor_buft_overrides", ctypes.c_void_p),
        ("n_gpu_layers", ctypes.c_int32), ("split_mode", ctypes.c_int), ("load_mode", ctypes.c_int),
        ("lazy_mode", ctypes.c_int), ("main_gpu", ctypes.c_int32),
        ("tensor_split", ctypes.c_void_p), ("progress_callback", ctypes.c_void_p),
        ("progress_callback_user_data", ctypes.c_void_p), ("kv_overrides", ctypes.c_void_p),
        ("vocab_only", ctypes.c_bool), ("check_tensors", ctypes.c_bool), ("use_extra_bufts", ctypes.c_bool),
        ("no_host", ctypes.c_bool), ("no_alloc", ctypes.c_bool), ("load_mtp", ctypes.c_bool),
    ]


class LlamaContextParams(ctypes.Structure):
    """`struct llama_context_params` of llama.cpp build b11549: include/llama.h of b11222 (commit a97cce86) with
    the one field b11549 adds, a pointer after type_v that the library fills (NULL) and accelgen leaves as it is."""

    _fields_ = [
        ("n_ctx", ctypes.c_uint32), ("n_batch", ctypes.c_uint32), ("n_ubatch", ctypes.c_uint32),
        ("n_seq_max", ctypes.c_uint32), ("n_rs_seq", ctypes.c_uint32), ("n_outputs_max", ctypes.c_uint32),
        ("n_outputs_max_per_seq", ctypes.c_uint32), ("n_threads", ctypes.c_int32), ("n_threads_batch", ctypes.c_int32),
        ("ctx_type", ctypes.c_int), ("rope_scaling_type", ctypes.c_int), ("pooling_type", ctypes.c_int),
        ("attention_type", ctypes.c_int), ("flash_attn_type", ctypes.c_int),
        ("rope_freq_base", ctypes.c_float), ("rope_freq_scale", ctypes.c_float), ("yarn_ext_factor", ctypes.c_float),
        ("yarn_attn_factor", ctypes.c_float), ("yarn_beta_fast", ctypes.c_float), ("yarn_beta_slow", ctypes.c_float),
        ("yarn_orig_ctx", ctypes.c_uint32), ("defrag_thold", ctypes.c_float),
        ("cb_eval", ctypes.c_void_p), ("cb_eval_user_data", ctypes.c_void_p),
        ("type_k", ctypes.c_int), ("type_v", ctypes.c_int),
        ("added_in_b11549", ctypes.c_void_p),
        ("abort_callback", ctypes.c_void_p), ("abort_callback_data", ctypes.c_void_p),
        ("embeddings", ctypes.c_bool), ("offload_kqv", ctypes.c_bool), ("no_perf", ctypes.c_bool),
        ("op_offload", ctypes.c_bool), ("swa_full", ctypes.c_bool), ("kv_unified", ctypes.c_bool),
        ("samplers", ctypes.c_void_p), ("n_samplers", ctypes.c_size_t),
        ("ctx_other", ctypes.c_void_p),
    ]


# what llama_context_default_params() of those builds returns in fields on both sides of the one b11549 added: a
# library whose defaults differ lays the struct out otherwise, whatever its version says
CONTEXT_DEFAULTS = {"n_ctx": 512, "n_batch": 2048, "n_ubatch": 512, "n_seq_max": 1, "n_outputs_max_per_seq": 1,
                    "yarn_ext_factor": -1.0, "type_k": 1, "type_v": 1, "offload_kqv": True, "op_offload": True,
                    "swa_full": True, "kv_unified": False}


class _Batch(ctypes.Structure):
    _fields_ = [("n_tokens", ctypes.c_int32), ("token", ctypes.POINTER(ctypes.c_int32)), ("embd", ctypes.c_void_p),
                ("pos", ctypes.POINTER(ctypes.c_int32)), ("n_seq_id", ctypes.POINTER(ctypes.c_int32)),
                ("seq_id", ctypes.POINTER(ctypes.POINTER(ctypes.c_int32))), ("logits", ctypes.POINTER(ctypes.c_int8))]


_library = None
_library_lock = threading.Lock()
_LOG_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
_silent = _LOG_CALLBACK(lambda level, text, user_data: None)


def library():
    """llama.cpp's C API from the xllamacpp wheel, its signatures declared, the backend initialised once."""
    global _library
    with _library_lock:
        if _library is None:
            _library = _load_library()
        return _library


def installed_xllamacpp_version() -> str | None:
    """The installed xllamacpp's version (None when it is not installed)."""
    try:
        return importlib.metadata.version("xllamacpp")
    except importlib.metadata.PackageNotFoundError:
        return None


def llama_build(xllamacpp_version: str) -> int | None:
    """The llama.cpp build an xllamacpp version bundles ("2026.10.11549" -> 11549); None for a version not in
    that scheme (the 0.x wheels)."""
    match = re.fullmatch(r"\d{4}\.\d{1,2}\.(\d+)(\.\d+)?", xllamacpp_version)
    return int(match.group(1)) if match else None


def check_xllamacpp_version(version: str | None) -> None:
    """A LlamaCppError naming the version found and the one needed, unless xllamacpp bundles a supported build."""
    install = f"pip install 'xllamacpp{XLLAMACPP_REQUIREMENT}'"
    if version is None:
        raise LlamaCppError(f"the llama.cpp engine needs the xllamacpp package: pip install 'accelgen[llamacpp]' "
                            f"(or {install})")
    if llama_build(version) not in LLAMA_BUILDS:
        raise LlamaCppError(f"xllamacpp {version} is installed, but accelgen's llama.cpp engine binds the C API of "
                            f"xllamacpp{XLLAMACPP_REQUIREMENT} (llama.cpp build {describe_builds()}), whose parameter "
                            f"structs it passes by value: {install}")


def describe_builds() -> str:
    first, last = LLAMA_BUILDS[0], LLAMA_BUILDS[-1]
    return f"b{first}" if first == last else f"b{first} to b{last}"


def _load_library():
    version = installed_xllamacpp_version()
    check_xllamacpp_version(version)
    import xllamacpp

    so = ctypes.CDLL(os.path.join(os.path.dirname(xllamacpp.__file__), "xllamacpp.abi3.so"))
    declare_signatures(so)
    defaults = so.llama_context_default_params()
    differing = {name: getattr(defaults, name) for name, value in CONTEXT_DEFAULTS.items()
                 if getattr(defaults, name) != value}
    if differing:
        raise LlamaCppError(f"xllamacpp {version}'s llama_context_default_params() returns {differing}, not the "
                            f"defaults of llama.cpp {describe_builds()}: this build is not the one its version names; "
                            f"reinstall it: pip install --force-reinstall 'xllamacpp{XLLAMACPP_REQUIREMENT}'")
    if not os.environ.get("ACCELGEN_LLAMACPP_LOG"):
        so.llama_log_set(ctypes.cast(_silent, ctypes.c_void_p), None)
    so.llama_backend_init()
    return so


def declare_signatures(so) -> None:
    """The argument and result types of the C functions the runner calls (include/llama.h)."""
    pointer, i32, u32 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_uint32
    signatures = {
        "llama_backend_init": ([], None),
        "llama_log_set": ([pointer, pointer], None),
        "llama_model_default_params": ([], LlamaModelParams),
        "llama_context_default_params": ([], LlamaContextParams),
        "llama_model_load_from_file": ([ctypes.c_char_p, LlamaModelParams], pointer),
        "llama_model_free": ([pointer], None),
        "llama_model_get_vocab": ([pointer], pointer),
        "llama_model_n_ctx_train": ([pointer], i32),
        "llama_vocab_n_tokens": ([pointer], i32),
        "llama_init_from_model": ([pointer, LlamaContextParams], pointer),
        "llama_free": ([pointer], None),
        "llama_n_ctx_seq": ([pointer], u32),
        "llama_set_n_threads": ([pointer, i32, i32], None),
        "llama_batch_init": ([i32, i32, i32], _Batch),
        "llama_batch_free": ([_Batch], None),
        "llama_decode": ([pointer, _Batch], i32),
        "llama_get_logits": ([pointer], ctypes.POINTER(ctypes.c_float)),
        "llama_get_memory": ([pointer], pointer),
        "llama_memory_seq_rm": ([pointer, i32, i32, i32], ctypes.c_bool),
        "llama_memory_seq_cp": ([pointer, i32, i32, i32, i32], None),
        "llama_memory_clear": ([pointer, ctypes.c_bool], None),
    }
    for name, (argtypes, restype) in signatures.items():
        function = getattr(so, name)
        function.argtypes, function.restype = argtypes, restype


@dataclass
class LlamaCppConfig:
    """The few config fields the loop and drafters read of a model."""

    vocab_size: int
    max_position_embeddings: int
    _name_or_path: str
    model_type: str = "gguf"


@dataclass
class LlamaCppModel:
    """A GGUF file loaded by llama.cpp: the weights, shared by every runner (each runner has its own KV cache).

    Pass it to `accelgen.generate` as the model (or as draft_model) like a transformers model."""

    path: Path
    threads: int = 2
    context_tokens: int = CONTEXT_TOKENS
    generation_config: object = None
    _handle: int = field(default=0, repr=False)

    def __post_init__(self):
        so = library()
        self.path = Path(self.path)
        if not self.path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {self.path}")
        handle = so.llama_model_load_from_file(str(self.path).encode(), so.llama_model_default_params())
        if not handle:
            raise LlamaCppError(f"llama.cpp could not load {self.path} (set ACCELGEN_LLAMACPP_LOG=1 for its log)")
        self._handle = handle
        vocab = so.llama_model_get_vocab(handle)
        trained = so.llama_model_n_ctx_train(handle)
        self.context_tokens = min(self.context_tokens, trained) if trained > 0 else self.context_tokens
        self.config = LlamaCppConfig(so.llama_vocab_n_tokens(vocab), self.context_tokens, str(self.path))
        self.name_or_path = str(self.path)
        self.device = torch.device("cpu")
        self.dtype = torch.float32  # logits come back in fp32; the weights stay in the file's own formats

    def new_runner(self) -> "LlamaCppRunner":
        return LlamaCppRunner(self)

    def __del__(self):
        if self._handle and _library is not None:
            _library.llama_model_free(self._handle)
            self._handle = 0


class LlamaCppRunner:
    """ModelRunner's interface over a llama.cpp context (see accelgen/models/runner.py for the contract)."""

    position_offset = 0
    hidden = None
    batches = False  # each context decodes alone (models/batch.py)

    def __init__(self, model: LlamaCppModel):
        so = library()
        self.model = model
        self.config = model.config
        self.device, self.dtype = model.device, model.dtype
        self.vocab_size = model.config.vocab_size
        self.max_positions = model.context_tokens
        params = so.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch = model.context_tokens, BATCH_TOKENS, BATCH_TOKENS
        params.n_seq_max = MAX_SEQUENCES
        params.kv_unified = True  # one KV buffer that all sequences (tree paths) share
        self._context = so.llama_init_from_model(model._handle, params)
        if not self._context:
            raise LlamaCppError(f"llama.cpp could not create a context of {model.context_tokens} tokens")
        if so.llama_n_ctx_seq(self._context) < model.context_tokens:
            raise LlamaCppError("llama.cpp did not give the sequences one shared KV buffer (kv_unified); "
                                f"install a supported xllamacpp: pip install 'xllamacpp{XLLAMACPP_REQUIREMENT}'")
        so.llama_set_n_threads(self._context, model.threads, model.threads)
        self._memory = so.llama_get_memory(self._context)
        self._batch = so.llama_batch_init(BATCH_TOKENS, 0, MAX_SEQUENCES)
        self._length = 0
        self._tree_start: int | None = None  # where the last forward's tree began (None: it was a chain)
        self._leaf_of_row: dict[int, int] = {}  # row of the last forward -> a leaf sequence holding it
        self._leaf_sequences: list[int] = []

    @property
    def keep_hidden(self) -> bool:
        return False

    def describe(self) -> dict:
        return {}

    def close(self) -> None:
        """Nothing to release before the sequence's memory goes with the runner."""

    @keep_hidden.setter
    def keep_hidden(self, value: bool) -> None:
        if value:
            raise InputError("this method reads the target's hidden states, which the llama.cpp engine does not "
                             "expose; load the model in a PyTorch format (weights=bf16, int8, int4 or fp32)")

    @property
    def length(self) -> int:
        return self._length

    def reset(self) -> None:
        library().llama_memory_clear(self._memory, True)
        self._length = 0
        self._tree_start = None

    def forward(self, token_ids: torch.Tensor, tree: torch.Tensor | None = None, logits_for_last: int = 0,
                appended: torch.Tensor | None = None) -> torch.Tensor:
        """Append token_ids (m,) after the cached positions; returns (k, vocab) float32 logits of the last
        k = logits_for_last tokens (0: all). tree: (m, m) bool, tree[r, c] = token r attends to token c."""
        if appended is not None:
            raise InputError("appended input embeddings (PaSS) need the PyTorch model; the llama.cpp engine takes tokens")
        if tree is not None and tree.shape[0] != tree.shape[1]:
            raise InputError("a draft tree continued from cached levels (a draft model expanding a tree) needs the "
                             "PyTorch model; load the draft in a PyTorch format")
        so = library()
        tokens = token_ids.tolist()
        m, start = len(tokens), self._length
        wanted = m if logits_for_last == 0 else logits_for_last
        if start + m > self.max_positions:
            raise InputError(f"{start + m} positions exceed the llama.cpp context of {self.max_positions}")
        if tree is None:
            positions = list(range(start, start + m))
            sequences = [[0]] * m
            self._tree_start = None
        else:
            positions, sequences = self._tree_layout(tree, start)
        # a long prompt goes in chunks; the last chunk holds every row whose logits are wanted
        if wanted > BATCH_TOKENS:
            raise InputError(f"logits for {wanted} tokens in one forward exceed the batch of {BATCH_TOKENS}")
        for first, last in _chunks(m, BATCH_TOKENS):
            batch = self._batch
            batch.n_tokens = last - first
            for slot, row in enumerate(range(first, last)):
                batch.token[slot] = tokens[row]
                batch.pos[slot] = positions[row]
                batch.n_seq_id[slot] = len(sequences[row])
                for index, sequence in enumerate(sequences[row]):
                    batch.seq_id[slot][index] = sequence
                batch.logits[slot] = int(row >= m - wanted)
            status = so.llama_decode(self._context, batch)
            if status != 0:
                raise LlamaCppError(f"llama_decode failed with status {status} (KV cache full or bad batch)")
        self._length = start + m
        pointer = so.llama_get_logits(self._context)
        logits = np.ctypeslib.as_array(pointer, shape=(wanted, self.vocab_size))
        return torch.from_numpy(logits.copy())

    def _tree_layout(self, tree: torch.Tensor, start: int) -> tuple[list[int], list[list[int]]]:
        """Positions and sequence ids of a tree's tokens: each leaf gets a sequence sharing the cached
        context, each token belongs to the sequences of the leaves it is an ancestor (or itself) of."""
        so = library()
        depth = Block(0, tree).positions  # (m,) each token's depth: its position after an empty cache
        is_leaf = tree.sum(dim=0) == 1  # nobody else has it as an ancestor
        leaves = torch.nonzero(is_leaf).flatten().tolist()
        if len(leaves) >= MAX_SEQUENCES:
            raise InputError(f"a draft tree with {len(leaves)} leaves exceeds the llama.cpp engine's "
                             f"{MAX_SEQUENCES - 1} paths; lower the method's max_nodes or width")
        self._leaf_sequences = list(range(1, len(leaves) + 1))
        for sequence in self._leaf_sequences:
            so.llama_memory_seq_cp(self._memory, 0, sequence, -1, -1)
        sequences = [[] for _ in range(tree.shape[0])]
        self._leaf_of_row = {}
        for sequence, leaf in zip(self._leaf_sequences, leaves):
            for row in torch.nonzero(tree[leaf]).flatten().tolist():
                sequences[row].append(sequence)
                self._leaf_of_row.setdefault(row, sequence)
        self._tree_start = start
        return (start + depth).tolist(), sequences

    def keep(self, prefix: int, rows: list[int]) -> None:
        """Keep the first `prefix` positions, then rows `rows` (a path from the root, increasing) of the last forward."""
        so = library()
        end = prefix + len(rows)
        if self._tree_start is None:
            if rows != list(range(len(rows))):
                raise InputError("a chain keeps a prefix of its rows")
            so.llama_memory_seq_rm(self._memory, 0, end, -1)
        else:
            # the accepted path lies in the sequence of a leaf below its last row (the tokens before the tree's
            # first branch lie in all of them): hand those cells to sequence 0
            leaf = self._leaf_of_row[prefix - self._tree_start + rows[-1]] if rows else self._leaf_sequences[0]
            so.llama_memory_seq_cp(self._memory, leaf, 0, self._tree_start, end)
            for sequence in self._leaf_sequences:
                so.llama_memory_seq_rm(self._memory, sequence, -1, -1)
            so.llama_memory_seq_rm(self._memory, 0, end, -1)
            self._tree_start = None
        self._length = end

    def __del__(self):
        if _library is not None and getattr(self, "_context", None):
            _library.llama_batch_free(self._batch)
            _library.llama_free(self._context)
            self._context = None


def _chunks(m: int, size: int) -> list[tuple[int, int]]:
    """[first, last) bounds of m tokens in chunks of at most `size`, the last chunk as full as possible."""
    bounds, last = [], m
    while last > 0:
        bounds.append((max(last - size, 0), last))
        last -= size
    return bounds[::-1]


def is_llamacpp(model) -> bool:
    return isinstance(model, LlamaCppModel)

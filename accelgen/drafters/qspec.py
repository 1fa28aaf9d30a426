"""Quantized self-speculation (QSpec, Zhao et al. 2024, arXiv:2410.11305; ML-SpecQD, Georganas et al. 2025,
arXiv:2503.13565): the target drafts with its own quantized copy and verifies in its own format.

A bf16 or fp32 target's 4- or 8-bit copy agrees with it on most tokens (acceptance 0.9+) and decodes several
times faster, so the target's exact output comes faster with no second model to choose or install. The copy is
made from the target itself, once, and cached:

    quantized="gguf"   its GGUF file run by llama.cpp: the file the target was converted from (the embedded
                       models), else one written from the checkpoint (models/gguf_writer.py: llama, qwen2) at
                       gguf_type q8_0 (the default) or q4_0
    quantized="int8"   a PyTorch weight-only int8 copy (models/formats.py), any architecture, any device
    quantized="int4"   the same in int4
    quantized="auto"   gguf where llama.cpp is installed, the target runs on the CPU and its architecture can be
                       written; else int8 (said on stderr)

The copy shares the target's tokenizer and vocabulary (token ids pass between the engines) and keeps its own KV
cache, rolled back to the committed context before each draft (drafters/draft_decoding.py).

levels="pld" adds a level below (ML-SpecQD's multi-level drafting): prompt lookup (the context's n-gram matches,
else a bigram chain) drafts for the quantized copy, which checks the proposal in one forward; the copy's tokens
come out unchanged in fewer forwards (the vertical cascade of drafters/cascade.py, reused as it is).

Draft lengths come from the measured costs: gamma_schedule="cost" (the default) sizes each step's draft from the
target's r(k), the copy's cost c and the running acceptance, down to no draft (drafters/budget.py);
stage_two_tokens="auto" sizes the lookup level's proposals from the copy's own measured r(k).

Lossless: verification is the target's usual rule on the target's logits, so greedy output is the target's token
for token, and sampling keeps its distribution exactly (the copy's tokens carry the copy's distribution; the
lookup level only changes how many copy forwards they take).
"""

from __future__ import annotations

import copy
import importlib.util
import sys
import weakref
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from accelgen.costs import MIN_GAIN, PRIOR_ALPHA, measured_budget, verify_ratios
from accelgen.drafters.base import BuildContext
from accelgen.drafters.budget import BudgetedDrafter
from accelgen.drafters.cascade import CascadeDrafter
from accelgen.drafters.draft_model import GAMMA_SCHEDULES, DraftModelDrafter, check_vocabularies
from accelgen.errors import InputError
from accelgen.models.llamacpp import LlamaCppModel
from accelgen.profile import interpolate
from accelgen.registry import MethodOptions, MethodSpec, Part, register
from accelgen.theory import best_gamma

DRAFT_FORMATS = ("auto", "gguf", "int8", "int4")
GGUF_TYPES = ("auto", "q4_0", "q8_0", "f32")
# gguf_type "auto" for a checkpoint without a GGUF file of its own: Q8_0 kept SmolLM2-135M's top token at 0.98 of
# the positions of a code text, Q4_0 at 0.84 (a small model loses more to 4 bits)
WRITTEN_GGUF_TYPE = "q8_0"
LEVELS = ("self", "pld")
MAX_STAGE_TWO = 8  # the longest proposal stage_two_tokens="auto" gives the quantized copy

# target -> {(format, gguf type): its quantized copy}: made once per target, not per request (a server builds a
# drafter for every request); a copy goes with its target
_COPIES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class QSpecOptions(MethodOptions):
    quantized: str = "auto"  # the copy's format, one of DRAFT_FORMATS
    gguf_type: str = "auto"  # a written GGUF's type (q4_0, q8_0, f32); auto: the target's own GGUF file, else q8_0
    gamma: int = 8  # draft tokens per step with gamma_schedule="constant"
    gamma_schedule: str = "cost"  # one of GAMMA_SCHEDULES (drafters/draft_model.py)
    max_gamma: int = 16  # the longest draft a "heuristic" or "cost" schedule grows to
    levels: str = "self"  # "self": the copy decodes alone; "pld": prompt lookup drafts for the copy
    stage_two_tokens: str = "auto"  # levels=pld: tokens proposed to the copy per forward; auto: from its r(k)
    max_ngram: int = 3  # levels=pld: the longest n-gram looked up

    def __post_init__(self):
        for name, value, allowed in (("quantized", self.quantized, DRAFT_FORMATS),
                                     ("gguf_type", self.gguf_type, GGUF_TYPES),
                                     ("gamma_schedule", self.gamma_schedule, GAMMA_SCHEDULES),
                                     ("levels", self.levels, LEVELS)):
            if value not in allowed:
                raise InputError(f"qspec: unknown {name} {value!r}; choose one of {', '.join(allowed)}")
        if self.gamma < 1 or self.max_gamma < 1:
            raise InputError(f"qspec: gamma and max_gamma must be >= 1, got {self.gamma} and {self.max_gamma}")
        if self.stage_two_tokens != "auto" and (isinstance(self.stage_two_tokens, str) or self.stage_two_tokens < 0):
            raise InputError(f"qspec: stage_two_tokens must be 'auto' or a count >= 0, got {self.stage_two_tokens!r}")
        if self.max_ngram < 1:
            raise InputError(f"qspec: max_ngram must be >= 1, got {self.max_ngram}")
        if self.levels == "pld" and self.gamma_schedule == "heuristic":
            raise InputError("qspec: levels=pld takes gamma_schedule cost (the default) or constant")


# --- the quantized copy -----------------------------------------------------------------------------------------


def check_target(target_model) -> None:
    """A ValueError for a target that is already quantized: qspec drafts for a bf16/fp32 PyTorch target."""
    from accelgen.models.formats import weight_format

    if isinstance(target_model, LlamaCppModel):
        raise InputError("qspec drafts for a PyTorch target with its quantized copy, but this target already runs its "
                         "GGUF file on llama.cpp: load it with weights=bf16 (or fp32) to verify in full precision")
    fmt = weight_format(target_model)
    if fmt in ("int8", "int4"):
        raise InputError(f"qspec drafts for a bf16/fp32 target with its quantized copy, but this target is already "
                         f"{fmt}: load it with weights=bf16 (or fp32)")


def embedded_gguf(target_model) -> Path | None:
    """The GGUF file the target was converted from, where it is an embedded model (None otherwise)."""
    from accelgen.models.embedded import EMBEDDED_MODELS
    from accelgen.models.loading import cached_model_dir, gguf_file

    source = str(getattr(target_model, "name_or_path", "") or "")
    if not source:
        return None
    for name in EMBEDDED_MODELS:
        if Path(source).resolve() == cached_model_dir(name).resolve():
            return gguf_file(name)
    return None


def gguf_refusal(target_model, gguf_type: str) -> str | None:
    """Why the target cannot draft with a GGUF copy on llama.cpp here (None: it can)."""
    from accelgen.models.gguf_writer import UnsupportedArchitecture, check_writable

    if importlib.util.find_spec("xllamacpp") is None:
        return "llama.cpp is not installed (pip install 'accelgen[llamacpp]')"
    if target_model.device.type != "cpu":
        return f"llama.cpp runs on the CPU, the target on {target_model.device}"
    if gguf_type == "auto" and embedded_gguf(target_model) is not None:
        return None
    try:
        check_writable(target_model.config)
    except UnsupportedArchitecture as error:
        return str(error)
    return None


def resolve_format(target_model, quantized: str, gguf_type: str) -> str:
    """The copy's format: `quantized`, or for "auto" gguf where gguf_refusal allows it, else int8 (said on stderr).
    An explicit "gguf" that cannot be is a ValueError saying why."""
    if quantized in ("int8", "int4"):
        return quantized
    refusal = gguf_refusal(target_model, gguf_type)
    if refusal is None:
        return "gguf"
    if quantized == "gguf":
        raise InputError(f"qspec: quantized=gguf is not possible here: {refusal}")
    print(f"accelgen: qspec drafts with an int8 PyTorch copy: {refusal}", file=sys.stderr)
    return "int8"


def quantized_copy(target_model, tokenizer, fmt: str, gguf_type: str = "auto"):
    """The target's own copy in `fmt` (gguf, int8 or int4), made once per target and format (then reused)."""
    copies = _COPIES.setdefault(target_model, {})
    key = (fmt, gguf_type if fmt == "gguf" else None)
    if key not in copies:
        copies[key] = gguf_copy(target_model, tokenizer, gguf_type) if fmt == "gguf" else torch_copy(target_model, fmt)
    return copies[key]


def served_copy(target_model, tokenizer, options: dict):
    """The copy qspec's checked options pick for this target, made now: a server times its forwards for its
    speculation policy, and its first request finds it ready."""
    check_target(target_model)
    return quantized_copy(target_model, tokenizer, resolve_format(target_model, options["quantized"],
                                                                  options["gguf_type"]), options["gguf_type"])


def gguf_copy(target_model, tokenizer, gguf_type: str) -> LlamaCppModel:
    """The target's GGUF file (its source where it has one and gguf_type is auto, else written once) on llama.cpp."""
    from accelgen.models.gguf_writer import written_gguf

    path = embedded_gguf(target_model) if gguf_type == "auto" else None
    if path is None:
        tokenizer = tokenizer if tokenizer is not None else folder_tokenizer(target_model)
        path = written_gguf(target_model, tokenizer, WRITTEN_GGUF_TYPE if gguf_type == "auto" else gguf_type)
    return LlamaCppModel(path, threads=torch.get_num_threads())


def folder_tokenizer(target_model):
    """The tokenizer saved beside the target's weights, or None (the GGUF file then lists placeholder tokens: the
    engines exchange token ids only)."""
    from transformers import AutoTokenizer

    source = Path(str(getattr(target_model, "name_or_path", "") or ""))
    return AutoTokenizer.from_pretrained(source) if (source / "tokenizer_config.json").is_file() else None


def torch_copy(target_model, fmt: str):
    """A weight-only int8/int4 copy of the target (bf16 activations, as PyTorch's packed kernels are fast with),
    its quantized tensors cached, keyed by the checkpoint's files, where it was read from a folder."""
    from accelgen.models.formats import move_to
    from accelgen.models.loading import local_folder, quantize_cached

    source = str(getattr(target_model, "name_or_path", "") or "")
    draft = copy.deepcopy(target_model).to("cpu")
    quantize_cached(draft, fmt, local_folder(source) if source else None, torch.bfloat16)
    return move_to(draft, target_model.device).eval()


# --- the drafter --------------------------------------------------------------------------------------------------


def lookup_tokens(draft_model, stage_two_tokens) -> int:
    """The lookup level's proposal length: a count as given, or for "auto" the length with the best predicted
    speedup of the copy's own decoding, from its measured r(k) at the prior acceptance (lookups cost nothing)."""
    if stage_two_tokens != "auto":
        return stage_two_tokens
    ratio = partial(interpolate, verify_ratios(draft_model))  # tokens per forward -> r of the copy
    return best_gamma(PRIOR_ALPHA, 0.0, MAX_STAGE_TWO, ratio, MIN_GAIN)


def qspec_drafter(target_model, draft_model, build: BuildContext, options: QSpecOptions):
    """The copy's drafter (levels=self: it decodes alone; pld: prompt lookup drafts for it), its drafts capped by
    the measured budget where gamma_schedule is "cost"."""
    check_vocabularies(target_model, draft_model)
    longest = options.max_gamma if options.gamma_schedule != "constant" else options.gamma
    if options.levels == "pld":
        drafter = CascadeDrafter(draft_model, build.sampling, build.generator, gamma=longest, tail_tokens=0,
                                 stage_two_tokens=lookup_tokens(draft_model, options.stage_two_tokens),
                                 max_ngram=options.max_ngram)
    else:
        drafter = DraftModelDrafter(draft_model, build.sampling, build.generator, gamma=options.gamma,
                                    gamma_schedule=options.gamma_schedule, max_gamma=options.max_gamma)
    if options.gamma_schedule != "cost":
        return drafter
    return BudgetedDrafter(drafter, measured_budget(target_model, draft_model, options.max_gamma))


def _make(build: BuildContext, options: QSpecOptions):
    target_model = build.target_model
    check_target(target_model)
    fmt = resolve_format(target_model, options.quantized, options.gguf_type)
    draft_model = quantized_copy(target_model, build.tokenizer, fmt, options.gguf_type)
    return qspec_drafter(target_model, draft_model, build, options)


register(
    MethodSpec(
        name="qspec",
        family="speculative",
        lossless="distribution-exact",
        paper="Zhao et al. 2024, arXiv:2410.11305 (QSpec); Georganas et al. 2025, arXiv:2503.13565 (ML-SpecQD)",
        summary="the target drafts with its own quantized copy (its GGUF file on llama.cpp, or int8/int4 in "
                "PyTorch) and verifies in its own format; levels=pld lets prompt lookup draft for the copy",
        drafter=Part(_make, QSpecOptions),
    )
)

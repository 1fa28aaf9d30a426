"""The registry of generation methods: name -> what it is, what it needs, how lossless it is, how to build it.

A method is a MethodSpec whose parts (a drafter, and where the method has them its own verifier and target
runner) each come with the options dataclass they take; its module registers it on import, and accelgen/method_table.py
says which module that is, so that a method's module is imported only when the method is asked for.
"""

from __future__ import annotations

import importlib
import json
import math
from dataclasses import MISSING, dataclass, fields
from typing import Callable

from accelgen.errors import InputError
from accelgen.method_table import METHODS

LOSSLESS_CLASSES = {
    "greedy-exact": "identical tokens to greedy decoding; sampling not supported",
    "distribution-exact": "identical tokens to greedy decoding, and samples from exactly the target distribution",
    "lossy": "faster by design at some cost in agreement with the target; quality is measured",
}


class MethodOptions:
    """The options one part of a method (its drafter, verifier or runner) takes, as a frozen dataclass whose
    fields are the option names with their defaults (a list default through field(default_factory=...)).

    The registry checks each value's type against its default (`merge_options`); a subclass checks what else
    its values must satisfy in __post_init__. A part gets its own options only (`take`)."""

    @classmethod
    def defaults(cls) -> dict:
        """Option name -> default value, in the order of the fields."""
        return {f.name: f.default_factory() if f.default is MISSING else f.default for f in fields(cls)}

    @classmethod
    def take(cls, options: dict):
        """This part's own options out of a method's options (those left out keep their defaults)."""
        return cls(**{f.name: options[f.name] for f in fields(cls) if f.name in options})

    def as_dict(self) -> dict:
        """The options by name, the values themselves (not copies: a shared learner or trie stays shared)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class NoOptions(MethodOptions):
    """The options of a part that takes none."""


@dataclass(frozen=True)
class Part:
    """One part of a method: the factory that builds it and the options dataclass (a MethodOptions) it takes."""

    make: Callable
    options: type = NoOptions


@dataclass(frozen=True)
class MethodSpec:
    name: str
    family: str  # "baseline", "speculative", "early-exit", "parallel", ...
    lossless: str  # a key of LOSSLESS_CLASSES
    paper: str
    summary: str
    drafter: Part  # make(build: drafters.base.BuildContext, options) -> drafters.base.Drafter
    needs: tuple[str, ...] = ()  # e.g. ("draft_model",)
    # make(sampling, options) -> verify(draft, target_logits, generator) -> Verdict, for a method with its own
    # verification rule; None: greedy match at temperature 0, speculative sampling otherwise (verify.default)
    verifier: Part | None = None
    greedy_only: bool = False  # a lossy rule that relaxes greedy matching (greedy-exact methods are greedy only anyway)
    # make(target_model, options) -> ModelRunner, for a method that changes the target's own forward (early exit,
    # accelgen/exits/); None: the plain ModelRunner
    runner: Part | None = None
    # the drafter reads the target's final hidden states (Medusa, EAGLE): the loop has the target's runner keep
    # them (ModelRunner.keep_hidden), and the drafter reads them from `BuildContext.target`. A drafter that reads
    # the residual stream of chosen layers instead (EAGLE-3's head says which) sets them on that runner as it is
    # built (ModelRunner.keep_layers), and clears keep_hidden if it needs no final states
    reads_target_hidden: bool = False
    # the draft budget a request gets unless it sets one (accelgen/loop.py's DRAFT_BUDGETS): "measured" caps
    # each step's draft by the costs measured on this machine, down to none (plain decoding), so that the method's
    # defaults never lose to it; "method" drafts as long as the method's options say
    draft_budget: str = "method"
    # its draft model must be a PyTorch model (it expands token trees with it level by level, which llama.cpp's
    # runner cannot continue, keeps a cache of its own or trains it): `--draft-weights auto` then picks the fastest
    # PyTorch format (drafters/draft_tree.py)
    pytorch_draft: bool = False

    def __post_init__(self):
        if self.lossless not in LOSSLESS_CLASSES:
            raise InputError(f"{self.name}: lossless must be one of {sorted(LOSSLESS_CLASSES)}")
        if self.draft_budget not in ("method", "measured"):
            raise InputError(f"{self.name}: draft_budget must be 'method' or 'measured', got {self.draft_budget!r}")
        defaults: dict = {}
        for part in self.parts:
            for name, default in part.options.defaults().items():
                if defaults.setdefault(name, default) != default:  # one option, one meaning, in every part
                    raise InputError(f"{self.name}: option {name!r} has different defaults in its parts")

    @property
    def parts(self) -> list[Part]:
        """The method's parts, in the order its options are listed: runner, drafter, verifier."""
        return [part for part in (self.runner, self.drafter, self.verifier) if part is not None]

    @property
    def options(self) -> dict:
        """Option name -> default value, whose type the option takes (check_option): every part's options."""
        return {name: default for part in self.parts for name, default in part.options.defaults().items()}

    @property
    def can_sample(self) -> bool:
        return not self.greedy_only and self.lossless != "greedy-exact"

    @property
    def needs_draft_model(self) -> bool:
        return "draft_model" in self.needs

    def check_options(self, options: dict) -> dict:
        return merge_options(self.name, self.options, options)

    def check_needs(self, *, draft_model, how: str = "draft_model= (CLI: --draft)") -> None:
        """A ValueError when the method needs a draft model and draft_model is None; `how` says how to pass one
        (the command line's "--draft", the Python API's "draft_model=")."""
        if self.needs_draft_model and draft_model is None:
            raise InputError(f"method {self.name!r} needs a draft model: pass {how}")

    def split_options(self, options: dict) -> tuple:
        """(drafter, verifier, runner) options, each part's own out of the method's checked options, each checked
        by its dataclass; None for a part the method does not declare."""
        drafting = self.drafter.options.take(options)
        verifying = self.verifier.options.take(options) if self.verifier else None
        running = self.runner.options.take(options) if self.runner else None
        return drafting, verifying, running


# options every method takes, handled by the loop (accelgen/loop.py) rather than by the method: on the command line
# `-o cache=static` and `-o compile=true` choose the target's KV cache and compiled forwards (models/engines.py)
LOOP_OPTIONS = ("draft_budget", "cache", "compile")


# transformers' generate() names -> what to use in accelgen, for an option name that is one of them
# (accelgen.generate and accelgen.hf translate the ones that mean the same thing: accelgen/hf.py)
TRANSFORMERS_NAMES = {
    "assistant_model": "draft_model= (CLI: --draft) with a draft-model method such as speculative",
    "num_assistant_tokens": "gamma, an option of speculative and the other draft-model methods",
    "num_assistant_tokens_schedule": "gamma_schedule",
    "prompt_lookup_num_tokens": "method pld with its option draft_length",
    "max_matching_ngram_size": "method pld with its option max_ngram",
    "do_sample": "temperature (0 = greedy)",
    "max_length": "max_new_tokens",
    "stop_strings": "stop",
    "eos_token_id": "generate(eos_token_id=...)",
    "inputs_embeds": "the prompt's token ids",
    "past_key_values": "nothing: accelgen keeps its own KV cache",
}


def merge_options(method: str, defaults: dict, options: dict) -> dict:
    """Defaults overlaid with the user's options; unknown option names and values of the wrong type are an error
    (LOOP_OPTIONS pass through)."""
    unknown = sorted(set(options) - set(defaults) - set(LOOP_OPTIONS))
    if unknown:
        known = ", ".join(sorted(defaults)) or "none"
        hints = "".join(f"; {name!r} is transformers' name: use {TRANSFORMERS_NAMES[name]}"
                        for name in unknown if name in TRANSFORMERS_NAMES)
        raise InputError(f"method {method!r} has no option {', '.join(map(repr, unknown))}; its options are: {known}"
                         f"{hints}")
    for name, value in options.items():
        if name in defaults:
            check_option(f"{method}: {name}", value, option_types(name, defaults[name]),
                         NUMBER_WORDS.get(name, ()))
    return {**defaults, **options}


# Options whose default is a word standing for a value chosen for the user take a word (the method checks which)
# or a value of the type here: gamma "auto" = the method's usual draft length, capped each step by the measured
# costs (the draft budget, accelgen/loop.py) or a count that fixes it; max_nodes / draft_length "auto" = sized
# each step by the measured costs (accelgen/costs.py) or a count (lookahead's max_nodes also None: no cap); qspec's
# stage_two_tokens "auto" (from the quantized copy's measured costs) or a count; self-speculative's skip "tuned" (by
# `accelgen tune`) or "default", or {"skip_attention": [...], "skip_mlp": [...]}; free's threshold "adaptive" or a
# number; the hf-static rows' compile "auto" (transformers' own rule) or true/false. A new option with a word
# default takes words only until it is listed here.
WORD_DEFAULT_TYPES = {"gamma": (int,), "max_nodes": (int, type(None)), "draft_length": (int,), "skip": (dict,),
                      "threshold": (float,), "stage_two_tokens": (int,), "compile": (bool,)}
# Number options that also take a word, as their methods document: calm's and ee-recompute's threshold="calibrated"
# (saved by `accelgen calibrate calm`)
NUMBER_WORDS = {"threshold": ("calibrated",)}


def option_types(name: str, default) -> tuple[type, ...] | None:
    """The types an option with this default takes (None: any; a None default is a path, an object or a structure
    the method checks itself). float means any finite number (an int too)."""
    if default is None:
        return None
    if isinstance(default, str):
        return (str, *WORD_DEFAULT_TYPES.get(name, ()))
    if isinstance(default, (list, tuple)):
        return (list, tuple)
    return (type(default),)  # bool, int, float, dict


TYPE_NAMES = {bool: "true or false", int: "an integer", float: "a finite number", str: "text", list: "a list",
              tuple: "a list", dict: "a mapping", type(None): "None"}


def check_option(what: str, value, types: tuple[type, ...] | None, words: tuple[str, ...] = ()) -> None:
    """A ValueError naming `what` for a value not of `types` (nor one of `words`): no silent coercion."""
    if types is None or (isinstance(value, str) and value in words) or fits(value, types):
        return
    expected = list(dict.fromkeys(TYPE_NAMES.get(kind, kind.__name__) for kind in types)) + [repr(w) for w in words]
    raise InputError(f"{what} must be {' or '.join(expected)}, got {value!r}")


def fits(value, types: tuple[type, ...]) -> bool:
    """Whether value is of types, where bool is not a number (though Python says it is an int), an int is also a
    float, and a float must be finite."""
    if isinstance(value, bool):
        return bool in types
    if isinstance(value, int):
        return int in types or float in types
    if isinstance(value, float):
        return float in types and math.isfinite(value)
    return isinstance(value, types)


def parse_option_value(text: str, types: tuple[type, ...] | None = None):
    """An option value written on the command line: JSON where it parses ('8', '[2, 2]', 'true'), else text; and
    text too where the option takes words and JSON gives a value it does not take (`workload=2024` is a word)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return text
    if types is not None and str in types and not fits(value, types):
        return text
    return value


_METHODS: dict[str, MethodSpec] = {}
# method name -> the module that registers it, for methods that live above the methods layer and are declared from
# above (declare_method), since the built-in table (accelgen/method_table.py) may name only the methods layer
_DECLARED: dict[str, str] = {}


def register(spec: MethodSpec) -> MethodSpec:
    if spec.name in _METHODS:
        raise InputError(f"method {spec.name!r} is registered twice")
    _METHODS[spec.name] = spec
    return spec


def parse_method_option(method: str, name: str, text: str):
    """A command-line value of `method`'s option `name`, parsed by the option's declared type (JSON or text where
    the method or the option is not a registered one, e.g. the benchmark's HF rows)."""
    spec = _registered(method)
    default_known = spec is not None and name in spec.options
    return parse_option_value(text, option_types(name, spec.options[name]) if default_known else None)


def declare_method(name: str, module: str) -> None:
    """Have `module` imported the first time method `name` is asked for, as the built-in table's modules are: for a
    method whose module sits above the methods layer (the online method's drafter trains: accelgen/train/online.py),
    declared by a layer above that module (accelgen/__init__.py)."""
    known = _lazy_modules().get(name)
    if known not in (None, module):
        raise InputError(f"method {name!r} is already declared, by {known}")
    _DECLARED[name] = module


def get_method(name: str) -> MethodSpec:
    spec = _registered(name)
    if spec is None:
        available = ", ".join(sorted(set(_METHODS) | set(_lazy_modules())))
        raise InputError(f"unknown method {name!r}; available methods: {available}")
    return spec


def list_methods() -> list[MethodSpec]:
    for name in _lazy_modules():
        _registered(name)
    return sorted(_METHODS.values(), key=lambda spec: (spec.family, spec.name))


def _registered(name: str) -> MethodSpec | None:
    """The method's spec, its module imported first if it is a built-in or declared one not yet registered; None if
    unknown."""
    modules = _lazy_modules()
    if name not in _METHODS and name in modules:
        importlib.import_module(modules[name])  # registers the methods it declares
    return _METHODS.get(name)


def _lazy_modules() -> dict[str, str]:
    """method name -> the module that registers it: the built-in table's and the declared ones."""
    return {**METHODS, **_DECLARED}

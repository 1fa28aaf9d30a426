"""The registry of generation methods: name -> what it is, what it needs, how lossless it is, how to build it."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Callable

LOSSLESS_CLASSES = {
    "greedy-exact": "identical tokens to greedy decoding; sampling not supported",
    "distribution-exact": "identical tokens to greedy decoding, and samples from exactly the target distribution",
    "lossy": "faster by design at some cost in agreement with the target; quality is measured",
}


@dataclass(frozen=True)
class MethodSpec:
    name: str
    family: str  # "baseline", "speculative", "early-exit", "parallel", ...
    lossless: str  # a key of LOSSLESS_CLASSES
    paper: str
    summary: str
    make_drafter: Callable  # (target_model, *, draft_model, tokenizer, sampling, generator, **options) -> Drafter
    needs: tuple[str, ...] = ()  # e.g. ("draft_model",)
    options: dict = field(default_factory=dict)  # option name -> default value
    # (sampling, **options) -> verify(draft, target_logits, generator) -> Verdict, for a method with its own
    # verification rule; None: greedy match at temperature 0, speculative sampling otherwise
    make_verifier: Callable | None = None
    greedy_only: bool = False  # a lossy rule that relaxes greedy matching (greedy-exact methods are greedy only anyway)
    # (target_model, **options) -> ModelRunner, for a method that changes the target's own forward (early exit,
    # accelgen/exits/); None: the plain ModelRunner
    make_runner: Callable | None = None

    def __post_init__(self):
        if self.lossless not in LOSSLESS_CLASSES:
            raise ValueError(f"{self.name}: lossless must be one of {sorted(LOSSLESS_CLASSES)}")

    @property
    def can_sample(self) -> bool:
        return not self.greedy_only and self.lossless != "greedy-exact"

    def check_options(self, options: dict) -> dict:
        return merge_options(self.name, self.options, options)


# options every method takes, handled by the loop (accelgen/generate.py) rather than by the method
LOOP_OPTIONS = ("draft_budget",)


def merge_options(method: str, defaults: dict, options: dict) -> dict:
    """Defaults overlaid with the user's options; unknown option names are an error (LOOP_OPTIONS pass through)."""
    unknown = sorted(set(options) - set(defaults) - set(LOOP_OPTIONS))
    if unknown:
        known = ", ".join(sorted(defaults)) or "none"
        raise ValueError(f"method {method!r} has no option {', '.join(map(repr, unknown))}; its options are: {known}")
    return {**defaults, **options}


def parse_option_value(text: str):
    """An option value written on the command line: JSON where it parses ('8', '[2, 2]', 'true'), else text."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


_METHODS: dict[str, MethodSpec] = {}


def register(spec: MethodSpec) -> MethodSpec:
    if spec.name in _METHODS:
        raise ValueError(f"method {spec.name!r} is registered twice")
    _METHODS[spec.name] = spec
    return spec


def get_method(name: str) -> MethodSpec:
    _load_builtin_methods()
    try:
        return _METHODS[name]
    except KeyError:
        raise ValueError(f"unknown method {name!r}; available methods: {', '.join(sorted(_METHODS))}") from None


def list_methods() -> list[MethodSpec]:
    _load_builtin_methods()
    return sorted(_METHODS.values(), key=lambda spec: (spec.family, spec.name))


def _load_builtin_methods() -> None:
    import accelgen.drafters  # noqa: F401  (each drafter module registers its methods on import)
    import accelgen.exits  # noqa: F401  (and so does each early-exit module)

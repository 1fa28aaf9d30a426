"""The verification rule of methods without their own: greedy match at temperature 0, speculative sampling
otherwise; and the makers of verifiers from a method's own rule."""

from __future__ import annotations

from typing import Callable

from accelgen.sampling import SamplingConfig, logits_to_probs
from accelgen.verify.greedy import verify_greedy
from accelgen.verify.sampling import verify_speculative_sampling


def default_verifier(sampling: SamplingConfig, **_options):
    """Greedy match at temperature 0, else speculative sampling (exact on chains, and on trees of i.i.d. siblings)."""
    if sampling.greedy:
        return lambda draft, target_logits, generator: verify_greedy(draft, target_logits)
    return lambda draft, target_logits, generator: verify_speculative_sampling(
        draft, logits_to_probs(target_logits, sampling), generator)


def exact_rule_verifier(rule: Callable) -> Callable:
    """make(sampling, options) of a method whose own part is an exact rule(draft, target_probs, generator) ->
    Verdict over the target's distributions (block-verify, spectr). At temperature 0 the target is one-hot and
    such a rule keeps the longest matching path: greedy matching, the default verifier."""

    def make(sampling: SamplingConfig, options):
        if sampling.greedy:
            return default_verifier(sampling)
        return lambda draft, target_logits, generator: rule(draft, logits_to_probs(target_logits, sampling), generator)

    return make


def greedy_rule_verifier(rule: Callable, *option_names: str) -> Callable:
    """make(sampling, options) of a greedy-only method whose own part is a rule(draft, target_logits, *values of
    the options named) -> Verdict that relaxes greedy matching (specdec, contrastive, bild): it draws nothing."""

    def make(sampling: SamplingConfig, options):
        values = [getattr(options, name) for name in option_names]
        return lambda draft, target_logits, generator: rule(draft, target_logits, *values)

    return make

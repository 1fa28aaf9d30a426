"""The verification rule of methods without their own: greedy match at temperature 0, speculative sampling
otherwise."""

from __future__ import annotations

from accelgen.sampling import SamplingConfig, logits_to_probs
from accelgen.verify.greedy import verify_greedy
from accelgen.verify.sampling import verify_speculative_sampling


def default_verifier(sampling: SamplingConfig, **_options):
    """Greedy match at temperature 0, else speculative sampling (exact on chains, and on trees of i.i.d. siblings)."""
    if sampling.greedy:
        return lambda draft, target_logits, generator: verify_greedy(draft, target_logits)
    return lambda draft, target_logits, generator: verify_speculative_sampling(
        draft, logits_to_probs(target_logits, sampling), generator)

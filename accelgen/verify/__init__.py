"""Verification rules: pure functions from (draft, target scores, rng) to a Verdict."""

from accelgen.verify.greedy import verify_greedy
from accelgen.verify.sampling import verify_speculative_sampling

__all__ = ["verify_greedy", "verify_speculative_sampling"]

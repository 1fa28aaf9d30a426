"""Verification rules: pure functions from (draft, target scores, rng) to a Verdict."""

from accelgen.verify.block import verify_block
from accelgen.verify.greedy import verify_greedy
from accelgen.verify.multi_candidate import verify_without_replacement
from accelgen.verify.sampling import verify_speculative_sampling

__all__ = ["verify_block", "verify_greedy", "verify_speculative_sampling", "verify_without_replacement"]

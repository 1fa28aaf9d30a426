"""Block verification (Sun et al. 2024, arXiv:2403.10444): speculative decoding whose chain draft is accepted
as a block rather than token by token (verify/block.py).

Drafting is the `speculative` method's: the draft model proposes `gamma` tokens. The block rule uses the same
draft and target distributions and no extra model call, keeps the target's distribution exactly, and accepts
at least as many tokens on average as token-wise verification. At temperature 0 it is greedy verification.
"""

from __future__ import annotations

from dataclasses import dataclass

from accelgen.drafters.budget import AUTO_LENGTH
from accelgen.drafters.draft_model import GammaOptions, make_gamma_drafter
from accelgen.registry import MethodSpec, Part, register
from accelgen.verify import exact_rule_verifier, verify_block


@dataclass(frozen=True)
class BlockVerifyOptions(GammaOptions):
    gamma: int | str = AUTO_LENGTH  # tokens drafted per step (AUTO_LENGTH: DRAFT_GAMMA, capped by the measured costs)


register(
    MethodSpec(
        name="block-verify",
        family="speculative",
        lossless="distribution-exact",
        paper="Sun et al. 2024, arXiv:2403.10444",
        summary="draft-model speculative decoding whose gamma-token draft is verified jointly as a block: exact, "
                "and never fewer accepted tokens on average than token-wise verification",
        drafter=Part(make_gamma_drafter, BlockVerifyOptions),
        needs=("draft_model",),
        verifier=Part(exact_rule_verifier(verify_block)),
        draft_budget="measured",  # drafts capped by the measured costs unless the request fixes their length
    )
)

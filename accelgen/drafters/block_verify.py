"""Block verification (Sun et al. 2024, arXiv:2403.10444): speculative decoding whose chain draft is accepted
as a block rather than token by token (verify/block.py).

Drafting is the `speculative` method's: the draft model proposes `gamma` tokens. The block rule uses the same
draft and target distributions and no extra model call, keeps the target's distribution exactly, and accepts
at least as many tokens on average as token-wise verification. At temperature 0 it is greedy verification.
"""

from __future__ import annotations

from accelgen.drafters.draft_model import GammaOptions, make_gamma_drafter
from accelgen.verify import default_verifier
from accelgen.registry import MethodSpec, NoOptions, Part, register
from accelgen.sampling import SamplingConfig, logits_to_probs
from accelgen.verify import verify_block


def _make_verifier(sampling: SamplingConfig, options: NoOptions):
    if sampling.greedy:  # one-hot target: block verification is exactly the longest matching prefix
        return default_verifier(sampling)
    return lambda draft, target_logits, generator: verify_block(draft, logits_to_probs(target_logits, sampling), generator)


register(
    MethodSpec(
        name="block-verify",
        family="speculative",
        lossless="distribution-exact",
        paper="Sun et al. 2024, arXiv:2403.10444",
        summary="draft-model speculative decoding whose gamma-token draft is verified jointly as a block: exact, "
                "and never fewer accepted tokens on average than token-wise verification",
        drafter=Part(make_gamma_drafter, GammaOptions),
        needs=("draft_model",),
        verifier=Part(_make_verifier),
    )
)

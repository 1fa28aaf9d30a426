"""Seeded sampling by Gumbel-max coupling: per-position noise makes verification a deterministic match.

The target's token at absolute position p is argmax(log p_target(·) + g_p), g_p the Gumbel noise of position p
(accelgen/sampling.py: PositionNoise). Being a function of p and the seed alone, g_p is independent of the
tokens before p, so by the Gumbel-max theorem the committed token is an exact sample of the target's (processed,
tempered, top-k/top-p) distribution there. Verification then works as greedy matching on these choices: a draft
token is accepted while it equals the target's choice at its position, whatever distribution drafted it (a draft
model using the same g_p agrees more often). The output depends only on the target, the seed and the position:
the same across methods, draft lengths and batches.
"""

from __future__ import annotations

import torch

from accelgen.draft import Draft, Verdict, depths
from accelgen.sampling import SamplingConfig, gumbel_choice, logits_to_probs
from accelgen.verify.greedy import follow_choices


def verify_gumbel(draft: Draft, target_logits: torch.Tensor, sampling: SamplingConfig, first_position: int) -> Verdict:
    """target_logits: (n+1, vocab) processed, row 0 at the root (predicting absolute position first_position) and
    row i+1 after node i (predicting first_position + depth(i)); sampling.noise gives each position's noise."""
    positions = [first_position] + (first_position + depths(draft.parents)).tolist()  # (n+1,) host-built
    probs = logits_to_probs(target_logits, sampling)
    choices = gumbel_choice(probs, sampling.noise.rows(positions, like=probs))  # drawn on the logits' device
    return follow_choices(draft, choices.tolist())  # the one host read

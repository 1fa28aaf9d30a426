"""Plain autoregressive decoding: no draft, one target forward per token."""

from __future__ import annotations

import torch

from accelgen.draft import Draft, Verdict
from accelgen.registry import MethodSpec, register


class NoDrafter:
    def propose(self, context: torch.Tensor, max_nodes: int) -> Draft:
        return Draft.empty()

    def update(self, draft: Draft, verdict: Verdict, target_logits: torch.Tensor) -> None:
        pass


def no_drafter(target_model, **_) -> NoDrafter:
    """make_drafter of methods that draft nothing (autoregressive, early exit)."""
    return NoDrafter()


register(
    MethodSpec(
        name="autoregressive",
        family="baseline",
        lossless="distribution-exact",
        paper="-",
        summary="accelgen's own token-by-token loop with a KV cache; the reference every method is checked against",
        make_drafter=no_drafter,
    )
)

"""Plain autoregressive decoding: no draft, one target forward per token."""

from __future__ import annotations

import torch

from accelgen.draft import Draft
from accelgen.drafters.base import BuildContext, Drafter
from accelgen.registry import MethodSpec, NoOptions, Part, register


class NoDrafter(Drafter):
    def propose(self, context: torch.Tensor, max_nodes: int) -> Draft:
        return Draft.empty()


def no_drafter(build: BuildContext, options: NoOptions) -> NoDrafter:
    """The drafter of methods that draft nothing (autoregressive, early exit)."""
    return NoDrafter()


register(
    MethodSpec(
        name="autoregressive",
        family="baseline",
        lossless="distribution-exact",
        paper="-",
        summary="accelgen's own token-by-token loop with a KV cache; the reference every method is checked against",
        drafter=Part(no_drafter),
    )
)

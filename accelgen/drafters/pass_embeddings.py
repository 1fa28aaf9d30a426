"""PaSS: parallel speculative sampling with look-ahead embeddings (Monea et al. 2023, arXiv:2311.13581).

The target drafts for itself. Before each step, one extra target forward (run by the loop: the drafter
declares `drafts_with_target`) reads the root followed by the k trained look-ahead embeddings (`accelgen train
pass`, train/pass_embeddings.py): the root's row gives the next token, as plain decoding would, and slot i's
row guesses the token i + 1 places after it. The root's and the slots' rows are then dropped from the cache,
and the usual step verifies the chain of k + 1 tokens in a second forward. (On the first step the prompt is read in the drafting forward and kept, so it is read once.)

A step thus costs two target forwards and commits at least two tokens: the first draft token is the target's
own choice, and verification keeps it (up to float noise between the two forwards, which verification
decides). On a CPU, where a forward over a few tokens costs about as much as over one, every slot accepted
beyond that is a gain. Sampling draws each draft token from its row's distribution and verifies by
speculative sampling, so the output follows the target distribution exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from accelgen.draft import Draft
from accelgen.drafters.base import BuildContext, Drafter
from accelgen.errors import InputError
from accelgen.heads.pass_embeddings import LookaheadEmbeddings
from accelgen.registry import MethodOptions, MethodSpec, Part, register
from accelgen.sampling import SamplingConfig, draw, logits_to_probs


class PassDrafter(Drafter):
    """Drafts from the target's own forward, which the loop runs (generate.draft_with_target): over the tokens
    the cache lacks followed by `lookahead`, whose rows `draft_from` turns into the draft."""

    drafts_with_target = True

    def __init__(self, embeddings: LookaheadEmbeddings, sampling: SamplingConfig, generator: torch.Generator | None):
        self.embeddings = embeddings
        self.sampling = sampling
        self.generator = generator

    def lookahead(self, max_nodes: int) -> torch.Tensor:
        """(k, d) the slots fed after the root: max_nodes - 1 of them, the root's own row drafting the first token."""
        return self.embeddings.vectors[: max_nodes - 1]

    def draft_from(self, logits: torch.Tensor) -> Draft:
        """The draft from the target's (1 + k, vocab) logits at the root and at each slot."""
        if self.sampling.greedy:
            return Draft.chain(torch.tensor(logits.argmax(-1).tolist()))  # the draft's one host read
        draft_probs = logits_to_probs(logits, self.sampling)  # (1 + k, vocab)
        tokens = draw(draft_probs, self.generator).tolist()  # a token per row, drawn on the device; read once
        return Draft.chain(torch.tensor(tokens), draft_probs)


@dataclass(frozen=True)
class PassOptions(MethodOptions):
    heads: str | None = None  # the trained look-ahead embeddings' folder


def _make(build: BuildContext, options: PassOptions) -> PassDrafter:
    if not options.heads:
        raise InputError("pass needs trained look-ahead embeddings: --head FOLDER "
                         "(from `accelgen train pass --model M --out FOLDER`)")
    embeddings = LookaheadEmbeddings.load(options.heads, build.target_model).to(build.target_model.dtype)
    return PassDrafter(embeddings, build.sampling, build.generator)


register(
    MethodSpec(
        name="pass",
        family="speculative",
        lossless="distribution-exact",
        paper="Monea et al. 2023, arXiv:2311.13581",
        summary="the target drafts for itself: trained look-ahead embeddings after the last token guess the next "
                "k tokens in one extra forward",
        drafter=Part(_make, PassOptions),
        needs=("heads",),
    )
)

"""PaSS: parallel speculative sampling with look-ahead embeddings (Monea et al. 2023, arXiv:2311.13581).

The target drafts for itself. Before each step, one extra target forward reads the root followed by the k
trained look-ahead embeddings (`accelgen train pass`, train/pass_embeddings.py): the root's row gives the
next token, as plain decoding would, and slot i's row guesses the token i + 1 places after it. The root's and
the slots' rows are then dropped from the cache, and the usual step verifies the chain of k + 1 tokens in a
second forward. (On the first step the prompt is read in the drafting forward and kept, so it is read once.)

A step thus costs two target forwards and commits at least two tokens: the first draft token is the target's
own choice, and verification keeps it (up to float noise between the two forwards, which verification
decides). On a CPU, where a forward over a few tokens costs about as much as over one, every slot accepted
beyond that is a gain. Sampling draws each draft token from its row's distribution and verifies by
speculative sampling, so the output follows the target distribution exactly.
"""

from __future__ import annotations

import torch

from accelgen.draft import Draft
from accelgen.models.runner import ModelRunner
from accelgen.registry import MethodSpec, register
from accelgen.sampling import SamplingConfig, logits_to_probs, sample
from accelgen.train.pass_embeddings import LookaheadEmbeddings


class PassDrafter:
    def __init__(self, embeddings: LookaheadEmbeddings, sampling: SamplingConfig, generator: torch.Generator | None):
        self.embeddings = embeddings
        self.sampling = sampling
        self.generator = generator
        self.target: ModelRunner | None = None

    def attach(self, target: ModelRunner) -> None:
        self.target = target

    @torch.inference_mode()
    def propose(self, context: torch.Tensor, max_nodes: int) -> Draft:
        cached = self.target.length
        uncached = context[cached:]  # (u,) the root, and on the first step the whole prompt before it
        slots = self.embeddings.vectors[: max_nodes - 1]  # (k, d); the root's own row drafts the first token
        logits = self.target.forward(uncached, logits_for_last=1 + len(slots), appended=slots)  # (1 + k, vocab)
        # keep what comes before the root (the prompt is read once); the verify forward reads the root again
        self.target.keep(cached, list(range(len(uncached) - 1)))
        if self.sampling.greedy:
            return Draft.chain(logits.argmax(-1))
        draft_probs = logits_to_probs(logits, self.sampling)  # (1 + k, vocab)
        tokens = torch.tensor([sample(probs, self.generator) for probs in draft_probs])
        return Draft.chain(tokens, draft_probs)

    def update(self, draft: Draft, verdict, target_logits: torch.Tensor) -> None:
        pass


def _make(target_model, *, heads, sampling, generator, **_):
    if not heads:
        raise ValueError("pass needs trained look-ahead embeddings: --head FOLDER "
                         "(from `accelgen train pass --model M --out FOLDER`)")
    embeddings = LookaheadEmbeddings.load(heads, target_model).to(target_model.dtype)
    return PassDrafter(embeddings, sampling, generator)


register(
    MethodSpec(
        name="pass",
        family="speculative",
        lossless="distribution-exact",
        paper="Monea et al. 2023, arXiv:2311.13581",
        summary="the target drafts for itself: trained look-ahead embeddings after the last token guess the next "
                "k tokens in one extra forward",
        make_drafter=_make,
        needs=("heads",),
        options={"heads": None},
    )
)

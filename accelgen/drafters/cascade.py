"""Cascade speculative drafting (Chen et al. 2023, arXiv:2312.11462), with one draft model and a statistical one.

Two cascades over the drafters, cheapest last:

- Vertical: the draft model does not decode alone. The statistical model (the context's n-gram matches, else a
  bigram chain, see stage_two.py) proposes to it and one draft forward reviews the proposal, so the draft
  model's tokens come in fewer forwards, unchanged. `stage_two_tokens=0` turns this off.
- Horizontal: later draft positions are less likely to be accepted, so they get the cheaper drafter. The draft
  model drafts the first `gamma` positions, then the statistical model continues for `tail_tokens` more
  at no model cost. `tail_tokens=0` turns this off.

    context ─ x1 .. x_gamma (draft model, via the vertical cascade) ─ z1 .. z_tail (statistical model)

Verification is the target's usual rule. Greedy: greedy match, exact. Sampling: x_i carries the draft model's
distribution q_i; z_j is a deterministic function of what precedes it, so its draft row is a point mass, and
speculative sampling keeps the target distribution exactly (as in the paper's code).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from accelgen.draft import Draft
from accelgen.drafters.base import BuildContext, Drafter
from accelgen.drafters.budget import AUTO_LENGTH, draft_length
from accelgen.drafters.draft_model import draft_model_drafter
from accelgen.drafters.prompt_lookup import check_at_least_one
from accelgen.drafters.stage_two import SelfSpeculatingDraftModel, StageTwoOptions
from accelgen.errors import InputError
from accelgen.registry import MethodOptions, MethodSpec, Part, register
from accelgen.sampling import SamplingConfig

USUAL_GAMMA = 3  # the draft length with gamma="auto", capped each step by the measured costs


class CascadeDrafter(Drafter):
    def __init__(self, draft_model, sampling: SamplingConfig, generator: torch.Generator | None,
                 gamma: int = USUAL_GAMMA, tail_tokens: int = 3, stage_two_tokens: int = 4, max_ngram: int = 3):
        check_at_least_one(gamma=gamma)
        if tail_tokens < 0:
            raise InputError(f"tail_tokens must be >= 0, got {tail_tokens}")
        self.sampling = sampling
        self.gamma = gamma
        self.tail_tokens = tail_tokens
        self.stage_two = SelfSpeculatingDraftModel(draft_model, sampling, generator, stage_two_tokens, max_ngram)

    def propose(self, context: torch.Tensor, max_nodes: int) -> Draft:
        """context: (L,) long, prompt + committed tokens."""
        context_ids = context.tolist()
        # the draft model may have a shorter context than the target; the statistical model has no limit
        count = max(0, min(self.gamma, max_nodes, self.stage_two.max_positions - len(context_ids)))
        model_tokens, model_logits = self.stage_two.chain(context_ids, count)  # model_logits: (count, vocab)
        tail = self.stage_two.cheap.propose(context_ids + model_tokens, min(self.tail_tokens, max_nodes - count))
        tokens = torch.tensor(model_tokens + tail, dtype=torch.long)
        if self.sampling.greedy:
            return Draft.chain(tokens)
        tail_probs = one_hot_rows(tail, self.stage_two.runner.vocab_size)  # (len(tail), vocab)
        return Draft.chain(tokens, torch.cat([self.stage_two.probs(model_logits), tail_probs]))

    def update(self, draft, verdict, target_logits) -> None:
        pass  # the next proposal rolls the draft cache back to the committed context


def one_hot_rows(tokens: list[int], vocab_size: int) -> torch.Tensor:
    """(len(tokens), vocab) float32: the point masses a deterministic drafter draws its tokens from."""
    rows = torch.zeros(len(tokens), vocab_size)
    rows[torch.arange(len(tokens)), torch.tensor(tokens, dtype=torch.long)] = 1.0
    return rows


@dataclass(frozen=True)
class CascadeLengths(MethodOptions):
    # tokens the draft model drafts, itself drafted for by the n-gram/bigram model (AUTO_LENGTH: USUAL_GAMMA, capped
    # by the measured costs)
    gamma: int | str = AUTO_LENGTH
    tail_tokens: int = 3  # tokens the n-gram/bigram model drafts after them


@dataclass(frozen=True)
class CascadeOptions(StageTwoOptions, CascadeLengths):
    """The draft lengths, then the second stage's options."""


def _make(build: BuildContext, options: CascadeOptions) -> CascadeDrafter:
    return draft_model_drafter(build, CascadeDrafter, **{**options.as_dict(),
                                                         "gamma": draft_length(options.gamma, USUAL_GAMMA)})


register(
    MethodSpec(
        name="cascade",
        family="speculative",
        lossless="distribution-exact",
        paper="Chen et al. 2023, arXiv:2312.11462",
        summary="vertical cascade: an n-gram/bigram model drafts for the draft model; horizontal cascade: the "
                "draft model drafts the first positions, the n-gram/bigram model the later ones",
        drafter=Part(_make, CascadeOptions),
        needs=("draft_model",),
        draft_budget="measured",  # drafts capped by the measured costs unless the request fixes their length
    )
)

"""Staged speculative decoding (Spector & Re 2023, arXiv:2308.04623).

Two changes to draft-model speculation:

1. Staged speculation: the draft model's own decoding is speculative too. A model-free n-gram/bigram model
   built from the context proposes tokens to the draft model, which checks them in one forward (stage two,
   see stage_two.py); the draft tokens are exactly the draft model's, in fewer draft forwards.
2. A tree-structured batch: besides the chain of `gamma` draft tokens, the target scores `branches - 1`
   alternatives for the first position, as siblings of the first draft token. A miss at the first (most
   often decisive) position can then still commit two tokens.

    root ─ x1 ─ x2 ─ .. ─ x_gamma     tokens  [x1 .. x_gamma, y1 .. y_{branches-1}]
        ├ y1                         parents [-1, 0, .., gamma-2, -1, ..]
        └ ..

Greedy: the alternatives are the draft model's next most probable first tokens, and any tree is verified
exactly by greedy match. Sampling: they are further i.i.d. draws from the draft distribution q at the root,
each with q as its draft row, so SpecInfer's multi-step speculative sampling (the loop's default verifier)
keeps the target distribution; the chain below x1 is drawn from q given x1, as plain speculative sampling needs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from accelgen.draft import ROOT, Draft
from accelgen.drafters.base import BuildContext, Drafter
from accelgen.drafters.budget import AUTO_LENGTH, draft_length
from accelgen.drafters.draft_model import draft_model_drafter
from accelgen.drafters.prompt_lookup import check_at_least_one
from accelgen.drafters.stage_two import SelfSpeculatingDraftModel, StageTwoOptions
from accelgen.errors import InputError
from accelgen.registry import MethodOptions, MethodSpec, Part, register
from accelgen.sampling import SamplingConfig, draw

USUAL_GAMMA = 5  # the draft length with gamma="auto", capped each step by the measured costs


class StagedDrafter(Drafter):
    def __init__(self, draft_model, sampling: SamplingConfig, generator: torch.Generator | None,
                 gamma: int = USUAL_GAMMA, branches: int = 2, stage_two_tokens: int = 4, max_ngram: int = 3):
        check_at_least_one(gamma=gamma, branches=branches)
        if stage_two_tokens < 1:
            raise InputError(f"stage_two_tokens must be >= 1 (the second stage is what makes `staged`), got "
                             f"{stage_two_tokens}")
        self.sampling = sampling
        self.generator = generator
        self.gamma = gamma
        self.branches = branches
        self.stage_two = SelfSpeculatingDraftModel(draft_model, sampling, generator, stage_two_tokens, max_ngram)

    def propose(self, context: torch.Tensor, max_nodes: int) -> Draft:
        """context: (L,) long, prompt + committed tokens."""
        # the draft model may have a shorter context than the target: draft less, or not at all
        count = min(self.gamma, max_nodes, self.stage_two.max_positions - len(context))
        if count <= 0:
            return Draft.empty()
        chain, chain_logits = self.stage_two.chain(context.tolist(), count)  # chain_logits: (count, vocab)
        alternatives = self._alternatives(chain[0], chain_logits[0], min(self.branches - 1, max_nodes - count))
        tokens = torch.tensor(chain + alternatives, dtype=torch.long)
        parents = torch.tensor(list(range(ROOT, count - 1)) + [ROOT] * len(alternatives), dtype=torch.long)
        if self.sampling.greedy:
            return Draft(tokens, parents)
        chain_probs = self.stage_two.probs(chain_logits)  # (count, vocab)
        return Draft(tokens, parents, torch.cat([chain_probs, chain_probs[:1].expand(len(alternatives), -1)]))

    def update(self, draft, verdict, target_logits) -> None:
        pass  # the next proposal rolls the draft cache back to the committed context

    def _alternatives(self, first: int, root_logits: torch.Tensor, count: int) -> list[int]:
        """count more first tokens beside `first`, from root_logits (vocab,): the next most probable ones
        (greedy), or further i.i.d. draws from q, duplicates kept (sampling: the verifier's rule needs them)."""
        if count <= 0:
            return []
        if self.sampling.greedy:
            ranked = torch.topk(root_logits, min(count + 1, root_logits.shape[-1])).indices.tolist()
            return [token for token in ranked if token != first][:count]
        root_probs = self.stage_two.probs(root_logits)
        return draw(root_probs.expand(count, -1), self.generator).tolist()  # drawn at once, read once


@dataclass(frozen=True)
class StagedTree(MethodOptions):
    gamma: int | str = AUTO_LENGTH  # tokens of the draft model's chain (AUTO_LENGTH: USUAL_GAMMA, capped by the costs)
    branches: int = 2  # first tokens of the tree: the chain's and branches - 1 alternatives


@dataclass(frozen=True)
class StagedOptions(StageTwoOptions, StagedTree):
    """The tree's shape, then the second stage's options."""


def _make(build: BuildContext, options: StagedOptions) -> StagedDrafter:
    return draft_model_drafter(build, StagedDrafter, **{**options.as_dict(),
                                                        "gamma": draft_length(options.gamma, USUAL_GAMMA)})


register(
    MethodSpec(
        name="staged",
        family="speculative",
        lossless="distribution-exact",
        paper="Spector & Re 2023, arXiv:2308.04623",
        summary="the draft model is itself sped up by an n-gram/bigram second stage; its chain plus alternative "
                "first tokens form a small tree verified in one target forward",
        drafter=Part(_make, StagedOptions),
        needs=("draft_model",),
        draft_budget="measured",  # drafts capped by the measured costs unless the request fixes their length
    )
)

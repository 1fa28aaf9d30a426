"""Medusa (Cai et al. 2024) and blockwise parallel decoding (Stern et al. 2018): drafts from heads on the
target's own last hidden state, trained by `accelgen train medusa` (train/medusa.py).

After each step, the feature of the last committed row (the row whose logits chose the new root) goes through
the K heads; head k guesses the token k places after the root, whatever the tokens between. The tree is grown
by the shared tree drafter (drafters/draft_tree.py) with the heads as its scorer: a node at depth d gets its
children from head d + 1.

- `blockwise`: the chain of the heads' top-1 tokens, verified by longest-prefix match (Stern et al.).
- `medusa`: a static tree from the Cartesian product of the heads' top-k, given by path choices: path [0, 2]
  is head 1's best token followed by head 2's third best. With `width` > 0 the tree is dynamic instead:
  EAGLE-2's expansion of the `width` most probable nodes per level, by the product of the heads' confidences.
  All of it is verified in one target forward with tree attention.

Greedy verification is exact. For sampling, each node's children are drawn i.i.d. from its head's distribution
and verified with SpecInfer's multi-step rule, so the output follows the target's distribution exactly; the
tests check both. `medusa-typical` drafts as `medusa` and verifies with Medusa's typical acceptance
(verify/typical.py), which accepts more and is lossy by design; the benchmark reports its agreement.

The heads read the target's hidden states, which the runner keeps for them (`ModelRunner.keep_hidden`). A
sequence drafting with them therefore takes a forward of its own in the server rather than a batched one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from accelgen.draft import depths, to_device
from accelgen.drafters.base import BuildContext
from accelgen.drafters.draft_tree import DraftTreeDrafter
from accelgen.errors import InputError
from accelgen.heads.medusa import MedusaHeads
from accelgen.models.runner import ModelRunner
from accelgen.registry import MethodOptions, MethodSpec, Part, register
from accelgen.verify import check_typical_options, greedy_rule_verifier, verify_typical

# a small default tree for 4 heads (Medusa's choices are of this form): 3 first tokens, then fewer deeper;
# fewer heads use the paths they reach
DEFAULT_PATHS = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 0, 0, 0]]


class MedusaScorer:
    """Draft logits from Medusa heads (the scorer of DraftTreeDrafter): every head at once from the feature of
    the row that chose the root; a node's children come from the head one deeper, whatever the node's token."""

    max_positions = 1 << 30  # the heads add no context limit: the target's runner checks its own

    def __init__(self, target: ModelRunner, heads: MedusaHeads):
        self.heads = heads
        self.lm_head = heads.lm_head(target.model)
        self.guesses: torch.Tensor | None = None  # (K, vocab) every head's logits for this step
        self.target = target  # its runner keeps the hidden states the heads read (MethodSpec.reads_target_hidden)

    @torch.inference_mode()
    def root_logits(self, context: list[int]) -> torch.Tensor | None:
        """(vocab,) head 1's logits; None on the first step, before the target has any features."""
        features = self.target.hidden  # (cached, d): the last row is the one that chose the root
        if features is None or len(features) == 0:
            return None
        self.guesses = self.lm_head(self.heads(features[-1]))
        return self.guesses[0]

    def score(self, tokens: torch.Tensor, parents: list[int], nodes: list[int]) -> torch.Tensor:
        """(len(nodes), vocab) the logits of each node's children: those of the head one deeper than the node
        (whatever the tokens: the heads guessed every depth at the root)."""
        depth = depths(torch.tensor(parents, dtype=torch.long))
        return self.guesses.index_select(0, to_device(depth[nodes], self.guesses.device))


def load(target_model, heads) -> MedusaHeads:
    if not heads:
        raise InputError("this method needs trained Medusa heads: heads=FOLDER "
                         "(from `accelgen train medusa --model M --out FOLDER`)")
    return MedusaHeads.load(heads, target_model)


@dataclass(frozen=True)
class HeadsOptions(MethodOptions):
    heads: str | None = None  # the trained heads' folder


@dataclass(frozen=True)
class MedusaOptions(HeadsOptions):
    paths: list[list[int]] | None = None  # static tree: its paths (None: DEFAULT_PATHS, as deep as the heads go)
    width: int = 0  # > 0: a dynamic tree instead, this wide ...
    depth: int = 0  # ... this deep (0: as deep as the heads go) ...
    max_nodes: int = 0  # ... with at most this many nodes (0: 32)


@dataclass(frozen=True)
class TypicalOptions(MethodOptions):
    epsilon: float = 0.09  # a drafted token passes above min(epsilon, delta·exp(-entropy))
    delta: float = 0.3

    def __post_init__(self):
        check_typical_options(self.epsilon, self.delta)


def _make_medusa(build: BuildContext, options: MedusaOptions) -> DraftTreeDrafter:
    medusa = load(build.target_model, options.heads)
    scorer = MedusaScorer(build.target, medusa)
    sampling, generator, depth = build.sampling, build.generator, options.depth
    if options.width:  # dynamic
        if depth > len(medusa):
            raise InputError(f"depth {depth} is deeper than the {len(medusa)} tokens the heads guess ahead")
        return DraftTreeDrafter(scorer, sampling, generator, width=options.width, depth=depth or len(medusa),
                                max_nodes=options.max_nodes or 32)
    # the default, as deep as the heads go
    paths = options.paths or [path for path in DEFAULT_PATHS if len(path) <= len(medusa)]
    drafter = DraftTreeDrafter(scorer, sampling, generator, paths=paths)
    deepest = max(map(len, drafter.shape)) + 1
    if deepest > len(medusa):
        raise InputError(f"paths reach depth {deepest}, but the heads guess only {len(medusa)} tokens ahead")
    return drafter


def _make_blockwise(build: BuildContext, options: HeadsOptions) -> DraftTreeDrafter:
    medusa = load(build.target_model, options.heads)  # the chain of each head's top-1 (or draw, when sampling)
    return DraftTreeDrafter(MedusaScorer(build.target, medusa), build.sampling, build.generator, branching=[1] * len(medusa))


register(
    MethodSpec(
        name="blockwise",
        family="speculative",
        lossless="distribution-exact",
        paper="Stern et al. 2018, arXiv:1811.03115",
        summary="k heads on the target's last hidden state propose the next k tokens at once; the longest prefix "
                "the target agrees with is kept",
        drafter=Part(_make_blockwise, HeadsOptions),
        needs=("heads",),
        reads_target_hidden=True,
    )
)

register(
    MethodSpec(
        name="medusa",
        family="speculative",
        lossless="distribution-exact",
        paper="Cai et al. 2024, arXiv:2401.10774",
        summary="Medusa heads on the target's last hidden state; a static tree from the Cartesian product of "
                "their top-k (path choices), or a dynamic one (width > 0), verified in one forward with tree attention",
        drafter=Part(_make_medusa, MedusaOptions),
        needs=("heads",),
        reads_target_hidden=True,
    )
)


register(
    MethodSpec(
        name="medusa-typical",
        family="speculative",
        lossless="lossy",
        paper="Cai et al. 2024, arXiv:2401.10774",
        summary="Medusa's tree verified with typical acceptance: a drafted token passes if the target gives it more "
                "than min(epsilon, delta·exp(-entropy))",
        drafter=Part(_make_medusa, MedusaOptions),
        verifier=Part(greedy_rule_verifier(verify_typical, "epsilon", "delta"), TypicalOptions),
        needs=("heads",),
        reads_target_hidden=True,
        greedy_only=True,
    )
)

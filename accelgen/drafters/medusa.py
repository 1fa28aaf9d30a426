"""Medusa (Cai et al. 2024) and blockwise parallel decoding (Stern et al. 2018): drafts from heads on the
target's own last hidden state, trained by `accelgen train medusa` (train/medusa.py).

After each step, the hidden state of the last committed row (the row whose logits chose the new root) goes
through the K heads; head k guesses the token k places after the root. With blockwise, the draft is the chain
of the heads' top-1 tokens, verified by greedy longest-prefix match (Stern et al.'s verification). With
medusa, the draft is a static tree from the Cartesian product of the heads' top-k. The tree is given by path
choices: path [0, 2] is head 1's best token followed by head 2's third best. All of it is verified in one
target forward with tree attention. Greedy verification is exact, and the tests check it token for token.

The heads read the target's hidden states, which the runner keeps for them (`ModelRunner.keep_hidden`). A
sequence drafting with them therefore takes a forward of its own in the server rather than a batched one.
Both are greedy only. `medusa-typical` drafts as `medusa` and verifies with Medusa's typical acceptance
(verify/typical.py), which accepts more and is lossy by design; the benchmark reports its agreement.
"""

from __future__ import annotations

import torch

from accelgen.draft import ROOT, Draft
from accelgen.drafters.draft_tree import shape_from_paths
from accelgen.models.layerwise import llama_decoder
from accelgen.models.runner import ModelRunner
from accelgen.registry import MethodSpec, register
from accelgen.train.medusa import MedusaHeads
from accelgen.verify.typical import check_typical_options, verify_typical

# a small default tree for 4 heads (Medusa's choices are of this form): 3 first tokens, then fewer deeper;
# fewer heads use the paths they reach
DEFAULT_PATHS = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 0, 0, 0]]


class MedusaDrafter:
    def __init__(self, target_model, heads: MedusaHeads, paths: list[list[int]]):
        llama_decoder(target_model, "drafting from the target's hidden states")  # the runner calls model.model
        self.lm_head = target_model.get_output_embeddings()
        self.heads = heads
        self.paths = sorted({tuple(path) for path in paths}, key=lambda path: (len(path), path))
        shape_from_paths([list(path) for path in self.paths])  # checks that every prefix is there
        deepest = max(len(path) for path in self.paths)
        if deepest > len(heads):
            raise ValueError(f"paths reach depth {deepest}, but the heads guess only {len(heads)} tokens ahead")
        self.target: ModelRunner | None = None
        self.next_hidden: torch.Tensor | None = None  # (d,) the last committed row's hidden state

    def attach(self, target: ModelRunner) -> None:
        self.target = target
        target.keep_hidden = True

    @torch.inference_mode()
    def propose(self, context: torch.Tensor, max_nodes: int) -> Draft:
        if self.next_hidden is None:  # the first step: the prompt's hidden states do not exist yet
            return Draft.empty()
        widest = max(path[-1] for path in self.paths) + 1
        guesses = self.heads(self.next_hidden, self.lm_head).topk(widest, dim=-1).indices  # (K, widest)
        tokens, parents, node_of = [], [], {(): ROOT}
        for path in self.paths:
            node_of[path] = len(tokens)
            tokens.append(int(guesses[len(path) - 1, path[-1]]))
            parents.append(node_of[path[:-1]])
        return Draft(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long)).truncated(max_nodes)

    def update(self, draft: Draft, verdict, target_logits: torch.Tensor) -> None:
        self.next_hidden = self.target.hidden[-1]  # the last cached row: its logits chose the new root


def load(target_model, heads) -> MedusaHeads:
    if not heads:
        raise ValueError("this method needs trained Medusa heads: heads=FOLDER "
                         "(from `accelgen train medusa --model M --out FOLDER`)")
    return MedusaHeads.load(heads, target_model)


def _make_medusa(target_model, *, heads, paths, **_):
    medusa = load(target_model, heads)
    if not paths:  # the default tree, down to the depth the heads reach
        paths = [path for path in DEFAULT_PATHS if len(path) <= len(medusa)]
    return MedusaDrafter(target_model, medusa, paths)


def _make_blockwise(target_model, *, heads, **_):
    medusa = load(target_model, heads)
    chain = [[0] * depth for depth in range(1, len(medusa) + 1)]  # each head's top-1, one after the other
    return MedusaDrafter(target_model, medusa, chain)


register(
    MethodSpec(
        name="blockwise",
        family="speculative",
        lossless="greedy-exact",
        paper="Stern et al. 2018, arXiv:1811.03115",
        summary="k heads on the target's last hidden state propose the next k tokens at once; the longest prefix "
                "the target agrees with is kept",
        make_drafter=_make_blockwise,
        needs=("heads",),
        options={"heads": None},
    )
)

register(
    MethodSpec(
        name="medusa",
        family="speculative",
        lossless="greedy-exact",
        paper="Cai et al. 2024, arXiv:2401.10774",
        summary="Medusa heads on the target's last hidden state; a static tree from the Cartesian product of "
                "their top-k (path choices) verified in one forward with tree attention",
        make_drafter=_make_medusa,
        needs=("heads",),
        options={"heads": None, "paths": None},
    )
)


def _make_typical_verifier(sampling, *, epsilon, delta, **_):
    check_typical_options(epsilon, delta)
    return lambda draft, target_logits, generator: verify_typical(draft, target_logits, epsilon, delta)


register(
    MethodSpec(
        name="medusa-typical",
        family="speculative",
        lossless="lossy",
        paper="Cai et al. 2024, arXiv:2401.10774",
        summary="Medusa's tree verified with typical acceptance: a drafted token passes if the target gives it more "
                "than min(epsilon, delta·exp(-entropy))",
        make_drafter=_make_medusa,
        make_verifier=_make_typical_verifier,
        needs=("heads",),
        options={"heads": None, "paths": None, "epsilon": 0.09, "delta": 0.3},
        greedy_only=True,
    )
)

"""Drafting inside the verifying forward with mask tokens: the mechanism BiTA (drafters/bita.py) and SPACE
(drafters/space.py) share. Only what the trained artifact holds differs (heads/mask_tokens.py).

Each step the loop feeds the target the tokens its cache lacks (the root), the draft, and then, declared by the
drafter's `drafts_in_verify`, a *group* of appended embeddings after the root and after every draft node: the
artifact's prompts (BiTA) and its k masks, a chain hanging from that node:

    root ─ a ─ b            (the draft, verified as usual)
    └ [p·prompt, k·mask]    (the group after the root: sees the context up to the root)
          └ [...]           (after a: sees the context, a; after b: the context, a, b)

A group sees the cache, the path to its node and its own earlier members; nothing real sees a group, and the
groups come after every real token in the block, so the target's rows for the root and the draft are exactly the
rows of plain verification. Whatever prefix of the draft is accepted, the group after its last accepted node has
seen exactly the committed text: its k mask rows guess the k tokens after the target's own next token (the new
root), and become the next draft, a chain of k. The groups' KV entries are dropped with the rejected nodes'.

A step thus costs one target forward over 1 + n + (n + 1)(p + k) positions and commits 1 + accepted tokens. On a
CPU a forward over a few dozen positions costs little more than over one (accelgen/costs.py measures it), which is
what this buys. Greedy only: the draft is each mask row's argmax; verification keeps the output greedy-exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from accelgen.draft import Draft, Verdict, causal, tree_attention
from accelgen.drafters.base import BuildContext, Drafter
from accelgen.errors import InputError
from accelgen.heads.mask_tokens import MaskTokens
from accelgen.models.runner import ModelRunner
from accelgen.registry import MethodOptions


def with_groups(pattern: torch.Tensor, anchors: list[int], group: int) -> torch.Tensor:
    """The attention pattern (m + g·s, m + g·s) bool of a block of m tokens arranged by pattern (m, m), followed
    by one group of s appended positions per anchor row (in anchors' order): the group's members form a chain
    that sees what its anchor row sees (the anchor included) and its own earlier members."""
    m, groups = pattern.shape[0], len(anchors)
    size = m + groups * group
    allowed = torch.zeros(size, size, dtype=torch.bool)
    allowed[:m, :m] = pattern
    chain = causal(group)
    for index, anchor in enumerate(anchors):
        start = m + index * group
        allowed[start : start + group, :m] = pattern[anchor]
        allowed[start : start + group, start : start + group] = chain
    return allowed


class MaskRunner(ModelRunner):
    """The target's runner for BiTA and SPACE: it holds the trained mask tokens, and applies SPACE's low-rank
    deltas to the appended positions of a forward only. Its forwards carry appended groups, which a padded batch
    of other sequences' forwards cannot place, so it never shares a batched forward."""

    batches = False

    def __init__(self, model, tokens: MaskTokens):
        super().__init__(model)
        self.mask_tokens = tokens

    def forward(self, token_ids: torch.Tensor, tree: torch.Tensor | None = None, logits_for_last: int = 0,
                appended: torch.Tensor | None = None) -> torch.Tensor:
        rows = 0 if appended is None else appended.shape[0]
        with self.mask_tokens.lora_on_last(self.model, rows):
            return super().forward(token_ids, tree, logits_for_last, appended)


class MaskDrafter(Drafter):
    """Its next draft is read off the verifying forward's mask rows (`read_masks`); `propose` hands it over."""

    drafts_in_verify = True

    def __init__(self, tokens: MaskTokens, masks: int = 0):
        """masks: how many of the k trained masks a group holds (0: all); mask i sees only masks before it, so the
        first j give the rows they would give in a whole group, for a shorter draft at a cheaper forward."""
        if not 0 <= masks <= tokens.count:
            raise InputError(f"masks={masks}: these mask tokens have {tokens.count} masks (0 uses all)")
        self.masks = masks or tokens.count
        self.group = tokens.group.detach()[: len(tokens.prompts) + self.masks]  # (p + masks, d)
        self.next_draft = Draft.empty()  # hangs below the current root

    @property
    def mask_depth(self) -> int:
        """Positions a group reaches past its node."""
        return len(self.group)

    def propose(self, context: torch.Tensor, max_nodes: int) -> Draft:
        return self.next_draft.truncated(max_nodes)

    def mask_inputs(self, draft: Draft, prefix: int) -> tuple[torch.Tensor, torch.Tensor]:
        """((n + 1)·(p + k), d) embeddings: a group after the root (row prefix - 1 of the block) and after each of
        the draft's n nodes; and the block's attention pattern, the prefix's tokens and the draft first."""
        pattern = causal(prefix + len(draft)) if draft.is_chain else tree_attention(draft.parents, prefix=prefix)
        anchors = [prefix - 1 + row for row in range(len(draft) + 1)]
        appended = self.group.repeat(len(anchors), 1)
        return appended, with_groups(pattern, anchors, len(self.group))

    def read_masks(self, draft: Draft, verdict: Verdict, rows: torch.Tensor) -> None:
        """rows ((n + 1)·(p + k), vocab), or none: the next draft is the argmax of the masks in the group after the
        last accepted node (the root's group when none was accepted)."""
        if len(rows) == 0:
            self.next_draft = Draft.empty()
            return
        anchor = 0 if not verdict.accepted else verdict.accepted[-1] + 1
        group = rows[anchor * len(self.group) : (anchor + 1) * len(self.group)]
        self.next_draft = Draft.chain(group[len(self.group) - self.masks :].argmax(-1))


@dataclass(frozen=True)
class MaskOptions(MethodOptions):
    heads: str | None = None  # the trained mask tokens' folder


@dataclass(frozen=True)
class MaskDraftOptions(MethodOptions):
    masks: int = 0  # masks per group, the draft's length: 0 = all that were trained


def runner_maker(method: str):
    """The runner factory of `method` ("bita" or "space"): its mask tokens loaded from --head, checked to fit."""

    def make(model, options: MaskOptions) -> MaskRunner:
        if not options.heads:
            raise InputError(f"{method} needs trained mask tokens: --head FOLDER "
                             f"(from `accelgen train {method} --model M --out FOLDER`)")
        tokens = MaskTokens.load(options.heads, model, method).to(model.dtype)
        return MaskRunner(model, tokens)

    return make


def make_drafter(build: BuildContext, options: MaskDraftOptions) -> MaskDrafter:
    if not isinstance(build.target, MaskRunner):
        raise InputError("mask-token drafting needs its own target runner (MaskRunner), which the loop builds")
    return MaskDrafter(build.target.mask_tokens, options.masks)

"""Token trees from a draft model, shared by `specinfer`, `mcsd`, `spectr` and `eagle`: one batched draft
forward per depth level.

The tree grows level by level. A *plan* says which nodes of the deepest level get children and how many;
one tree forward of the draft model scores the planned nodes (with their ancestors, under tree attention),
and their children are picked from the draft distributions:

    greedy                       the top-k tokens (verified by greedy match: any tree is exact)
    sampling, with replacement   k i.i.d. draws from q: SpecInfer's multi-step rule is exact for them
    sampling, without repl.      k draws from q, each removing the tokens drawn before (MCSD's rule)

Duplicate siblings drawn with replacement stay separate nodes: merging them would change the law the
verifier relies on. For sampling, how many children a node gets is fixed before they are drawn, and drawn
children are never pruned afterwards, so the siblings the verifier sees are exactly the draws it expects.

Static plans follow a fixed shape: `branching[d]` children for every node of level d, or a list of paths
as Medusa's "choices" (path [0, 2] = the third child of the first child of the root; children are ranked by
draft probability for greedy, in draw order for sampling). Dynamic plans (EAGLE-2's idea) expand only
the `width` nodes of the level with the highest cumulative draft log-probability (`width` children each); for greedy the finished
tree is reranked, keeping the `max_nodes` most probable nodes (a node is never more probable than its
parent, so they form a tree).

Worked example, branching [2, 1]:   root ─ a(0) ─ c(2)      tokens  [a, b, c, d]
                                         └ b(1) ─ d(3)      parents [-1, -1, 0, 1]
The draft cache holds the context (root included). Level 1 comes from the root's logits; level 2 needs one
forward over [a, b] with a tree mask (a and b do not see each other); the leaves c, d need no forward.
The scored nodes stay in the draft cache after the context, so each level's forward covers only that level's
planned nodes, attending to their ancestors among the cached nodes (every node with children was scored at
its own level). The next proposal cuts the cache back to the committed context before catching up.

What scores the tree is a *scorer*: `root_logits(context)` (None when it cannot draft yet) and
`score(tokens, parents, nodes)`. `DraftModelScorer` runs a draft model; the EAGLE head (drafters/eagle.py) is
another.
"""

from __future__ import annotations

import torch

from accelgen.draft import ROOT, Draft
from accelgen.drafters.base import Drafter
from accelgen.drafters.draft_decoding import catch_up
from accelgen.models.runner import ModelRunner
from accelgen.sampling import SamplingConfig, gumbel_choice, logits_to_probs, sample


class DraftModelScorer:
    """Draft logits from a draft model: at the root, after catching its cache up with the context, and after
    any tree nodes (one tree forward over those not cached yet, seeing their cached ancestors)."""

    def __init__(self, draft_model):
        if not isinstance(draft_model, torch.nn.Module):
            raise ValueError("a draft model that expands token trees level by level needs its PyTorch model; "
                             "load the draft in a PyTorch format (draft weights bf16, int8, int4 or fp32)")
        self.runner = ModelRunner(draft_model)
        self.cached_tokens: list[int] = []  # the committed context whose KV the draft cache holds
        self.cached_nodes: list[int] = []  # then the current tree's scored nodes, in cache order

    @property
    def max_positions(self) -> int:
        return self.runner.max_positions

    def root_logits(self, context: list[int]) -> torch.Tensor:
        """(vocab,) the draft's logits after the whole context."""
        self.runner.keep(len(self.cached_tokens), [])  # drop the last proposal's tree
        logits = catch_up(self.runner, self.cached_tokens, context)
        self.cached_nodes = []
        return logits

    def score(self, tokens: list[int], parents: list[int], nodes: list[int]) -> torch.Tensor:
        """(len(nodes), vocab) draft logits after each of nodes: one tree forward over those of nodes and their
        ancestors not cached yet, each seeing its cached ancestors; they stay cached for the next level.

        Example: parents [-1, -1, 0, 1], nodes [2] with node 0 cached: the forward covers node 2 (c), seeing a.
        """
        kept, _ = with_ancestors(parents, nodes)
        new = [node for node in kept if node not in self.cached_nodes]
        columns = self.cached_nodes + new  # the tree's part of the cache after this forward
        column = {node: i for i, node in enumerate(columns)}
        tree = torch.zeros(len(new), len(columns), dtype=torch.bool)  # (m, t + m): cached tree nodes, then new
        for row, node in enumerate(new):
            while node != ROOT:  # itself and its ancestors
                tree[row, column[node]] = True
                node = parents[node]
        logits = self.runner.forward(torch.tensor([tokens[node] for node in new]), tree)  # (m, vocab)
        self.cached_nodes = columns
        return logits[[new.index(node) for node in nodes]]


def with_ancestors(parents: list[int], nodes: list[int]) -> tuple[list[int], torch.Tensor]:
    """(nodes and all their ancestors in node order, their parents renumbered within that list).

    Example: parents [-1, -1, 0, 1], nodes [2] -> ([0, 2], tensor([-1, 0])).
    """
    needed = set()
    for node in nodes:
        while node != ROOT and node not in needed:
            needed.add(node)
            node = parents[node]
    kept = sorted(needed)  # parents still come first
    position = {node: i for i, node in enumerate(kept)}
    return kept, torch.tensor([position.get(parents[node], ROOT) for node in kept], dtype=torch.long)


class DraftTreeDrafter(Drafter):
    def __init__(self, scorer, sampling: SamplingConfig, generator: torch.Generator | None, *,
                 branching: list[int] | None = None, paths: list[list[int]] | None = None, width: int = 0,
                 depth: int = 0, max_nodes: int = 0, replacement: bool = True):
        """Trees scored by `scorer` (a DraftModelScorer, or anything with its `max_positions`, `root_logits` and
        `score`). Static tree: branching (children per node at each depth) or paths. Dynamic: width, depth,
        max_nodes."""
        if paths:
            self.shape = shape_from_paths(paths)
        elif branching is not None:
            self.shape = shape_from_branching(branching)
        elif width < 1 or depth < 1 or max_nodes < 1:
            raise ValueError(f"a dynamic tree needs width, depth and max_nodes >= 1, got {width}, {depth}, {max_nodes}")
        else:
            self.shape = None
        self.scorer = scorer
        self.sampling = sampling
        self.generator = generator
        self.width, self.depth, self.max_nodes = width, depth, max_nodes
        self.replacement = replacement

    @property
    def dynamic(self) -> bool:
        return self.shape is None

    def propose(self, context: torch.Tensor, max_nodes: int) -> Draft:
        depth = self.depth if self.dynamic else max(map(len, self.shape)) + 1
        depth = min(depth, self.scorer.max_positions - len(context))  # the draft model's own context limit
        if self.dynamic:
            max_nodes = min(max_nodes, self.max_nodes)
        if depth <= 0 or max_nodes <= 0:
            return Draft.empty()
        rerank = self.dynamic and self.sampling.greedy  # only greedy may prune drawn nodes
        budget = None if rerank else max_nodes
        tokens: list[int] = []
        parents: list[int] = []
        rows: list[torch.Tensor] = []  # (vocab,) the draft distribution each node was drawn from (at its parent)
        log_probs: list[float] = []  # cumulative draft log-probability of each node's path
        paths: dict[int, tuple[int, ...]] = {ROOT: ()}  # node -> child ranks from the root down
        frontier = [ROOT]
        for level in range(depth):
            plan = self._plan(frontier, log_probs, paths)
            if budget is not None:
                plan = _within_budget(plan, budget - len(tokens))
            if not plan:
                break
            nodes = [node for node, _ in plan]
            if level == 0:
                logits = self.scorer.root_logits(context.tolist())
                if logits is None:  # the scorer cannot draft yet (EAGLE before the target's first features)
                    return Draft.empty()
                logits = logits[None]
            else:
                logits = self.scorer.score(tokens, parents, nodes)
            frontier = []
            for (node, count), node_logits in zip(plan, logits):
                base = log_probs[node] if node != ROOT else 0.0
                children = self._children(node_logits, count, position=len(context) + level)
                for rank, (token, row, log_prob) in enumerate(children):
                    paths[len(tokens)] = paths[node] + (rank,)
                    tokens.append(token)
                    parents.append(node)
                    rows.append(row)
                    log_probs.append(base + log_prob)
                    frontier.append(len(tokens) - 1)
        draft = Draft(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long),
                      None if self.sampling.greedy else torch.stack(rows))
        return _most_probable(draft, log_probs, max_nodes) if rerank else draft

    def update(self, draft, verdict, target_logits) -> None:
        pass  # the next proposal rolls the draft cache back to the committed context

    def _plan(self, frontier: list[int], log_probs: list[float], paths: dict) -> list[tuple[int, int]]:
        """[(node, number of children)] for the nodes of the deepest level that get children, in node order."""
        if not self.dynamic:
            return [(node, self.shape[paths[node]]) for node in frontier if paths[node] in self.shape]
        if frontier == [ROOT]:
            return [(ROOT, self.width)]
        best = sorted(frontier, key=lambda node: -log_probs[node])[: self.width]
        return [(node, self.width) for node in sorted(best)]

    def _children(self, logits: torch.Tensor, count: int, position: int) -> list[tuple[int, torch.Tensor | None, float]]:
        """[(token, the row it was drawn from or None, its draft log-probability)] for one node's children, which
        sit at absolute position `position`."""
        if self.sampling.greedy:
            log_q = torch.log_softmax(logits, dim=-1)
            best = torch.topk(log_q, min(count, len(log_q))).indices.tolist()
            return [(token, None, min(0.0, float(log_q[token]))) for token in best]  # rounding: never above the parent
        draft_probs = logits_to_probs(logits, self.sampling)  # (vocab,)
        drawn, left = [], draft_probs.clone()
        for child in range(count):
            if left.sum() <= 0:  # without replacement: the support (after top-k / top-p) is used up
                break
            if child == 0 and self.sampling.noise is not None:
                # seeded: the first child takes the position's Gumbel noise, as the target's choice there does
                # (verify_gumbel), so it is accepted whenever the two models agree; the others are sampled
                token = int(gumbel_choice(left[None], self.sampling.noise.at(position)[None])[0])
            else:
                token = sample(left / left.sum(), self.generator)
            drawn.append((token, draft_probs, float(torch.log(draft_probs[token]))))
            if not self.replacement:
                left[token] = 0.0
        return drawn


def shape_from_branching(branching: list[int]) -> dict[tuple[int, ...], int]:
    """{path: number of children} of the tree where every node of depth d has branching[d] children."""
    branching = [int(width) for width in branching]
    if not branching or min(branching) < 1:
        raise ValueError(f"branching must be a non-empty list of positive widths, got {branching}")
    shape, level = {}, [()]
    for width in branching:
        shape.update({path: width for path in level})
        level = [path + (rank,) for path in level for rank in range(width)]
    return shape


def shape_from_paths(paths: list[list[int]]) -> dict[tuple[int, ...], int]:
    """{path: number of children} of the tree made of the given paths (Medusa's "choices").

    Example: [[0], [1], [0, 0], [0, 1]] -> {(): 2, (0,): 2}. Every prefix of a path must be a path too, and a
    node's children must be ranks 0..k-1 without gaps (sampled children have no rank to skip to).
    """
    try:
        given = {tuple(int(rank) for rank in path) for path in paths}
    except (TypeError, ValueError):
        raise ValueError(f"paths must be a list of lists of child ranks, e.g. [[0], [1], [0, 0]], got {paths!r}") from None
    children: dict[tuple[int, ...], set[int]] = {}
    for path in sorted(given):
        if not path or min(path) < 0:
            raise ValueError(f"paths must be non-empty lists of ranks >= 0, got {list(path)}")
        if len(path) > 1 and path[:-1] not in given:
            raise ValueError(f"path {list(path)} needs its prefix {list(path[:-1])} among the paths")
        children.setdefault(path[:-1], set()).add(path[-1])
    for parent, ranks in children.items():
        if ranks != set(range(len(ranks))):
            raise ValueError(f"the children of {list(parent)} must be ranks 0..{len(ranks) - 1} without gaps, "
                             f"got {sorted(ranks)}")
    return {parent: len(ranks) for parent, ranks in children.items()}


def _within_budget(plan: list[tuple[int, int]], room: int) -> list[tuple[int, int]]:
    """The plan cut to at most `room` children in all (earlier nodes first)."""
    kept = []
    for node, count in plan:
        count = min(count, room)
        if count <= 0:
            break
        kept.append((node, count))
        room -= count
    return kept


def _most_probable(draft: Draft, log_probs: list[float], max_nodes: int) -> Draft:
    """The max_nodes nodes with the highest path log-probability (ties: earlier node), as a Draft."""
    kept = sorted(sorted(range(len(draft)), key=lambda node: (-log_probs[node], node))[:max_nodes])
    position = {node: i for i, node in enumerate(kept)}
    position[ROOT] = ROOT
    parents = [position[int(draft.parents[node])] for node in kept]
    return Draft(draft.tokens[kept], torch.tensor(parents, dtype=torch.long))

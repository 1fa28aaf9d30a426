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
`score(tokens, parents, nodes)`. `DraftModelScorer` runs a draft model; the EAGLE head (drafters/eagle.py) and
Medusa's heads (drafters/medusa.py) are others.

The drafted tokens stay on the device until the tree is done: each level picks the children of all its planned
nodes at once (one batched top-k, or one batched draw per sibling rank) and feeds them to the next level's forward
as they are. The host reads what it needs once per level at most: a dynamic plan reads the level's path
log-probabilities to choose the nodes to expand, sampling without replacement the level's support sizes (how
many distinct children each node can have); the finished tree's tokens are read once. A static tree (Medusa's
heads included) therefore costs one host read in all.
"""

from __future__ import annotations

import sys

import torch

from accelgen.draft import ROOT, Draft, to_device
from accelgen.drafters.base import Drafter
from accelgen.drafters.draft_decoding import catch_up
from accelgen.errors import InputError
from accelgen.models.engines import runner_for
from accelgen.models.probe import choose_weights, decide
from accelgen.registry import get_method
from accelgen.sampling import SamplingConfig, draw, gumbel_choice, logits_to_probs


def draft_weights_for(methods: list[str], draft: str | None, draft_weights: str | None, *, device=None,
                      threads: int | None = None) -> str | None:
    """The weight format to load the draft in for these methods: draft_weights itself, except "auto" on the CPU
    where one of the methods needs a PyTorch draft (`MethodSpec.pytorch_draft`: it expands token trees with the
    draft level by level, which llama.cpp's runner cannot do, keeps a cache of its own or trains it): then the
    fastest PyTorch format the weights probe measured for the draft (where it found the GGUF file fastest), said
    on stderr. (On a GPU "auto" is bf16 already.)"""
    if draft is None or draft_weights != "auto" or not runs_on_cpu(device):
        return draft_weights
    needing = [name for name in methods if get_method(name).pytorch_draft]
    if not needing:
        return draft_weights
    probed = choose_weights(draft, threads=threads)
    if probed["weights"] != "gguf":
        return draft_weights
    pytorch = {fmt: timing for fmt, timing in probed["timings"].items() if fmt != "gguf"}
    if not pytorch:
        raise InputError(f"{methods_need(needing)} the draft as a PyTorch model, and the weights probe found no "
                         f"PyTorch format of {draft!r} here")
    weights = decide(pytorch)["weights"]
    print(f"accelgen: --draft-weights auto: {weights} for the draft, the fastest PyTorch format here: "
          f"{methods_need(needing)} the draft as a PyTorch model, which the GGUF file (fastest overall, run by "
          f"llama.cpp) is not", file=sys.stderr)
    return weights


def methods_need(names: list[str]) -> str:
    return f"{', '.join(names)} {'needs' if len(names) == 1 else 'need'}"


def runs_on_cpu(device) -> bool:
    """Whether a model loaded for `device` runs on the CPU (None: the default, the CPU; "auto": CUDA if torch sees
    a device)."""
    if device is None:
        return True
    if str(device) == "auto":
        return not torch.cuda.is_available()
    return torch.device(device).type == "cpu"


class DraftModelScorer:
    """Draft logits from a draft model: at the root, after catching its cache up with the context, and after
    any tree nodes (one tree forward over those not cached yet, seeing their cached ancestors)."""

    def __init__(self, draft_model):
        if not isinstance(draft_model, torch.nn.Module):
            raise InputError("a draft model that expands token trees level by level needs its PyTorch model; "
                             "load the draft in a PyTorch format (draft weights bf16, int8, int4 or fp32; on the "
                             "command line --draft-weights auto picks the fastest of them for this method)")
        self.runner = runner_for(draft_model)  # on a GPU: the static cache, each level's forward a CUDA graph
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

    def score(self, tokens: torch.Tensor, parents: list[int], nodes: list[int]) -> torch.Tensor:
        """(len(nodes), vocab) draft logits after each of nodes: one tree forward over those of nodes and their
        ancestors not cached yet, each seeing its cached ancestors; they stay cached for the next level.
        tokens: (n,) long, every node's token (on any device; a list too).

        Example: parents [-1, -1, 0, 1], nodes [2] with node 0 cached: the forward covers node 2 (c), seeing a.
        """
        tokens = torch.as_tensor(tokens)
        kept, _ = with_ancestors(parents, nodes)
        new = [node for node in kept if node not in self.cached_nodes]
        columns = self.cached_nodes + new  # the tree's part of the cache after this forward
        column = {node: i for i, node in enumerate(columns)}
        tree = torch.zeros(len(new), len(columns), dtype=torch.bool)  # (m, t + m): cached tree nodes, then new
        for row, node in enumerate(new):
            while node != ROOT:  # itself and its ancestors
                tree[row, column[node]] = True
                node = parents[node]
        logits = self.runner.forward(tokens.index_select(0, to_device(new, tokens.device)), tree)  # (m, vocab)
        self.cached_nodes = columns
        return logits.index_select(0, to_device([new.index(node) for node in nodes], logits.device))


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
            raise InputError(f"a dynamic tree needs width, depth and max_nodes >= 1, got {width}, {depth}, {max_nodes}")
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
        # on the device, read once at the end: each node's token and its path's cumulative draft log-probability
        tokens = torch.empty(0, dtype=torch.long)  # (n,) long
        log_probs = torch.empty(0, dtype=torch.float64)  # (n,) float64
        rows: list[torch.Tensor] = []  # per level, (k, vocab): the draft distribution each node was drawn from
        parents: list[int] = []
        paths: dict[int, tuple[int, ...]] = {ROOT: ()}  # node -> child ranks from the root down
        frontier = [ROOT]
        for level in range(depth):
            plan = self._plan(frontier, log_probs, paths)
            if budget is not None:
                plan = _within_budget(plan, budget - len(parents))
            if not plan:
                break
            nodes = [node for node, _ in plan]
            if level == 0:
                logits = self.scorer.root_logits(context.tolist())
                if logits is None:  # the scorer cannot draft yet (EAGLE before the target's first features)
                    return Draft.empty()
                logits = logits[None]
                tokens, log_probs = tokens.to(logits.device), log_probs.to(logits.device)
            else:
                logits = self.scorer.score(tokens, parents, nodes)
            level_tokens, level_log_probs, drawn_from, counts = self._children(
                logits, [count for _, count in plan], position=len(context) + level)
            # the children in node order: child `rank` of the plan's j-th node is level_tokens[j, rank]
            width, device = level_tokens.shape[1], logits.device
            picked = to_device([j * width + rank for j, count in enumerate(counts) for rank in range(count)], device)
            owners = to_device([j for j, count in enumerate(counts) for _ in range(count)], device)  # plan index
            bases = torch.zeros(len(plan), dtype=torch.float64, device=device) if level == 0 else \
                log_probs.index_select(0, to_device(nodes, device))  # the planned nodes' own path log-probability
            tokens = torch.cat([tokens, level_tokens.flatten().index_select(0, picked)])
            log_probs = torch.cat([log_probs, bases.index_select(0, owners)
                                   + level_log_probs.flatten().index_select(0, picked)])
            if drawn_from is not None:
                rows.append(drawn_from.index_select(0, owners))
            frontier = []
            for (node, _), count in zip(plan, counts):
                for rank in range(count):
                    paths[len(parents)] = paths[node] + (rank,)
                    frontier.append(len(parents))
                    parents.append(node)
        if rerank:
            return _most_probable(tokens, parents, log_probs, max_nodes)
        tokens = tokens.tolist()  # the tree's tokens, read back once
        return Draft(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long),
                     None if self.sampling.greedy else torch.cat(rows))

    def update(self, draft, verdict, target_logits) -> None:
        pass  # the next proposal rolls the draft cache back to the committed context

    def _plan(self, frontier: list[int], log_probs: torch.Tensor, paths: dict) -> list[tuple[int, int]]:
        """[(node, number of children)] for the nodes of the deepest level that get children, in node order.
        frontier: the deepest level's nodes, the last of the (n,) log_probs."""
        if not self.dynamic:
            return [(node, self.shape[paths[node]]) for node in frontier if paths[node] in self.shape]
        if frontier == [ROOT]:
            return [(ROOT, self.width)]
        level_log_probs = log_probs[len(log_probs) - len(frontier) :].tolist()  # the level's one host read
        best = sorted(range(len(frontier)), key=lambda i: -level_log_probs[i])[: self.width]
        return [(frontier[i], self.width) for i in sorted(best)]

    def _children(self, logits: torch.Tensor, counts: list[int],
                  position: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, list[int]]:
        """The children of a level's planned nodes, from their (m, vocab) logits, counts[j] for node j, at absolute
        position `position`; on the logits' device: (tokens (m, width) long, their draft log-probabilities
        (m, width) float64, (m, vocab) the distributions they were drawn from or None for greedy, and how many of
        each row's first columns are children: counts, fewer where the node has fewer candidates)."""
        if self.sampling.greedy:
            log_q = torch.log_softmax(logits, dim=-1)
            width = min(max(counts), log_q.shape[-1])
            best = torch.topk(log_q, width, dim=-1)  # one top-k over the whole level
            counts = [min(count, width) for count in counts]
            return best.indices, best.values.double().clamp_max(0.0), None, counts  # rounding: never above the parent
        draft_probs = logits_to_probs(logits, self.sampling)  # (m, vocab)
        if not self.replacement:  # without replacement a node has at most its support (after top-k / top-p)
            support = (draft_probs > 0).sum(dim=-1).tolist()  # the level's one host read
            counts = [min(count, size) for count, size in zip(counts, support)]
        drawn, left = [], draft_probs
        for rank in range(max(counts)):  # one draw per rank for the whole level
            if rank == 0 and self.sampling.noise is not None:
                # seeded: the first child takes the position's Gumbel noise, as the target's choice there does
                # (verify_gumbel), so it is accepted whenever the two models agree; the others are sampled
                token = gumbel_choice(left, self.sampling.noise.at(position, like=left))
            else:
                token = draw(left, self.generator)  # (m,); draw needs no normalised rows
            drawn.append(token)
            if not self.replacement:
                left = left.scatter(1, token[:, None], 0.0)
        tokens = torch.stack(drawn, dim=1)  # (m, width)
        return tokens, draft_probs.gather(1, tokens).log().double(), draft_probs, counts


def shape_from_branching(branching: list[int]) -> dict[tuple[int, ...], int]:
    """{path: number of children} of the tree where every node of depth d has branching[d] children."""
    branching = [int(width) for width in branching]
    if not branching or min(branching) < 1:
        raise InputError(f"branching must be a non-empty list of positive widths, got {branching}")
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
        raise InputError(f"paths must be a list of lists of child ranks, e.g. [[0], [1], [0, 0]], got {paths!r}") from None
    children: dict[tuple[int, ...], set[int]] = {}
    for path in sorted(given):
        if not path or min(path) < 0:
            raise InputError(f"paths must be non-empty lists of ranks >= 0, got {list(path)}")
        if len(path) > 1 and path[:-1] not in given:
            raise InputError(f"path {list(path)} needs its prefix {list(path[:-1])} among the paths")
        children.setdefault(path[:-1], set()).add(path[-1])
    for parent, ranks in children.items():
        if ranks != set(range(len(ranks))):
            raise InputError(f"the children of {list(parent)} must be ranks 0..{len(ranks) - 1} without gaps, "
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


def _most_probable(tokens: torch.Tensor, parents: list[int], log_probs: torch.Tensor, max_nodes: int) -> Draft:
    """The max_nodes nodes with the highest path log-probability (ties: earlier node), as a Draft; tokens (n,) and
    log_probs (n,) on the device, read back once with the choice."""
    count = min(max_nodes, len(parents))
    kept = torch.sort(log_probs, descending=True, stable=True).indices[:count].sort().values
    read = torch.cat([kept, tokens.index_select(0, kept)]).tolist()  # the tree's last host read
    kept, kept_tokens = read[:count], read[count:]
    position = {node: i for i, node in enumerate(kept)}
    position[ROOT] = ROOT
    return Draft(torch.tensor(kept_tokens, dtype=torch.long),
                 torch.tensor([position[parents[node]] for node in kept], dtype=torch.long))

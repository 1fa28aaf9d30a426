"""One target forward for several sequences, each with its own KV cache and its own number of new tokens.

Every sequence keeps its own cache (a `ModelRunner`), so ragged acceptance needs nothing special: after
the forward each sequence rolls its own cache back with `keep`. A batched forward stacks the caches into
one padded batch and splits it again afterwards; on a CPU that copy costs little next to the forward.

Layout of row i (cache lengths L_i, new blocks of m_i tokens; L = max L_i, M = max m_i):

    [ pad · (L - L_i) | cache · L_i | pad · (M - m_i) | new · m_i ]

Caches are left-padded and new blocks right-aligned (models/block.py: `left_padded`), so the last k columns of
every row are that row's last k new tokens and one `logits_to_keep` serves the whole batch. A 4-D attention mask
hides the padding. Runners share a batched forward when they declare it (`ModelRunner.batches`).
"""

from __future__ import annotations

import torch

from accelgen import cache as kv
from accelgen.draft import causal
from accelgen.models.block import Block, blocking_mask, left_padded
from accelgen.models.runner import ModelRunner

# forward_together: blocks wider than this and than twice the median width get a forward of their own
WIDEST_SHARED_BLOCK = 8


@torch.inference_mode()
def batched_forward(runners: list[ModelRunner], blocks: list[tuple]) -> list[torch.Tensor]:
    """Run ModelRunner.forward(*block) for every (runner, block) pair in one forward; a block is (token_ids, tree,
    logits_for_last), or with embeddings appended after it (BiTA, SPACE), whose runners do not batch.

    All runners wrap the same model. Returns each block's logits, (logits_for_last, vocab) float32, and
    leaves every runner's cache extended by its block, exactly as its own forward would.
    """
    if len(runners) == 1 or not all(runner.batches for runner in runners):
        # a runner with a forward of its own (early exit), one whose drafter reads its hidden states (Medusa), or
        # one whose masks a padded batch cannot express (a short sliding window, ALiBi) cannot share the forward
        return [runner.forward(*block) for runner, block in zip(runners, blocks)]
    model = runners[0].model
    lengths = [kv.cache_length(runner.cache) for runner in runners]
    widths = [len(token_ids) for token_ids, _, _ in blocks]
    cached, new = max(lengths), max(widths)
    geometry = [Block(length, causal(len(token_ids)) if tree is None else tree, runner.position_offset)
                for runner, length, (token_ids, tree, _) in zip(runners, lengths, blocks)]
    positions, allowed = left_padded(geometry)
    # built on the model's device: a draft's tokens may be there already, and copying them back would wait for it
    input_ids = torch.zeros(len(runners), new, dtype=torch.long, device=model.device)
    for row, (token_ids, _, _) in enumerate(blocks):
        input_ids[row, new - len(token_ids):] = token_ids.to(model.device, non_blocking=True)
    mask = blocking_mask(allowed, model.dtype)
    cache = kv.stack_left_padded([runner.cache for runner in runners], lengths, model.config)
    logits_for_last = max(keep for _, _, keep in blocks)
    output = model(
        input_ids=input_ids,
        position_ids=positions.to(model.device, non_blocking=True),
        attention_mask=mask[:, None].to(model.device, non_blocking=True),
        use_cache=True,
        **{kv.cache_keyword(model): cache},
        logits_to_keep=logits_for_last,
    )
    logits = output.logits.float()  # (batch, logits_for_last, vocab)
    for row, (runner, length, width) in enumerate(zip(runners, lengths, widths)):
        runner.cache = kv.row_of(cache, row, [(cached - length, cached), (cached + new - width, cached + new)],
                                 model.config)
    return [logits[row, logits_for_last - keep :] for row, (_, _, keep) in enumerate(blocks)]


def forward_alone(steps):
    """Drive a generator of (runner, token_ids) forwards one at a time; returns what the generator returns."""
    try:
        runner, token_ids = next(steps)
        while True:
            runner, token_ids = steps.send(runner.forward(token_ids, logits_for_last=1)[-1])
    except StopIteration as stop:
        return stop.value


def forward_together(generators: list) -> list:
    """Drive several generators of (runner, token_ids) forwards in lockstep (as `forward_alone` drives one):
    at each round, the pending forwards of plain runners over the same model share one batched forward.

    Returns each generator's return value, or the exception it raised (one failing generator stops only itself).
    """
    results: list = [None] * len(generators)
    pending: dict[int, tuple[ModelRunner, torch.Tensor]] = {}

    def advance(index: int, sent) -> None:
        try:
            pending[index] = generators[index].send(sent)
        except StopIteration as stop:
            pending.pop(index, None)
            results[index] = stop.value
        except Exception as error:
            pending.pop(index, None)
            results[index] = error

    for index in range(len(generators)):
        advance(index, None)
    while pending:
        groups: dict[object, list[int]] = {}
        widths = sorted(len(token_ids) for _, token_ids in pending.values())
        shared_width = max(WIDEST_SHARED_BLOCK, 2 * widths[len(widths) // 2])
        for index, (runner, token_ids) in pending.items():
            # runners of other kinds (layer skipping) forward alone, and so does a block much wider than most
            # (a draft model catching up on a whole prompt), which would pad every other row to its width
            together = runner.batches and len(token_ids) <= shared_width
            groups.setdefault(id(runner.model) if together else ("alone", index), []).append(index)
        for indices in groups.values():
            runners = [pending[i][0] for i in indices]
            try:
                logits = batched_forward(runners, [(pending[i][1], None, 1) for i in indices])
            except Exception as error:
                for i in indices:
                    generators[i].close()
                    pending.pop(i)
                    results[i] = error
                continue
            for i, row in zip(indices, logits):
                advance(i, row[-1])
    return results

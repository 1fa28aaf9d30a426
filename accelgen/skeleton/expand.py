"""Skeleton-of-Thought's point-expanding stage: every point decoded at once, as one batch (Ning et al. 2023,
arXiv:2307.15337, section 3.1: "batch decoding" of the points for open-source models).

Each point is one `Sequence` of the generation loop (accelgen/loop.py), stepped together by `run_together`:
each step is one batched target forward over every point still decoding (models/batch.py), and each point
verifies and commits on its own KV cache, so that each point decodes as it would alone. Any method runs, and a
method that drafts with a model batches its drafts too.

The point prompts share a long prefix (the instructions, the question and the whole skeleton). Where the
runners are plain PyTorch ones, that prefix is fed once, in one forward, and every point's cache starts as a
copy of it; each point's first step then feeds only its own few tokens.
"""

from __future__ import annotations

import torch

from accelgen import cache as kv
from accelgen.loop import GenerationResult, Sequence, run_together, start_sequences
from accelgen.hf import generation_settings


def expand_points(model, tokenizer, prompts: list[list[int]], max_new_tokens: int,
                  **generation) -> list[GenerationResult]:
    """Decode every prompt (one per point) at once, up to max_new_tokens each; one GenerationResult per prompt.

    generation: accelgen.generate's other arguments (method, draft_model, temperature, stop, method options),
    the same for every point.
    """
    settings = generation_settings(model, None, {**generation, "max_new_tokens": max_new_tokens})
    sequences = start_sequences(model, tokenizer, prompts, settings)
    try:
        share_prefix(sequences)
    except BaseException:
        for sequence in sequences:
            sequence.finish()
        raise
    return run_together(sequences)


def shared_prefix_length(prompts: list[list[int]]) -> int:
    """How many leading tokens every prompt shares, leaving each at least one token of its own (the first step
    needs a root to read the next token's logits from).

    Example: [[5, 6, 7, 8], [5, 6, 9]]  ->  2
    """
    shortest = min(len(prompt) for prompt in prompts)
    length = 0
    while length < shortest - 1 and all(prompt[length] == prompts[0][length] for prompt in prompts):
        length += 1
    return length


def can_share_prefix(sequences: list[Sequence]) -> bool:
    """Whether every sequence's target is a fresh runner that declares it shares batched forwards (`batches`): a
    plain one, whose cache a copied prefix can start (runners of their own kind, early exit's, a layer plan's or
    llama.cpp's, declare they do not, and keep state a copied cache would not match)."""
    return all(sequence.target.batches and sequence.target.length == 0 for sequence in sequences)


@torch.inference_mode()
def share_prefix(sequences: list[Sequence]) -> int:
    """Feed the prompts' shared prefix once and start every sequence's KV cache with a copy of it, when
    `can_share_prefix`; returns the prefix length (0: nothing shared, each sequence feeds its whole prompt)."""
    if len(sequences) < 2 or not can_share_prefix(sequences):
        return 0
    length = shared_prefix_length([sequence.context.tolist() for sequence in sequences])
    if length == 0:
        return 0
    first = sequences[0].target
    first.forward(sequences[0].context[:length], logits_for_last=1)
    positions = torch.arange(length)
    for sequence in sequences[1:]:
        sequence.target.cache = kv.gather(first.cache, [positions] * len(first.cache.layers), first.config)
    return length

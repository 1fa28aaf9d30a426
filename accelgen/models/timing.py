"""Timing target forwards: the one measurement that the weight-format probe (models/probe.py), the cached costs
(accelgen/costs.py), `accelgen profile` (accelgen/profile.py) and the benchmark's cost line all take.

A timed forward runs k new tokens after a KV cache of a fixed prompt, for one or several sequences batched as
the server batches them, and keeps every row's logits as verification needs them. On a GPU the clock is read only
after the device has finished (hardware.synchronize): its kernels run asynchronously.
"""

from __future__ import annotations

import statistics
from typing import Callable

import torch

from accelgen.hardware import timed
from accelgen.models.batch import batched_forward
from accelgen.models.engines import runner_for


def timing_prompt(model, context_tokens: int) -> list[int]:
    """Token ids to time forwards after (their values do not change the cost)."""
    return [(7 * i) % model.config.vocab_size for i in range(1, context_tokens + 1)]


def forward_seconds(model, prompt_ids: list[int], new_tokens: int = 1, repeats: int = 5) -> float:
    """Median time of one forward over `new_tokens` tokens after a KV cache of prompt_ids (the first is warm-up)."""
    return batch_forward_seconds(model, prompt_ids, 1, [new_tokens], repeats)[new_tokens]


def batch_forward_seconds(model, prompt_ids: list[int], batch: int, sizes, repeats: int = 5,
                          progress: Callable[[int], None] = lambda k: None,
                          make_runner: Callable = runner_for) -> dict[int, float]:
    """Per k in sizes: median time of one forward of `batch` sequences, k tokens each after a KV cache of
    prompt_ids, with every row's logits as verification needs them (the first of repeats + 1 is warm-up: a CUDA
    graph is captured there). progress(k) is called before each size; make_runner(model) gives each sequence's
    runner (default: the one decoding would use)."""
    runners = [make_runner(model) for _ in range(batch)]
    for runner in runners:
        runner.forward(torch.tensor(prompt_ids), logits_for_last=1)
    prefix = runners[0].length
    seconds = {}
    for k in sizes:
        progress(k)
        block = torch.tensor((prompt_ids * k)[:k])  # token values do not change the cost
        times = []
        for _ in range(repeats + 1):
            times.append(timed(model.device, lambda: batched_forward(runners, [(block, None, k)] * batch))[1])
            for runner in runners:
                runner.keep(prefix, [])  # forget the block again
        seconds[k] = statistics.median(times[1:])
    return seconds

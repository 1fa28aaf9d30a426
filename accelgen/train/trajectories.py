"""Jacobi trajectories for consistency training (CLLM, Kou et al. 2024, arXiv:2403.00835), collected with the model
itself.

A trajectory is one block of n tokens after a context, iterated from a random start to its fixed point:

    states[0]    n tokens drawn at random from the context (the paper's start)
    states[k+1]  y_i <- argmax p(y_i | context, states[k]_<i) for every i at once: one Jacobi iteration
    states[-1]   the fixed point y*: the greedy continuation of the context, reached in at most n iterations

A prompt gives several consecutive blocks: the next block's context is the prompt plus the fixed points before it,
as greedy decoding would have produced them. Collection stops at a fixed point that holds EOS.

Many contexts are iterated together: each has its own KV cache (a ModelRunner) holding the context but its last
token, and each iteration is one padded batched forward (models/batch.py) over every unfinished block, after which
each cache is cropped back. A converged block's forward is kept in its cache: it is exactly the next block's
context. Trajectories are cached in shards of `prompts_per_shard` prompts, each written atomically and skipped when
a rerun finds it, so a killed collection resumes; a shard records the model and settings it was collected with.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from accelgen.atomic import load_torch, torch_save_atomically
from accelgen.errors import InputError
from accelgen.models.batch import batched_forward
from accelgen.models.runner import ModelRunner

SHARD_PATTERN = "shard-{:05d}.pt"
TRAJECTORIES_FOLDER = "trajectories"
PROMPT_SOURCES = ("humaneval", "sharegpt", "jsonl:FILE")


@dataclass(frozen=True)
class Trajectory:
    prompt: int  # index of its prompt among those collected
    context: torch.Tensor  # (L,) long: the prompt and the fixed points of the blocks before this one
    states: torch.Tensor  # (k+1, n) long: the random start, each Jacobi iterate, the fixed point last

    @property
    def fixed_point(self) -> torch.Tensor:
        return self.states[-1]

    @property
    def iterations(self) -> int:
        """Jacobi iterations (forwards) that produced the fixed point from the start."""
        return len(self.states) - 1


@dataclass(frozen=True)
class CollectionSettings:
    block_size: int = 16
    blocks_per_prompt: int = 4
    prompts_per_shard: int = 16
    seed: int = 0

    def __post_init__(self):
        if min(self.block_size, self.blocks_per_prompt, self.prompts_per_shard) < 1:
            raise InputError("block size, blocks per prompt and prompts per shard must be positive")


def random_start(context: list[int], size: int, generator: torch.Generator) -> torch.Tensor:
    """(size,) tokens drawn uniformly from the context, the paper's starting guess."""
    picks = torch.randint(0, len(context), (size,), generator=generator)
    return torch.tensor(context, dtype=torch.long)[picks]


def jacobi_iterate(runners: list[ModelRunner], last_tokens: list[int], states: list[torch.Tensor]) -> list[torch.Tensor]:
    """One Jacobi iteration for every block at once: each runner caches its context but the last token.

    last_tokens: each context's last token; states: (n,) long each. Returns the next states. The caches are left
    extended by [last token, state[:-1]]; the caller crops them back or keeps them (a converged block).
    """
    blocks = [(torch.cat([torch.tensor([last]), state[:-1]]), None, len(state)) for last, state in zip(last_tokens, states)]
    logits = batched_forward(runners, blocks)
    return [rows.argmax(dim=-1).cpu() for rows in logits]


@torch.inference_mode()
def collect_trajectories(model, prompts: list[list[int]], settings: CollectionSettings, eos_ids: set[int],
                         generator: torch.Generator, starts: Iterable[torch.Tensor] | None = None,
                         max_iterations: int | None = None) -> list[Trajectory]:
    """The Jacobi trajectories of up to blocks_per_prompt consecutive blocks after each prompt, iterated together.

    starts: the random starting states, in the order blocks are begun (for re-iterating known blocks); default:
    drawn with the generator. A block that does not settle within max_iterations (default 2n: argmax ties that
    flip between batched forwards) is left out, with the rest of its prompt.
    """
    size = settings.block_size
    limit = max_iterations or 2 * size
    supplied = None if starts is None else iter(starts)
    next_start = lambda context: random_start(context, size, generator) if supplied is None else next(supplied)
    jobs = []
    for prompt in prompts:
        if len(prompt) < 1:
            raise InputError("a prompt needs at least one token")
        runner = ModelRunner(model)
        if len(prompt) > 1:
            runner.forward(torch.tensor(prompt[:-1]), logits_for_last=1)
        jobs.append({"prompt": len(jobs), "runner": runner, "context": list(prompt), "states": [next_start(prompt)],
                     "blocks": 0})
    done: list[Trajectory] = []
    while jobs:
        lengths = [job["runner"].length for job in jobs]
        iterates = jacobi_iterate([job["runner"] for job in jobs], [job["context"][-1] for job in jobs],
                                  [job["states"][-1] for job in jobs])
        still = []
        for job, length, iterate in zip(jobs, lengths, iterates):
            if torch.equal(iterate, job["states"][-1]):  # converged: the cache now holds the block, keep it
                done.append(Trajectory(job["prompt"], torch.tensor(job["context"]), torch.stack(job["states"])))
                job["context"] += iterate.tolist()
                job["blocks"] += 1
                if job["blocks"] == settings.blocks_per_prompt or eos_ids & set(iterate.tolist()):
                    continue
                job["states"] = [next_start(job["context"])]
                still.append(job)
                continue
            job["runner"].keep(length, [])
            job["states"].append(iterate)
            if len(job["states"]) <= limit + 1:
                still.append(job)
        jobs = still
    return done


def settings_identity(model, settings: CollectionSettings, prompts: list[list[int]]) -> dict:
    """What a shard must match to be reused: the model, the settings and the shard's prompts."""
    from accelgen.drafters.distillspec import model_fingerprint

    digest = hashlib.sha256(json.dumps(prompts).encode()).hexdigest()[:16]
    return {"model_fingerprint": model_fingerprint(model), "vocab_size": model.config.vocab_size,
            "settings": asdict(settings), "prompts": digest}


def load_shard(path: Path, identity: dict) -> list[Trajectory] | None:
    """The shard's trajectories, if it exists; a ValueError if it was collected by another model or otherwise."""
    if not path.exists():
        return None
    saved = load_torch(path, "delete it and rerun to collect it again")
    if saved["identity"]["model_fingerprint"] != identity["model_fingerprint"]:
        raise InputError(f"{path} holds Jacobi trajectories collected by another model (fingerprint "
                         f"{saved['identity']['model_fingerprint']}, this model's {identity['model_fingerprint']}); "
                         "use another --out")
    if saved["identity"] != identity:
        raise InputError(f"{path} holds Jacobi trajectories collected with other settings or prompts; use another --out")
    return [Trajectory(prompt, context, states) for prompt, context, states in saved["trajectories"]]


def cached_trajectories(model, prompts: list[list[int]], settings: CollectionSettings, eos_ids: set[int], folder: Path,
                        progress: Callable[[int], None] | None = None) -> list[Trajectory]:
    """Every prompt's trajectories, collected shard by shard into folder/trajectories/ (a rerun reuses the shards
    already there). progress(prompts done) after each shard."""
    trajectories: list[Trajectory] = []
    step = settings.prompts_per_shard
    for index, first in enumerate(range(0, len(prompts), step)):
        shard_prompts = prompts[first : first + step]
        path = Path(folder) / TRAJECTORIES_FOLDER / SHARD_PATTERN.format(index)
        identity = settings_identity(model, settings, shard_prompts)
        shard = load_shard(path, identity)
        if shard is None:
            generator = torch.Generator().manual_seed(settings.seed * 100_003 + index)  # each shard its own draws
            shard = [replace(t, prompt=first + t.prompt)
                     for t in collect_trajectories(model, shard_prompts, settings, eos_ids, generator)]
            torch_save_atomically(path, {"identity": identity,
                                         "trajectories": [(t.prompt, t.context, t.states) for t in shard]})
        trajectories += shard
        if progress is not None:
            progress(first + len(shard_prompts))
    return trajectories


def training_prompts(tokenizer, sources: list[str], count: int, skip_humaneval: int) -> list[list[int]]:
    """count prompt token lists taken in turn from the sources (humaneval, sharegpt, jsonl:FILE as the benchmark
    reads it), none of them a benchmark prompt of the first two: HumanEval tasks from skip_humaneval on, and ShareGPT conversations the `sharegpt` benchmark
    does not sample."""
    from accelgen.datasets import load_dataset, load_humaneval, prompt_token_ids, unsampled_sharegpt_prompts

    pools = []
    for source in sources:
        if source == "humaneval":
            pools.append(iter(load_humaneval()[skip_humaneval:]))
        elif source == "sharegpt":
            pools.append(unsampled_sharegpt_prompts())
        elif source.startswith("jsonl:"):  # the benchmark's format: {"prompt": text} or {"turns": [...]} per line
            pools.append(iter(load_dataset(source)))
        else:
            raise InputError(f"unknown prompt source {source!r}; use {', '.join(PROMPT_SOURCES)}")
    prompts: list[list[int]] = []
    while pools and len(prompts) < count:
        for pool in list(pools):
            prompt = next(pool, None)
            if prompt is None:
                pools.remove(pool)
            elif len(prompts) < count:
                prompts.append(prompt_token_ids(tokenizer, prompt))
    if len(prompts) < count:
        raise InputError(f"the prompt sources gave {len(prompts)} prompts, fewer than the {count} asked for")
    return prompts

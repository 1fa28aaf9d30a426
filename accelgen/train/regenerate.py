"""Data made by the target: a dataset's prompts answered by the target itself, to train drafters on.

A drafter learns to predict the target; trained on human-written answers (ShareGPT's), it learns text the target
would not have written. `regenerate` answers each prompt with the target (accelgen's own generation, several
prompts per batched forward: accelgen.loop.run_together), greedily or sampled at a temperature, and keeps the
answers in a folder:

    manifest.json           the settings (model, format, dataset, temperature, ...) and the shards done
    answers-00000.jsonl     one record per prompt: {"id", "category", "prompt", "prompt_token_ids",
    answers-00001.jsonl      "answer_token_ids", "answer", "finish_reason", "text"} ("text": prompt and answer
    ...                      as the model saw them, chat template included: what a trainer packs into windows)

Prompts are answered in shards of `shard_prompts`, each written atomically and then listed in the manifest
(also atomically), so a stopped run resumes at the first shard the manifest lacks, on any machine; a resumed run
with other settings, or over other prompts, is refused by name. Each prompt is sampled with a seed of its own
(from --seed and its id), so its answer does not depend on where a run was resumed; at temperature 0 the
answers are the target's greedy ones, the same on every run with the same settings.

Trainers read such a folder as the dataset `regenerated:DIR` (accelgen/datasets/regenerated.py).
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from accelgen.atomic import write_atomically, write_json_atomically
from accelgen.datasets import PROMPT_FORMATS, Prompt, prompt_token_ids
from accelgen.datasets.regenerated import FORMAT, MANIFEST, VERSION, read_manifest, read_records
from accelgen.errors import InputError



@dataclass(frozen=True)
class RegenerateSettings:
    """What the answers depend on: a resumed run must have the same."""

    model: str
    dataset: str
    weights: str  # the format the target ran in (bf16 and fp32 greedy answers can part ways)
    temperature: float = 0.0
    top_p: float = 1.0
    max_new_tokens: int = 256
    seed: int = 0
    prompt_format: str = "auto"
    shard_prompts: int = 16
    # prompts per batched forward: in bf16, padding a prompt into another batch moves the rounding, and a greedy
    # answer can part at a near-tie (in fp32 every batch gives each prompt's answer alone)
    batch_size: int = 8

    def __post_init__(self):
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise InputError(f"temperature must be >= 0 and top_p in (0, 1]; got {self.temperature}, {self.top_p}")
        if min(self.max_new_tokens, self.shard_prompts, self.batch_size) < 1:
            raise InputError("max_new_tokens, shard_prompts and batch_size must be >= 1")
        if self.prompt_format not in PROMPT_FORMATS:
            raise InputError(f"unknown prompt format {self.prompt_format!r}; choose one of {PROMPT_FORMATS}")


def shard_name(index: int) -> str:
    return f"answers-{index:05d}.jsonl"


def prompt_seed(seed: int, prompt_id: str) -> int:
    """A seed of the prompt's own: its samples do not depend on the batch it runs in."""
    return int.from_bytes(hashlib.sha1(f"{seed}:{prompt_id}".encode()).digest()[:6], "big")


def ids_digest(prompts: list[Prompt]) -> str:
    return hashlib.sha1("\n".join(prompt.id for prompt in prompts).encode()).hexdigest()[:16]


# --- the manifest --------------------------------------------------------------------------------------------


def opened_manifest(folder, settings: RegenerateSettings) -> dict:
    """The folder's manifest (refused where its settings are not these), or a new one."""
    manifest = read_manifest(folder)
    wanted = asdict(settings)
    if manifest is None:
        return {"format": FORMAT, "version": VERSION, "settings": wanted, "shards": []}
    differing = [f"{key}: {manifest['settings'].get(key)!r} there vs {value!r} now"
                 for key, value in wanted.items() if manifest["settings"].get(key) != value]
    if differing:
        raise InputError(f"{folder} holds answers made with other settings ({'; '.join(differing)}); resume with "
                         "its settings, or choose another --out")
    return manifest


def check_done_shards(folder, manifest: dict, chunks: list[list[Prompt]]) -> None:
    """Refuse to resume over prompts other than those the done shards answered (as far as both go)."""
    for entry, chunk in zip(manifest["shards"], chunks):
        if entry["prompts"] <= len(chunk):
            same = entry["ids_sha1"] == ids_digest(chunk[: entry["prompts"]])
        else:  # fewer prompts now than the shard answered
            same = [record["id"] for record in read_records(Path(folder) / entry["file"])][: len(chunk)] == \
                [prompt.id for prompt in chunk]
        if not same:
            raise InputError(f"{folder}: the prompts of {entry['file']} are not this run's (another dataset or "
                             "file); choose another --out")


# --- answering -------------------------------------------------------------------------------------------------


def answer_batch(model, tokenizer, prompts: list[Prompt], token_ids: list[list[int]],
                 settings: RegenerateSettings) -> list[dict]:
    """The target's answers to prompts (token_ids: each prompt as the model sees it), in one batched run."""
    from accelgen.loop import Sequence, run_together

    sequences = []
    try:
        for prompt, ids in zip(prompts, token_ids):
            sequences.append(Sequence.start(model, tokenizer, ids, max_new_tokens=settings.max_new_tokens,
                                            temperature=settings.temperature, top_p=settings.top_p,
                                            seed=prompt_seed(settings.seed, prompt.id)))
    except BaseException:
        for sequence in sequences:
            sequence.finish()
        raise
    results = run_together(sequences)
    return [{"id": prompt.id, "category": prompt.category, "prompt": prompt.text, "prompt_token_ids": ids,
             "answer_token_ids": result.token_ids, "answer": result.text, "finish_reason": result.finish_reason,
             "text": tokenizer.decode(ids + result.token_ids)}
            for prompt, ids, result in zip(prompts, token_ids, results)]


def answer_shard(model, tokenizer, prompts: list[Prompt], settings: RegenerateSettings,
                 answered: Callable[[list[dict]], None] | None = None) -> list[dict]:
    """Answers to prompts in their order, run in batches of prompts of similar lengths (less padding);
    answered(records) after each batch."""
    token_ids = [prompt_token_ids(tokenizer, prompt, settings.prompt_format) for prompt in prompts]
    order = sorted(range(len(prompts)), key=lambda index: len(token_ids[index]))
    records: dict[int, dict] = {}
    for start in range(0, len(order), settings.batch_size):
        batch = order[start:start + settings.batch_size]
        done = answer_batch(model, tokenizer, [prompts[i] for i in batch], [token_ids[i] for i in batch], settings)
        records.update(zip(batch, done))
        if answered is not None:
            answered(done)
    return [records[index] for index in range(len(prompts))]


def write_records(path: Path, records: list[dict]) -> None:
    text = "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records)
    write_atomically(path, lambda partial: partial.write_text(text, encoding="utf-8"))


def regenerate(model, tokenizer, prompts: list[Prompt], out, settings: RegenerateSettings,
               progress: Callable[[dict], None] | None = None) -> dict:
    """Answer prompts with the target into the folder out, resuming from the shards already there.

    progress(row) after every batch: {"prompts_done", "prompts", "new_tokens", "seconds", "tokens_per_second"}
    (counting only this run's work). Returns the last row with "resumed_at" (prompts already answered)."""
    out = Path(out)
    manifest = opened_manifest(out, settings)
    chunks = [prompts[start:start + settings.shard_prompts] for start in range(0, len(prompts), settings.shard_prompts)]
    check_done_shards(out, manifest, chunks)
    shards = manifest["shards"]
    if shards and len(shards) <= len(chunks) and shards[-1]["prompts"] < len(chunks[len(shards) - 1]):
        shards.pop()  # a short last shard and more prompts now: unlisted, then answered again whole
        write_json_atomically(out / MANIFEST, manifest)
    resumed_at = min(sum(entry["prompts"] for entry in shards), len(prompts))
    row = {"prompts_done": resumed_at, "prompts": len(prompts), "new_tokens": 0, "seconds": 0.0,
           "tokens_per_second": 0.0, "resumed_at": resumed_at}
    started = time.perf_counter()

    def answered(records: list[dict]) -> None:
        row["prompts_done"] += len(records)
        row["new_tokens"] += sum(len(record["answer_token_ids"]) for record in records)
        row["seconds"] = time.perf_counter() - started
        row["tokens_per_second"] = row["new_tokens"] / row["seconds"] if row["seconds"] > 0 else 0.0
        if progress is not None:
            progress(dict(row))

    if progress is not None:
        progress(dict(row))
    for number in range(len(shards), len(chunks)):
        records = answer_shard(model, tokenizer, chunks[number], settings, answered)
        write_records(out / shard_name(number), records)
        shards.append({"file": shard_name(number), "prompts": len(records), "ids_sha1": ids_digest(chunks[number]),
                       "new_tokens": sum(len(record["answer_token_ids"]) for record in records)})
        write_json_atomically(out / MANIFEST, manifest)  # only now is the shard part of the data
    return row

"""`accelgen data regenerate`: a dataset's prompts answered by the target itself, in resumable shards
(accelgen/train/regenerate.py); trainers read the folder as `--dataset regenerated:DIR`."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from accelgen.cli.common import DEVICE_OPTION, FILE_ERRORS, INPUT_ERRORS, MODEL_HELP, WEIGHTS_OPTION, console, \
    reported_errors, set_threads
from accelgen.cli.flags import App
from accelgen.errors import InputError

data_app = App(no_args_is_help=True, help="Training data made by the target.")


@data_app.command("regenerate")
def regenerate(
    model: str = typer.Option("smollm2-135m", "--model", "-m", help=MODEL_HELP),
    dataset: str = typer.Option("sharegpt", "--dataset", help="Prompts: sharegpt-train (ShareGPT "
                                   "conversations the sharegpt benchmark never draws from: train on these), sharegpt, "
                                   "humaneval, specbench or jsonl:FILE."),
    out: Path = typer.Option(..., "--out", help="Folder for the answers (a run there is resumed)."),
    temperature: float = typer.Option(0.0, min=0.0, help="0 = greedy."),
    top_p: float = typer.Option(1.0, "--top-p", help="Sample among the likeliest tokens holding this much "
                                                     "probability (1: all)."),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", "-n", min=1, help="Longest answer, in tokens."),
    batch_size: int = typer.Option(8, "--batch-size", min=1, help="Prompts per batched forward (a setting of the "
                                   "data: in bf16, batching moves greedy answers at near-ties)."),
    limit: Optional[int] = typer.Option(None, min=1, help="Answer only the first LIMIT prompts."),
    seed: int = typer.Option(0, help="Sampling seed (each prompt samples with a seed of its own drawn from it)."),
    prompt_format: str = typer.Option("auto", "--prompt-format",
                                      help="auto (chat prompts through the chat template), chat or raw."),
    shard_prompts: int = typer.Option(16, "--shard-prompts", min=1,
                                      help="Prompts per shard: a stopped run loses at most one shard's work."),
    weights: Optional[str] = WEIGHTS_OPTION,
    device: Optional[str] = DEVICE_OPTION,
    threads: Optional[int] = typer.Option(None, min=1, help="torch CPU threads (default: torch's)."),
):
    """Answer a dataset's prompts with the target (batched), into resumable shards; then train on them with
    `accelgen train ... --dataset regenerated:OUT`."""
    from accelgen.cli.train.common import progress_bar
    from accelgen.costs import model_format
    from accelgen.datasets import load_dataset
    from accelgen.models import load_model
    from accelgen.train.regenerate import RegenerateSettings, opened_manifest
    from accelgen.train.regenerate import regenerate as regenerate_answers

    set_threads(threads)
    with reported_errors(INPUT_ERRORS):
        prompts = load_dataset(dataset, limit)
        if not prompts:
            raise InputError(f"dataset {dataset!r} gave no prompts")
        # the settings this folder needs, checked before the model loads where the format is given
        check = dict(model=model, dataset=dataset, temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens,
                     seed=seed, prompt_format=prompt_format, shard_prompts=shard_prompts, batch_size=batch_size)
        if weights not in (None, "auto"):
            opened_manifest(out, RegenerateSettings(weights=weights, **check))
        with console.status(f"loading {model}{f' ({weights})' if weights else ''} …"):
            target_model, tokenizer = load_model(model, weights=weights, threads=threads, device=device)
        settings = RegenerateSettings(weights=model_format(target_model), **check)
    with reported_errors(FILE_ERRORS), progress_bar(len(prompts), "answering prompts") as show:
        summary = regenerate_answers(target_model, tokenizer, prompts, out, settings,
                                     progress=lambda row: show({**row, "step": row["prompts_done"]},
                                                               "{new_tokens} tokens, {tokens_per_second:.1f} tokens/s"))
    resumed = f" ({summary['resumed_at']} answered before)" if summary["resumed_at"] else ""
    console.print(f"answered {summary['prompts_done']} of {len(prompts)} prompts{resumed}: {summary['new_tokens']} "
                  f"new tokens in {summary['seconds']:.1f}s, {summary['tokens_per_second']:.1f} tokens/s "
                  f"(batches of {batch_size}, {settings.weights}) → {out}; train on them with "
                  f"--dataset regenerated:{out}")

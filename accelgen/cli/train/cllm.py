"""`accelgen train cllm`: consistency fine-tuning on the model's own Jacobi trajectories (accelgen/train/cllm.py)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from accelgen.cli.common import FILE_ERRORS, console, reported_errors, set_threads
from accelgen.cli.flags import Flags, command, flag
from accelgen.cli.train.common import check_device_flag, device_flag, model_flag, out_flag, progress_bar, threads_flag
from accelgen.train.cllm import CllmConfig
from accelgen.train.loop import ScaleOut, is_main_process, main_process_first


@dataclass
class CllmRun:
    model: str = model_flag()
    out: Path = out_flag("Folder for the trajectories, checkpoints and the tuned model (a run there is resumed).")
    sources: str = flag("humaneval,sharegpt", "Comma-separated prompt sources: humaneval, sharegpt, jsonl:FILE "
                        "(as `accelgen bench` reads it); HumanEval's first --skip-humaneval tasks and the sharegpt "
                        "benchmark's prompts are left out.")
    prompts: int = flag(96, "Prompts whose Jacobi trajectories are collected (held-out ones included).", min=2)
    held_out: int = flag(8, "Prompts whose trajectories are kept out of training, to evaluate on.", min=1)
    skip_humaneval: int = flag(40, "HumanEval tasks left out from the first (for benchmarks and pass@1).", min=0)
    block_size: int = flag(16, "Tokens per Jacobi block (n).", min=1)
    blocks_per_prompt: int = flag(4, "Consecutive blocks collected after each prompt.", min=1)
    prompts_per_shard: int = flag(16, "Prompts iterated together and cached per shard.", min=1)
    threads: int | None = threads_flag()
    device: str | None = device_flag("Where the model collects its Jacobi trajectories and is evaluated: cpu, cuda, "
                                     "cuda:N or auto (default: cpu); it trains where accelerate puts it.")

    def __post_init__(self):
        check_device_flag(self.device)


def cllm(run: CllmRun, config: CllmConfig, scale: ScaleOut) -> None:
    """CLLM: collect the model's Jacobi trajectories, fine-tune it with the consistency + AR losses, and measure
    on held-out blocks the consistency loss, the agreement with the original and the tokens per Jacobi iteration."""
    from accelgen.models import load_model
    from accelgen.prompts import eos_token_ids
    from accelgen.train.cllm import (
        base_identity,
        check_base,
        config_record,
        evaluate_cllm,
        record_run,
        train_cllm,
    )
    from accelgen.train.trajectories import (
        CollectionSettings,
        cached_trajectories,
        training_prompts,
    )

    if run.held_out >= run.prompts:
        raise_usage(f"--held-out {run.held_out} leaves no prompt to train on out of --prompts {run.prompts}")
    collection = CollectionSettings(run.block_size, run.blocks_per_prompt, run.prompts_per_shard, config.seed)
    with reported_errors(FILE_ERRORS):
        set_threads(run.threads)
        with console.status(f"loading {run.model} …"):
            model, tokenizer = load_model(run.model, dtype="float32", device=run.device)
        identity = base_identity(model, run.model)
        check_base(run.out, identity)
        main = is_main_process()  # the first process writes the run's files and evaluates
        if main:
            record_run(run.out, identity, config_record(config, collection))  # claims the folder for this base model
        eos_ids = eos_token_ids(model, tokenizer)
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos_ids, default=0)
        with console.status("tokenizing prompts …"):
            prompts = training_prompts(tokenizer, [s.strip() for s in run.sources.split(",") if s.strip()],
                                       run.prompts, run.skip_humaneval)
        started = time.perf_counter()
        # the first process collects the trajectories' shards, the others read them back
        with main_process_first(), progress_bar(len(prompts), "Jacobi trajectories (prompts)") as show:
            trajectories = cached_trajectories(model, prompts, collection, eos_ids, run.out,
                                               progress=lambda done: show({"step": done}, ""))
        collection_seconds = time.perf_counter() - started
        held = [t for t in trajectories if t.prompt < run.held_out]  # whole prompts held out
        training = [t for t in trajectories if t.prompt >= run.held_out]
        if main:
            with console.status(f"held-out evaluation before training ({len(held)} blocks) …"):
                before = evaluate_cllm(model, held, config.context_len, pad_id, eos_ids, seed=config.seed)
        with progress_bar(config.steps) as show:
            result = train_cllm(model, tokenizer, training, config, run.out, eos_ids, scale=scale,
                                progress=lambda row: show(row, "consistency {consistency:.3f}, AR {ar:.3f}, "
                                                               "{tokens_per_second:.0f} positions/s"))
        if not main:
            return
        with console.status("held-out evaluation after training …"):
            after = evaluate_cllm(model, held, config.context_len, pad_id, eos_ids, seed=config.seed)
        record_run(run.out, identity, {
            **config_record(config, collection), "sources": run.sources, "prompts": run.prompts,
            "held_out_prompts": run.held_out, "skip_humaneval": run.skip_humaneval,
            "training_blocks": len(training), "collection_seconds": collection_seconds,
            "training_seconds": result["seconds"], "resumed_at": result["resumed_at"],
            "held_out_before": before, "held_out_after": after})
    show_evaluation(before, after)
    console.print(f"trained {result['stopped_at'] - result['resumed_at']} steps in {result['seconds']:.0f}s on "
                  f"{len(training)} blocks → {run.out}; decode it with `accelgen generate --model {run.out} "
                  f"--method jacobi` (or lookahead-decoding); held-out figures: {run.out}/cllm.json")


def raise_usage(message: str) -> None:
    import typer

    console.print(f"[red]error:[/red] {message}")
    raise typer.Exit(2)


def show_evaluation(before: dict, after: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table("held out", "before", "after")
    table.add_row("consistency loss (KL)", f"{before['consistency']:.3f}", f"{after['consistency']:.3f}")
    table.add_row("AR loss", f"{before['ar_loss']:.3f}", f"{after['ar_loss']:.3f}")
    table.add_row("agreement with the original's greedy tokens", f"{before['agreement']:.1%}", f"{after['agreement']:.1%}")
    table.add_row("tokens per Jacobi iteration", f"{before['tokens_per_iteration']:.2f}",
                  f"{after['tokens_per_iteration']:.2f}")
    Console().print(table)


cllm_command = command(cllm, Flags(CllmRun), Flags(CllmConfig), Flags(ScaleOut))

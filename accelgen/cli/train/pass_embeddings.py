"""`accelgen train pass`: PaSS look-ahead embeddings, so that the frozen target drafts for itself
(accelgen/train/pass_embeddings.py)."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

from accelgen.atomic import write_json_atomically
from accelgen.cli.common import FILE_ERRORS, console, reported_errors
from accelgen.cli.flags import Flags, command, flag
from accelgen.cli.train.common import FrozenTargetRun, model_and_windows, out_flag, progress_bar
from accelgen.train.loop import ScaleOut, is_main_process
from accelgen.train.pass_embeddings import PassConfig


@dataclass
class PassRun(FrozenTargetRun):
    out: Path = out_flag("Folder for the embeddings (then: --method pass --head OUT).")
    windows: int = flag(128, "Windows of --seq-len tokens to train on.")


def pass_embeddings(run: PassRun, config: PassConfig, scale: ScaleOut) -> None:
    """PaSS look-ahead embeddings: the frozen target drafts k tokens for itself; per-slot top-1 held out."""
    from accelgen.train.pass_embeddings import evaluate_pass, train_pass

    held_out, out = run.held_out, run.out
    with reported_errors(FILE_ERRORS):
        target_model, _, data = model_and_windows(run.model, run.dtype, run.dataset, run.seq_len, run.windows,
                                                  held_out, run.threads, run.weights)
        started = time.perf_counter()
        with progress_bar(config.steps) as show:
            embeddings = train_pass(target_model, data[held_out:], config,
                                    progress=lambda row: show(row, "loss {loss:.3f}, {tokens_per_second:.0f} slots/s"),
                                    scale=scale)
        seconds = time.perf_counter() - started
        if not is_main_process():
            return  # the first process saves and evaluates
        embeddings.base_model = run.model
        embeddings.save(out)
        evaluation = evaluate_pass(target_model, embeddings, data[:held_out], cuts=config.cuts)
    write_json_atomically(Path(out) / "evaluation.json", {
        "held_out_windows": held_out, "config": asdict(config), "training_seconds": seconds, **evaluation})
    top1 = ", ".join(f"{accuracy:.0%}" for accuracy in evaluation["top1"])
    console.print(f"held out: slot top-1 {top1}; {evaluation['mean_slots_in_a_row']:.2f} slots right in a row "
                  f"on average (trained {config.steps} steps in {seconds:.0f}s)")
    console.print(f"look-ahead embeddings → {out}; use: --method pass --head {out}")


pass_command = command(pass_embeddings, Flags(PassRun), Flags(PassConfig), Flags(ScaleOut))

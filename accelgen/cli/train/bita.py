"""`accelgen train bita`: BiTA's soft prompt and mask tokens, so that the frozen target drafts inside its verifying
forward (accelgen/train/mask_tokens.py). `train_mask_tokens_run` is shared with `accelgen train space`."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from accelgen.atomic import write_json_atomically
from accelgen.cli.common import FILE_ERRORS, console, reported_errors
from accelgen.cli.flags import Flags, command, flag
from accelgen.cli.train.common import (
    FrozenTargetRun,
    model_and_windows,
    out_flag,
    progress_bar,
)
from accelgen.train.bita import BitaConfig
from accelgen.train.loop import ScaleOut, is_main_process


@dataclass
class MaskTokensRun(FrozenTargetRun):
    out: Path = out_flag("Folder for the mask tokens and checkpoints (resumed); then: --method M --head OUT.")
    windows: int = flag(128, "Windows of --seq-len tokens to train on.")


def train_mask_tokens_run(run: MaskTokensRun, config, method: str, new_tokens: Callable, scale: ScaleOut) -> None:
    """Train new_tokens(model, config)'s mask tokens on the run's windows (as scale says), save them to --out with
    the held-out evaluation (evaluation.json), and say how to use them."""
    from accelgen.train.mask_tokens import evaluate_mask_tokens, train_mask_tokens

    held_out, out = run.held_out, run.out
    with reported_errors(FILE_ERRORS):
        target_model, _, data = model_and_windows(run.model, run.dtype, run.dataset, run.seq_len, run.windows,
                                                  held_out, run.threads, run.weights)
        tokens = new_tokens(target_model, config)
        tokens.base_model = run.model
        Path(out).mkdir(parents=True, exist_ok=True)
        status = "loss {loss:.3f}, mask 1 top-1 {accuracy[0]:.0%}, {tokens_per_second:.0f} masks/s"
        with progress_bar(config.steps) as show:
            tokens, times = train_mask_tokens(target_model, tokens, data[held_out:], config, out_dir=out,
                                              progress=lambda row: show(row, status), scale=scale)
        if not is_main_process():
            return  # the first process saves and evaluates
        tokens.save(out)
        started = time.perf_counter()
        evaluation = evaluate_mask_tokens(target_model, tokens, data[:held_out], cuts=config.cuts)
    write_json_atomically(Path(out) / "evaluation.json", {
        "method": method, "held_out_windows": held_out, "config": asdict(config),
        "training_seconds": times["seconds"], "resumed_at": times["resumed_at"], "processes": times["processes"],
        "evaluation_seconds": time.perf_counter() - started, **evaluation})
    top1 = ", ".join(f"{accuracy:.0%}" for accuracy in evaluation["top1_per_depth"])
    console.print(f"held out: mask top-1 by depth {top1}; {evaluation['mean_masks_in_a_row']:.2f} masks right in a "
                  f"row on average (trained {times['stopped_at'] - times['resumed_at']} steps in {times['seconds']:.0f}s)")
    console.print(f"{method} mask tokens → {out}; use: --method {method} --head {out}")


def bita(run: MaskTokensRun, config: BitaConfig, scale: ScaleOut) -> None:
    """BiTA prompt and mask tokens: the frozen target drafts k tokens in its verifying forward; top-1 held out."""
    from accelgen.train.bita import new_bita_tokens

    train_mask_tokens_run(run, config, "bita", new_bita_tokens, scale)


bita_command = command(bita, Flags(MaskTokensRun), Flags(BitaConfig), Flags(ScaleOut))

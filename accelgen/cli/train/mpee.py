"""`accelgen train mpee`: MPEE's exit heads by weighted self-distillation on a frozen model (accelgen/train/mpee.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from accelgen.cli.common import FILE_ERRORS, console, reported_errors, table_console
from accelgen.cli.flags import Flags, command, flag
from accelgen.cli.train.common import WindowsRun, hidden_states_for, out_flag, progress_bar, save_evaluation
from accelgen.train.loop import ScaleOut, is_main_process


@dataclass
class MpeeRun(WindowsRun):
    out: Path = out_flag("Folder for the heads and checkpoints (resumed); then: --method mpee -o heads=OUT.")
    layers: Optional[str] = flag(None, "Comma-separated exit layers (default: calm's).")
    steps: int = flag(200)
    batch_size: int = flag(128, "Positions per step.")
    rank: int = flag(64, "Width of each exit's features.")
    learning_rate: float = flag(1e-3)
    checkpoint_every: int = flag(50, "Steps between checkpoints.")


def mpee(run: MpeeRun, scale: ScaleOut) -> None:
    """MPEE's exit classifiers, each reading the exits' below, trained by weighted self-distillation."""
    from rich.table import Table

    from accelgen.train.mpee import MpeeConfig, evaluate_mpee, train_mpee

    config = MpeeConfig(rank=run.rank, steps=run.steps, batch_size=run.batch_size, learning_rate=run.learning_rate,
                        checkpoint_every=run.checkpoint_every)
    with reported_errors(FILE_ERRORS):
        target_model, chosen, hidden, unseen = hidden_states_for(run.model, run.dataset, run.layers, run.windows,
                                                                 run.held_out, run.seq_len, run.threads)
        with progress_bar(config.steps) as show:
            heads, times = train_mpee(target_model, hidden, chosen, config, out_dir=run.out,
                                      progress=lambda row: show(row, "loss {loss:.3f}"), scale=scale)
        if not is_main_process():
            return  # the first process evaluates and saves
        heads.base_model = run.model
        heads.save(run.out)
        evaluation = evaluate_mpee(target_model, heads, unseen)
    table = Table("exit layer", "plain exit agrees with last", "trained exit agrees", "classifier right")
    for row in evaluation["exits"]:
        table.add_row(str(row["layer"]), f"{row['plain_agreement']:.1%}", f"{row['trained_agreement']:.1%}",
                      f"{row['classifier_accuracy']:.1%}")
    table_console().print(table)
    table = Table("threshold", "mean layers", "agrees with last")
    for row in evaluation["thresholds"]:
        table.add_row(f"{row['threshold']:g}", f"{row['mean_layers']:.1f}", f"{row['agreement']:.1%}")
    table_console().print(table)
    save_evaluation(run, config, times, evaluation)
    console.print(f"MPEE heads for exits {chosen} → {run.out} (trained in {times['seconds']:.0f} s); use: "
                  f"--method mpee -o heads={run.out} [-o threshold=0.9] [-o keep_ratio=0.5]")


mpee_command = command(mpee, Flags(MpeeRun), Flags(ScaleOut))

"""`accelgen train exit-heads`: exit adapters and CALM's classifiers on a frozen model
(accelgen/train/exit_heads.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from rich.console import Console

from accelgen.atomic import write_json_atomically
from accelgen.cli.common import FILE_ERRORS, console, reported_errors
from accelgen.cli.flags import Flags, command, flag
from accelgen.cli.train.common import WindowsRun, hidden_states_for, out_flag, progress_bar
from accelgen.train.loop import ScaleOut, is_main_process


@dataclass
class ExitHeadsRun(WindowsRun):
    out: Path = out_flag("Folder for the heads (then: calm -o heads=OUT).")
    layers: Optional[str] = flag(None, "Comma-separated exit layers (default: calm's).")
    steps: int = flag(300)
    batch_size: int = flag(256, "Positions per step.")
    rank: int = flag(64, "Adapter width.")
    learning_rate: float = flag(1e-3)


def exit_heads(run: ExitHeadsRun, scale: ScaleOut) -> None:
    """Exit adapters (matched to the last layer) and CALM's early-exit classifiers, with the base model frozen."""
    from rich.table import Table

    from accelgen.train.exit_heads import evaluate_exit_heads, train_exit_heads

    with reported_errors(FILE_ERRORS):
        target_model, chosen, hidden, unseen = hidden_states_for(run.model, run.dataset, run.layers, run.windows,
                                                                 run.held_out, run.seq_len, run.threads)
        with progress_bar(run.steps) as show:
            heads = train_exit_heads(target_model, hidden, chosen, rank=run.rank, steps=run.steps,
                                     batch_size=run.batch_size, learning_rate=run.learning_rate,
                                     progress=lambda row: show(row, "loss {loss:.3f}"), scale=scale)
        if not is_main_process():
            return  # the first process evaluates and saves
        heads.base_model = run.model
        heads.save(run.out)
        evaluation = evaluate_exit_heads(target_model, heads, unseen)
    table = Table("layer", "plain exit agrees with last", "adapted exit agrees", "classifier right")
    for row in evaluation:
        table.add_row(str(row["layer"]), f"{row['plain_agreement']:.1%}", f"{row['adapted_agreement']:.1%}",
                      f"{row['classifier_accuracy']:.1%}")
    Console().print(table)
    write_json_atomically(Path(run.out) / "evaluation.json", {"held_out_windows": run.held_out, "layers": evaluation})
    console.print(f"exit heads for layers {chosen} → {run.out}; use: --method calm -o heads={run.out} "
                  "[-o measure=classifier]")


exit_heads_command = command(exit_heads, Flags(ExitHeadsRun), Flags(ScaleOut))

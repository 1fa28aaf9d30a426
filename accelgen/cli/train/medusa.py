"""`accelgen train medusa`: Medusa / blockwise heads on the frozen target's last hidden states
(accelgen/train/medusa.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from rich.console import Console

from accelgen.cli.common import console
from accelgen.cli.flags import Flags, command
from accelgen.cli.train.common import FeaturesRun, features_flag, out_flag, save_evaluation, train_and_evaluate_head
from accelgen.train.medusa import MedusaConfig


@dataclass
class MedusaRun(FeaturesRun):
    out: Path = out_flag("Folder for the heads and checkpoints (resumed); then: --method medusa -o heads=OUT.")
    features: Optional[Path] = features_flag("an EAGLE")


def medusa(run: MedusaRun, config: MedusaConfig) -> None:
    """Medusa heads (also for blockwise) on the frozen target's features; top-1/top-5 per head held out."""
    from rich.table import Table

    from accelgen.train.medusa import evaluate_medusa, train_medusa

    def evaluate(target_model, heads, windows, features, choices):  # (count, n), (count, n, d), (count, n)
        return evaluate_medusa(target_model, heads, features, choices)  # the heads read the features alone

    training, evaluation = train_and_evaluate_head(run, config, train_medusa, evaluate,
                                                   "loss {loss:.3f}, head 1 top-1 {accuracy[0]:.0%}, "
                                                   "{positions_per_second:.0f} positions/s")
    table = Table("head", "guesses token", "top-1", "top-5")
    for row in evaluation:
        table.add_row(str(row["head"]), f"+{row['offset']}", f"{row['top1']:.1%}", f"{row['top5']:.1%}")
    Console().print(table)
    save_evaluation(run, config, training, {"heads": evaluation})
    console.print(f"{config.heads} Medusa heads → {run.out} (trained {config.steps - training['resumed_at']} steps "
                  f"in {training['seconds']:.0f}s); use: --method medusa -o heads={run.out} (or --method blockwise)")


medusa_command = command(medusa, Flags(MedusaRun), Flags(MedusaConfig))

"""`accelgen train medusa`: Medusa / blockwise heads on the frozen target's last hidden states
(accelgen/train/medusa.py)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Optional

from rich.console import Console

from accelgen.atomic import write_json_atomically
from accelgen.cli.common import FILE_ERRORS, console, reported_errors
from accelgen.cli.flags import Flags, command
from accelgen.cli.train.common import FeaturesRun, features_flag, out_flag, trained_head, windows_and_features
from accelgen.train.medusa import MedusaConfig


@dataclass
class MedusaRun(FeaturesRun):
    out: Path = out_flag("Folder for the heads and checkpoints (resumed); then: --method medusa -o heads=OUT.")
    features: Optional[Path] = features_flag("an EAGLE")


def medusa(run: MedusaRun, config: MedusaConfig) -> None:
    """Medusa heads (also for blockwise) on the frozen target's features; top-1/top-5 per head held out."""
    from rich.table import Table

    from accelgen.train.medusa import evaluate_medusa, train_medusa

    out = run.out
    with reported_errors(FILE_ERRORS):
        data = windows_and_features(run)
        trained, training = trained_head(run, data, config.steps, partial(train_medusa, config=config, out_dir=out),
                                         "loss {loss:.3f}, head 1 top-1 {accuracy[0]:.0%}, "
                                         "{positions_per_second:.0f} positions/s")
        _, features, choices = data.evaluation()
        evaluation = evaluate_medusa(data.target_model, trained, features, choices)
    table = Table("head", "guesses token", "top-1", "top-5")
    for row in evaluation:
        table.add_row(str(row["head"]), f"+{row['offset']}", f"{row['top1']:.1%}", f"{row['top5']:.1%}")
    Console().print(table)
    write_json_atomically(Path(out) / "evaluation.json", {
        "held_out_windows": run.held_out, "config": asdict(config), "training_seconds": training["seconds"],
        "resumed_at": training["resumed_at"], "heads": evaluation})
    console.print(f"{config.heads} Medusa heads → {out} (trained {config.steps - training['resumed_at']} steps in "
                  f"{training['seconds']:.0f}s); use: --method medusa -o heads={out} (or --method blockwise)")


medusa_command = command(medusa, Flags(MedusaRun), Flags(MedusaConfig))

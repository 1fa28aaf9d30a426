"""`accelgen train medusa`: Medusa / blockwise heads on the frozen target's last hidden states
(accelgen/train/medusa.py)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Optional

from rich.console import Console

from accelgen.cli.common import FILE_ERRORS, console, reported_errors
from accelgen.cli.flags import Flags, command
from accelgen.cli.train.common import (FeaturesRun, features_flag, out_flag, save_evaluation, trained_head,
                                       windows_and_features)
from accelgen.cli.train.eagle import eval_every_flag
from accelgen.train.loop import ScaleOut, is_main_process
from accelgen.train.medusa import MedusaConfig


@dataclass
class MedusaRun(FeaturesRun):
    out: Path = out_flag("Folder for the heads and checkpoints (resumed); then: --method medusa -o heads=OUT.")
    features: Optional[Path] = features_flag("an EAGLE")
    eval_every: int = eval_every_flag()


def medusa(run: MedusaRun, config: MedusaConfig, scale: ScaleOut) -> None:
    """Medusa heads (also for blockwise) on the frozen target's features; top-1/top-5 per head held out."""
    from rich.table import Table

    from accelgen.train.medusa import evaluate_medusa, train_medusa

    with reported_errors(FILE_ERRORS):
        data = windows_and_features(run)
        target_model, tokenizer, windows = data.target_model, data.tokenizer, data.windows
        _, held_features, held_choices = data.evaluation()

        def top1_per_head(heads) -> list[float]:  # the heads read the features alone
            return [row["top1"] for row in evaluate_medusa(target_model, heads, held_features, held_choices)]

        train, curve = train_medusa, None
        if run.eval_every:
            from accelgen.train.curves import TAU_TREE, held_out_recorder

            positions = (len(windows) - run.held_out) * (windows.shape[1] - config.heads)  # what a step draws from
            curve = held_out_recorder(run.out, run.eval_every, min(config.batch_size, positions), "Medusa",
                                      target_model, tokenizer,
                                      data.evaluation()[0], "medusa", top1_per_head,
                                      {**TAU_TREE, "depth": min(TAU_TREE["depth"], config.heads)})
            train = partial(train_medusa, on_step=curve)
        heads, training = trained_head(run, data, config, train, "loss {loss:.3f}, head 1 top-1 {accuracy[0]:.0%}, "
                                                                 "{tokens_per_second:.0f} positions/s", scale)
        if not is_main_process():
            return  # the first process evaluates and saves
        evaluation = evaluate_medusa(target_model, heads, held_features, held_choices)
    table = Table("head", "guesses token", "top-1", "top-5")
    for row in evaluation:
        table.add_row(str(row["head"]), f"+{row['offset']}", f"{row['top1']:.1%}", f"{row['top5']:.1%}")
    Console().print(table)
    save_evaluation(run, config, training, {"heads": evaluation})
    if curve is not None:
        console.print(f"learning curve → {curve.path}; {curve.plot()}")
    console.print(f"{config.heads} Medusa heads → {run.out} (trained {training['stopped_at'] - training['resumed_at']} steps "
                  f"in {training['seconds']:.0f}s); use: --method medusa -o heads={run.out} (or --method blockwise)")


medusa_command = command(medusa, Flags(MedusaRun), Flags(MedusaConfig, renamed={"heads": "--num-heads"}),
                         Flags(ScaleOut))

"""`accelgen train eagle`: an EAGLE head, one decoder layer over the frozen target's features
(accelgen/train/eagle.py)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Optional

from accelgen.atomic import write_json_atomically
from accelgen.cli.common import FILE_ERRORS, console, reported_errors
from accelgen.cli.flags import Flags, command
from accelgen.cli.train.common import FeaturesRun, features_flag, out_flag, trained_head, windows_and_features
from accelgen.train.eagle import EagleConfig


@dataclass
class EagleRun(FeaturesRun):
    out: Path = out_flag("Folder for the head, the feature cache and checkpoints (resumed); then: --method eagle "
                         "--head OUT.")
    features: Optional[Path] = features_flag("a Medusa")


def eagle(run: EagleRun, config: EagleConfig) -> None:
    """EAGLE head: one decoder layer over the frozen target's features; top-1/top-5 held out."""
    from accelgen.train.eagle import evaluate_eagle, train_eagle

    out = run.out
    with reported_errors(FILE_ERRORS):
        data = windows_and_features(run)
        head, training = trained_head(run, data, config.steps, partial(train_eagle, config=config, out_dir=out),
                                      "loss {loss:.3f}, top-1 {accuracy:.0%}, {tokens_per_second:.0f} tokens/s")
        evaluation = evaluate_eagle(data.target_model, head, *data.evaluation())
    write_json_atomically(Path(out) / "evaluation.json", {
        "held_out_windows": run.held_out, "config": asdict(config), "training_seconds": training["seconds"],
        "resumed_at": training["resumed_at"], **evaluation})
    console.print(f"held out: the head's top-1 is the target's next choice at {evaluation['top1']:.1%} of "
                  f"positions, top-5 at {evaluation['top5']:.1%}; {evaluation['choices_in_draft_vocab']:.1%} of the "
                  f"choices are in the draft vocabulary (trained {config.steps - training['resumed_at']} steps in "
                  f"{training['seconds']:.0f}s)")
    console.print(f"EAGLE head → {out}; use: --method eagle --head {out}")


eagle_command = command(eagle, Flags(EagleRun), Flags(EagleConfig))

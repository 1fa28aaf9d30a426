"""`accelgen train eagle`: an EAGLE head, one decoder layer over the frozen target's features
(accelgen/train/eagle.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from accelgen.cli.common import console
from accelgen.cli.flags import Flags, command
from accelgen.cli.train.common import FeaturesRun, features_flag, out_flag, save_evaluation, train_and_evaluate_head
from accelgen.train.eagle import EagleConfig


@dataclass
class EagleRun(FeaturesRun):
    out: Path = out_flag("Folder for the head, the feature cache and checkpoints (resumed); then: --method eagle "
                         "--head OUT.")
    features: Optional[Path] = features_flag("a Medusa")


def eagle(run: EagleRun, config: EagleConfig) -> None:
    """EAGLE head: one decoder layer over the frozen target's features; top-1/top-5 held out."""
    from accelgen.train.eagle import evaluate_eagle, train_eagle

    training, evaluation = train_and_evaluate_head(run, config, train_eagle, evaluate_eagle,
                                                   "loss {loss:.3f}, top-1 {accuracy:.0%}, "
                                                   "{tokens_per_second:.0f} tokens/s")
    save_evaluation(run, config, training, evaluation)
    console.print(f"held out: the head's top-1 is the target's next choice at {evaluation['top1']:.1%} of "
                  f"positions, top-5 at {evaluation['top5']:.1%}; {evaluation['choices_in_draft_vocab']:.1%} of the "
                  f"choices are in the draft vocabulary (trained {config.steps - training['resumed_at']} steps in "
                  f"{training['seconds']:.0f}s)")
    console.print(f"EAGLE head → {run.out}; use: --method eagle --head {run.out}")


eagle_command = command(eagle, Flags(EagleRun), Flags(EagleConfig))

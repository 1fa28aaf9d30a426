"""`accelgen train eagle`: an EAGLE head, one decoder layer over the frozen target's features
(accelgen/train/eagle.py): the EAGLE-1 recipe, or EAGLE-3's (`--recipe eagle3`)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Optional

from accelgen.cli.common import FILE_ERRORS, console, reported_errors
from accelgen.cli.flags import Flags, command, flag
from accelgen.cli.train.common import (FeaturesRun, features_flag, out_flag, save_evaluation, trained_head,
                                       windows_and_features)
from accelgen.errors import InputError
from accelgen.train.eagle import EagleConfig
from accelgen.train.loop import ScaleOut, is_main_process

CURVE_DEPTHS = 5  # draft depths the learning curve follows (the eagle method's default tree depth)


def eval_every_flag():
    return flag(0, "Every N steps, record the held-out top-1 per draft depth and tau measured by generating, against "
                   "training tokens, in OUT/curve.json (and curve.png); 0: not.", min=0)


@dataclass
class EagleRun(FeaturesRun):
    out: Path = out_flag("Folder for the head, the feature cache and checkpoints (resumed); then: --method eagle "
                         "--head OUT.")
    features: Optional[Path] = features_flag("a Medusa")
    eval_every: int = eval_every_flag()
    resume_from: Optional[Path] = flag(None, "A trained head's folder (e.g. a shipped one: `accelgen models` lists "
                                             "them) to go on training, its draft vocabulary kept, with a fresh "
                                             "optimizer (use --warmup-steps); its learning curve goes on in OUT.")

    def __post_init__(self):
        super().__post_init__()
        if self.resume_from is not None and Path(self.resume_from).resolve() == Path(self.out).resolve():
            raise InputError("--resume-from and --out are the same folder: give the further trained head another --out")


def eagle(run: EagleRun, config: EagleConfig, scale: ScaleOut) -> None:
    """EAGLE head (--recipe eagle1 or eagle3): one decoder layer over the frozen target's features; top-1/top-5 held
    out."""
    from accelgen.train.eagle import depth_accuracy, evaluate_eagle, load_start_head, target_layers_for, train_eagle

    with reported_errors(FILE_ERRORS):
        # EAGLE-3 reads the residual stream entering three layers, EAGLE-1 the final features
        data = windows_and_features(run, layers_for=target_layers_for if config.recipe == "eagle3" else None)
        target_model, tokenizer, windows = data.target_model, data.tokenizer, data.windows
        start_head = None if run.resume_from is None else load_start_head(run.resume_from, target_model, config)
        train, curve = partial(train_eagle, start_head=start_head), None
        if run.eval_every:
            from accelgen.train.curves import held_out_recorder

            positions = min(config.batch_size, len(windows) - run.held_out) * (windows.shape[1] - 1)  # per step
            curve = held_out_recorder(run.out, run.eval_every, positions, f"EAGLE ({config.recipe})", target_model,
                                      tokenizer, data.evaluation()[0], "eagle",
                                      lambda head: depth_accuracy(target_model, head, *data.evaluation(), CURVE_DEPTHS),
                                      resumed_from=run.resume_from, session=session_record(run, config))
            train = partial(train, on_step=curve)
        head, training = trained_head(run, data, config, train, "loss {loss:.3f}, top-1 {accuracy:.0%}, "
                                                                "{tokens_per_second:.0f} tokens/s", scale)
        if not is_main_process():
            return  # the first process evaluates and saves
        evaluation = evaluate_eagle(target_model, head, *data.evaluation())
    save_evaluation(run, config, training, evaluation)
    depths = ", ".join(f"{value:.0%}" for value in evaluation["top1_per_depth"][:CURVE_DEPTHS])
    console.print(f"held out ({config.recipe}): the head's top-1 is the target's next choice at {evaluation['top1']:.1%} "
                  f"of positions, top-5 at {evaluation['top5']:.1%}; top-1 at draft depths 1..{CURVE_DEPTHS}: {depths}; "
                  f"{evaluation['choices_in_draft_vocab']:.1%} of the choices are in the draft vocabulary (trained "
                  f"{training['stopped_at'] - training['resumed_at']} steps in {training['seconds']:.0f}s)")
    if curve is not None:
        console.print(f"learning curve → {curve.path}; {curve.plot()}")
    console.print(f"EAGLE head → {run.out}; use: --method eagle --head {run.out}")


def session_record(run: EagleRun, config: EagleConfig) -> dict:
    """What a learning curve records of this training session: the machine, the data (folders by name), settings."""
    from accelgen.hardware import describe, describe_device, device_text, flags_text
    from accelgen.train.loop import training_device

    device = describe_device(training_device())
    machine = device_text(device) if device["type"] == "cuda" else flags_text(describe(run.threads))
    dataset = ",".join(part.split(":")[0] + (f":{Path(part.split(':', 1)[1]).name}" if ":" in part else "")
                       for part in run.dataset.split(","))
    return {"machine": machine, "dataset": dataset, "windows": run.windows, "seq_len": run.seq_len,
            "recipe": config.recipe, "ttt_steps": config.ttt_steps, "batch_size": config.batch_size,
            "learning_rate": config.learning_rate}


eagle_command = command(eagle, Flags(EagleRun), Flags(EagleConfig), Flags(ScaleOut))

"""Training checkpoints shared by the head trainers: a run killed midway resumes from its last checkpoint, and
only with the settings it was started with."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from accelgen.atomic import load_torch, torch_save_atomically
from accelgen.errors import InputError


def run_settings(config) -> dict:
    """What a resumed run must share with its checkpoint: all of a trainer's config (a dataclass) but the run's
    length and checkpoint interval."""
    return {key: value for key, value in asdict(config).items() if key not in ("steps", "checkpoint_every")}


def resume(module, optimizer, path: Path | None, settings: dict, what: str) -> int:
    """The step a training run continues from: 0, or that of the checkpoint at path (its weights and optimizer
    state loaded). settings: what the run must share with its checkpoint (not its length); what: whose
    checkpoint it is, for errors ("EAGLE")."""
    if path is None or not Path(path).exists():
        return 0
    saved = load_torch(path, "delete it and rerun the same command to train from the start")
    if saved.get("settings") != settings:  # (a checkpoint of an older format holds none)
        raise InputError(f"the {what} checkpoint in {Path(path).parent} was trained with other settings; use another --out")
    try:
        module.load_state_dict(saved["module"])
    except RuntimeError as error:
        raise InputError(f"the {what} checkpoint in {Path(path).parent} does not fit this model: {str(error)[:200]}") from None
    optimizer.load_state_dict(saved["optimizer"])
    return saved["step"]


def checkpoint_due(steps_done: int, config) -> bool:
    """Whether a trainer saves its checkpoint after steps_done steps: every `config.checkpoint_every` steps, and
    after the last one."""
    return steps_done % config.checkpoint_every == 0 or steps_done == config.steps


def save_checkpoint(path: Path, step: int, settings: dict, module, optimizer) -> None:
    """Atomically: a run killed while saving resumes from the checkpoint before."""
    torch_save_atomically(path, {"step": step, "settings": settings, "module": module.state_dict(),
                                 "optimizer": optimizer.state_dict()})

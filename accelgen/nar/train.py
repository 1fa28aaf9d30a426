"""Training any NAR method's model (or the AR student) on padded (source, summary) rows: Adam, random batches,
the held-out loss now and then, and a checkpoint that resumes exactly.

The steps run through accelgen/train/loop.py's `run_training`, the loop every accelgen trainer shares (one CPU,
one GPU or several processes; checkpoints written atomically, resumed only with the same settings). A step's
rows, the method's random draws (CMLM's masks) and its dropout all come from the step's own seed, so a run
resumed from a checkpoint trains exactly what an unbroken run trains.
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

from accelgen.nar.backbone import MethodModel
from accelgen.nar.tokens import trim_padding
from accelgen.train.loop import Checkpointing, ScaleOut, run_training, step_generator


@dataclass(frozen=True)
class TrainSettings:
    steps: int = 2000
    batch_size: int = 32
    learning_rate: float = 5e-4
    seed: int = 0
    checkpoint_every: int = 200
    max_grad_norm: float | None = 1.0
    eval_every: int = 200  # steps between held-out losses (and one before the first step)


def rows_count(rows: dict[str, torch.Tensor]) -> int:
    return len(rows["src"])


def select_rows(rows: dict[str, torch.Tensor], picks: torch.Tensor) -> dict[str, torch.Tensor]:
    """The picked rows of a corpus (each tensor's first dimension), trimmed to the widths they use."""
    return trim_padding({name: tensor[picks] for name, tensor in rows.items()})


@contextlib.contextmanager
def seeded_randomness(seed: int):
    """Draws from torch's global generators (dropout) under seed, leaving them as they were outside."""
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


@torch.no_grad()
def held_out_loss(model: MethodModel, rows: dict[str, torch.Tensor], batch_size: int = 64, seed: int = 0) -> float:
    """The mean loss over rows, in eval mode (no dropout), the method's random draws (CMLM's masks) made with a fixed
    seed so that two calls measure the same thing; the model's mode is restored after."""
    was_training = model.training
    model.eval()
    generator = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    total = 0.0
    for start in range(0, rows_count(rows), batch_size):
        batch = model.training_inputs(select_rows(rows, torch.arange(start, min(start + batch_size, rows_count(rows)))),
                                      generator)
        loss, _ = model.loss({name: tensor.to(device) for name, tensor in batch.items()})
        total += float(loss) * rows_count(batch)
    model.train(was_training)
    return total / rows_count(rows)


def train_model(model: MethodModel, rows: dict[str, torch.Tensor], settings: TrainSettings, *,
                held_out: dict[str, torch.Tensor] | None = None, checkpoint: Path | None = None,
                scale: ScaleOut | None = None, progress: Callable[[dict], None] | None = None) -> dict:
    """Train model on rows ({"src", "src_mask", "tgt", "tgt_mask"}, as tokens.encode_pairs makes them) for
    settings.steps steps, resuming from checkpoint when it exists. Returns run_training's summary plus
    "held_out": [(step, loss)] measured every settings.eval_every steps, at 0 (before training) and at the end."""
    optimizer = torch.optim.Adam(model.parameters(), lr=settings.learning_rate)
    corpus_rows = rows_count(rows)

    def draw(step: int) -> dict[str, torch.Tensor]:
        generator = step_generator(settings.seed, step)
        picks = torch.randint(0, corpus_rows, (settings.batch_size,), generator=generator)
        batch = model.training_inputs(select_rows(rows, picks), generator)
        dropout_seed = int(torch.randint(0, 2 ** 62, (), generator=generator))
        return {**batch, "dropout_seed": torch.full((settings.batch_size,), dropout_seed)}

    def loss_of(micro_batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict]:
        inputs = dict(micro_batch)
        with seeded_randomness(int(inputs.pop("dropout_seed")[0])):
            return model.loss(inputs)

    history: list[tuple[int, float]] = []

    def after_step(step: int) -> None:
        if held_out is not None and (step % settings.eval_every == 0 or step == settings.steps):
            history.append((step, held_out_loss(model, held_out)))

    checkpointing = None
    if checkpoint is not None:
        run = {key: value for key, value in asdict(settings).items() if key not in ("steps", "checkpoint_every",
                                                                                    "eval_every")}
        what_is_trained = {"method": model.method, "options": model.options(), "backbone": asdict(model.config)}
        checkpointing = Checkpointing(Path(checkpoint), {**run, **what_is_trained}, f"NAR {model.method}",
                                      settings.checkpoint_every)
    model.train()
    result = run_training(model, optimizer, settings.steps, draw, loss_of, scale=scale, checkpointing=checkpointing,
                          max_grad_norm=settings.max_grad_norm, progress=progress, after_step=after_step)
    if held_out is not None and not history:  # resumed at the end: no step ran, the loss is still worth seeing
        history.append((settings.steps, held_out_loss(model, held_out)))
    model.eval()
    return {**result, "held_out": history}

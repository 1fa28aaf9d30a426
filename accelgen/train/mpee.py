"""Training MPEE's exit heads (heads/mpee.py) by weighted self-distillation, with the base model frozen.

The teacher is the model itself: its last layer's next-token distribution. Every exit i learns
- its adapter and features, by KL(teacher ‖ exit i), weighted w_i ∝ i + 1 (deeper exits weigh more: they are
  the ones that can match the teacher, and their features feed no exit above them to make up for it); the
  weights average 1;
- its classifier, by binary cross-entropy against whether its top-1 equals the teacher's.
An exit's features carry the exits' below (f_i reads f_(i-1)), so the loss of an upper exit trains the lower
exits' features too: the multi-perspective part.

`accelgen train mpee` runs the frozen model once over packed windows of the dataset and keeps the exit layers'
and the last layer's hidden states (train/exit_heads.py's collect_hidden_states), then trains on batches of
positions with progress shown. Checkpoints (heads, optimizer state, step) are written atomically every
`checkpoint_every` steps; a rerun resumes from the last one and ends with the same heads as an uninterrupted run
(each step draws its positions from a generator seeded by the step). Held-out windows give each exit's agreement
with the last layer, plain and trained, its classifier's accuracy, and what thresholds would do
(`evaluate_mpee`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from accelgen.errors import InputError
from accelgen.heads.mpee import MpeeHeads
from accelgen.models.layouts import Decoder
from accelgen.train.checkpoints import run_settings
from accelgen.train.exit_heads import classifier_loss, frozen_base
from accelgen.train.loop import Checkpointing, ScaleOut, run_training, step_generator, training_device

CHECKPOINT = "mpee_trainer.pt"  # heads, optimizer state and step, while training
THRESHOLDS = (1.0, 0.95, 0.9, 0.8, 0.7, 0.5, 0.0)  # evaluated on held-out positions


@dataclass
class MpeeConfig:
    rank: int = 64
    steps: int = 200
    batch_size: int = 128
    learning_rate: float = 1e-3
    checkpoint_every: int = 50
    seed: int = 0

    def __post_init__(self):
        if min(self.rank, self.steps, self.batch_size, self.checkpoint_every) < 1 or self.learning_rate <= 0:
            raise InputError("rank, steps, batch size, checkpoint interval and learning rate must be positive")


def distillation_weights(count: int) -> list[float]:
    """Exit i's weight in the distillation loss, ∝ i + 1 and averaging 1: [1.0] for one exit, [0.5, 1.0, 1.5] for 3."""
    return [count * (index + 1) / (count * (count + 1) / 2) for index in range(count)]


def step_rows(step: int, count: int, batch_size: int, seed: int) -> torch.Tensor:
    """(min(batch_size, count),) positions for one step, drawn from the step's own seed: a resumed run draws the
    same ones as an uninterrupted run."""
    return torch.randint(0, count, (min(batch_size, count),), generator=step_generator(seed, step))


def train_mpee(model, hidden_states: dict[int, torch.Tensor], layers: list[int], config: MpeeConfig,
               out_dir=None, progress: Callable[[dict], None] | None = None,
               scale: ScaleOut | None = None) -> tuple[MpeeHeads, dict]:
    """Heads for the exits `layers`, trained on hidden_states {layer: (positions, d)} (the exits' and the last
    layer's); with out_dir, checkpointed there and resumed; scale: processes, precision, accumulation
    (train/loop.py). Returns (heads, {"resumed_at", "seconds", "processes"})."""
    with torch.random.fork_rng():  # the same start for every run of a config (a resumed run's first part too)
        torch.manual_seed(config.seed)
        heads = MpeeHeads.for_model(model, layers, config.rank)
    decoder = Decoder(model, "mpee training")
    last = model.config.num_hidden_layers - 1
    weights = distillation_weights(len(heads.layers))
    model.to(training_device(scale))
    optimizer = torch.optim.AdamW(heads.parameters(), lr=config.learning_rate)
    count = hidden_states[last].shape[0]

    def draw(step: int) -> dict:
        rows = step_rows(step, count, config.batch_size, config.seed)
        return {layer: hidden_states[layer][rows] for layer in [*heads.layers, last]}  # {layer: (b, d)}

    def loss_of(batch: dict) -> tuple[torch.Tensor, dict]:
        with torch.no_grad():
            teacher = torch.log_softmax(decoder.logits(batch[last].to(model.dtype)), dim=-1)
        features = heads.chain(batch)
        total, agreement = 0.0, []
        for weight, layer in zip(weights, heads.layers):
            logits = decoder.logits(heads.adapt(layer, batch[layer].to(model.dtype), features[layer]))
            kl = torch.nn.functional.kl_div(torch.log_softmax(logits, dim=-1), teacher, log_target=True,
                                            reduction="batchmean")
            agrees = (logits.argmax(-1) == teacher.argmax(-1)).float()
            total = total + weight * kl + classifier_loss(heads.confidence(layer, features[layer]), agrees)
            agreement.append(float(agrees.mean()))
        return total, {"agreement": agreement}  # agreement: per exit, in heads.layers' order

    settings = {**run_settings(config), "layers": heads.layers, "positions": count}
    checkpointing = Checkpointing(None if out_dir is None else Path(out_dir) / CHECKPOINT, settings, "MPEE",
                                  config.checkpoint_every)
    with frozen_base(model):
        times = run_training(heads, optimizer, config.steps, draw, loss_of, scale=scale, checkpointing=checkpointing,
                             progress=progress)
    return heads.eval(), times


@torch.no_grad()
def evaluate_mpee(model, heads: MpeeHeads, hidden_states: dict[int, torch.Tensor], chunk: int = 256,
                  thresholds=THRESHOLDS) -> dict:
    """On hidden states not trained on: per exit, how often the plain and the trained exit's top-1 equal the last
    layer's and how often the classifier (at 0.5) is right about the trained exit; per threshold, the mean depth
    and the agreement of exiting at the first exit whose confidence passes it (each position from the full
    model's states: what one decoded token would do, before copied states add their error). On the model's device,
    where the heads are."""
    decoder = Decoder(model, "mpee evaluation")
    last = model.config.num_hidden_layers - 1
    total = hidden_states[last].shape[0]
    counts = {layer: [0, 0, 0] for layer in heads.layers}
    depth = {threshold: 0 for threshold in thresholds}
    agreed = {threshold: 0 for threshold in thresholds}
    for start in range(0, total, chunk):
        rows = slice(start, start + chunk)
        final = decoder.logits(hidden_states[last][rows].to(model.device, model.dtype)).argmax(-1)  # (b,)
        chosen = {layer: hidden_states[layer][rows].to(model.device) for layer in heads.layers}
        features = heads.chain(chosen)
        exits = {}  # layer -> (b,) bool: the trained exit agrees; (b,) confidence
        for layer in heads.layers:
            hidden = chosen[layer].to(model.dtype)
            plain = decoder.logits(hidden).argmax(-1) == final
            trained = decoder.logits(heads.adapt(layer, hidden, features[layer])).argmax(-1) == final
            confidence = heads.confidence(layer, features[layer])
            exits[layer] = (trained, confidence)
            for slot, hits in enumerate((plain, trained, (confidence > 0.5) == trained)):
                counts[layer][slot] += int(hits.sum())
        for threshold in thresholds:
            left = torch.zeros_like(final, dtype=torch.bool)  # already exited
            for layer in heads.layers:
                trained, confidence = exits[layer]
                leaving = ~left & (confidence > threshold)
                depth[threshold] += int(leaving.sum()) * (layer + 1)
                agreed[threshold] += int((leaving & trained).sum())
                left |= leaving
            depth[threshold] += int((~left).sum()) * (last + 1)
            agreed[threshold] += int((~left).sum())  # the full model agrees with itself
    return {
        "exits": [{"layer": layer, "plain_agreement": plain / total, "trained_agreement": trained / total,
                   "classifier_accuracy": right / total} for layer, (plain, trained, right) in counts.items()],
        "thresholds": [{"threshold": threshold, "mean_layers": depth[threshold] / total,
                        "agreement": agreed[threshold] / total} for threshold in thresholds],
        "positions": total,
    }

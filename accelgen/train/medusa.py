"""Training Medusa heads (heads/medusa.py), with the base model frozen. Only the residual blocks
train, d² weights per head; the LM head they share is the target's, frozen.

`accelgen train medusa` works in two stages:

1. **Features.** The frozen target runs once over packed windows of the dataset; its features and its own greedy
   choices go to the sharded feature store in the out folder (train/shards.py, `features/last-hidden/`, the
   same store as EAGLE's: give `--features` an EAGLE run's folder to share it). A rerun reuses them.
2. **Training.** Every head trains on batches of positions. Its label is the *target's* choice k places on
   (self-distillation, as in Medusa-2), not the dataset's token: the drafts are to guess what this target
   says. Heads draft from the `draft_vocab` tokens most frequent in the data and the choices, as EAGLE does,
   so only those rows of the LM head are computed, in training too. Progress shows the loss and each head's
   top-1 accuracy; checkpoints are saved every `checkpoint_every` steps, and a rerun resumes.

Held-out windows give each head's top-1 and top-k accuracy against the target's choice (`evaluation.json`).
The heads are saved as `medusa_heads.safetensors` + `medusa_heads.json`, and refused for a model of another
shape.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from accelgen.errors import InputError
from accelgen.heads.lm_head import draft_vocabulary
from accelgen.heads.medusa import MedusaHeads
from accelgen.train.checkpoints import run_settings
from accelgen.train.loop import Checkpointing, ScaleOut, run_training, step_generator, training_device

CHECKPOINT = "medusa_trainer.pt"  # heads, optimizer state and step, while training


def head_targets(choices: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions (N, 2) as (window, index), targets (N, K)) from the target's choices (count, n): head k at
    position t is taught choices[t + k], the target's token k + 1 places after t."""
    count, length = choices.shape
    usable = length - heads
    if usable < 1:
        raise InputError(f"windows of {length} tokens are too short for {heads} heads")
    positions = torch.stack(torch.meshgrid(torch.arange(count), torch.arange(usable), indexing="ij"), dim=-1).reshape(-1, 2)
    targets = choices[positions[:, :1], positions[:, 1:] + torch.arange(1, heads + 1)[None]]
    return positions, targets


@dataclass
class MedusaConfig:
    heads: int = field(default=4, metadata={"help": "Number of heads: head k guesses the token k places after the "
                                                    "next one."})
    steps: int = 300
    batch_size: int = field(default=256, metadata={"help": "Positions per step."})
    learning_rate: float = 1e-3
    draft_vocab: int = field(default=16384, metadata={"help": "Tokens the heads draft from: the most frequent "
                                                              "(0: the whole vocabulary)."})
    checkpoint_every: int = 100

    def __post_init__(self):
        if min(self.heads, self.steps, self.batch_size, self.checkpoint_every) < 1 or self.learning_rate <= 0:
            raise InputError("heads, steps, batch size, checkpoint interval and learning rate must be positive")
        if self.draft_vocab < 0:
            raise InputError(f"draft_vocab must be >= 0 (0: the whole vocabulary), got {self.draft_vocab}")


def train_medusa(model, windows: torch.Tensor, features: torch.Tensor, choices: torch.Tensor, config: MedusaConfig,
                 out_dir=None, seed: int = 0, progress: Callable[[dict], None] | None = None,
                 on_step: Callable[[int, Callable], None] | None = None,
                 scale: ScaleOut | None = None) -> tuple[MedusaHeads, dict]:
    """Train the heads' residual blocks on the target's features (count, n, d) and choices (count, n) over
    windows (count, n); with out_dir, checkpointed there and resumed. on_step(step, drafting_heads) is called after
    each step, drafting_heads() giving the heads (learning curves); scale: processes, precision, accumulation
    (train/loop.py). Returns (heads, {"resumed_at", "seconds"})."""
    medusa = MedusaHeads(config.heads, model.config.hidden_size, model.config.vocab_size,
                         str(getattr(model, "name_or_path", "")), model.config.num_hidden_layers, config.draft_vocab)
    if config.draft_vocab:
        medusa.vocab = draft_vocabulary(windows, choices, model.config.vocab_size, config.draft_vocab)
    model.to(training_device(scale))
    lm_head = medusa.lm_head(model)
    positions, targets = head_targets(choices, config.heads)
    labels = lm_head.label_index(targets).cpu()  # (N, K) indices into the draft vocabulary, -100 outside it
    optimizer = torch.optim.AdamW(medusa.blocks.parameters(), lr=config.learning_rate)

    def draw(step: int) -> dict:
        rows = torch.randint(0, len(positions), (min(config.batch_size, len(positions)),),
                             generator=step_generator(seed, step))
        return {"features": features[positions[rows, 0], positions[rows, 1]], "labels": labels[rows]}

    def loss_of(batch: dict) -> tuple[torch.Tensor, dict]:
        logits = lm_head.restricted(medusa(batch["features"]))  # (K, b, V')
        goal = batch["labels"].T  # (K, b)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), goal.reshape(-1))
        return loss, {"accuracy": (logits.argmax(-1) == goal).float().mean(1).tolist()}

    checkpointing = Checkpointing(None if out_dir is None else Path(out_dir) / CHECKPOINT, run_settings(config),
                                  "Medusa", config.checkpoint_every)
    times = run_training(medusa, optimizer, config.steps, draw, loss_of, scale=scale, checkpointing=checkpointing,
                         progress=progress,
                         after_step=None if on_step is None else lambda step: on_step(step, lambda: medusa))
    return medusa.eval(), times


@torch.no_grad()
def evaluate_medusa(model, medusa: MedusaHeads, features: torch.Tensor, choices: torch.Tensor, top_k: int = 5,
                    chunk: int = 256) -> list[dict]:
    """Per head on windows not trained on: how often its top-1, and its top-k, hold the target's choice k + 1
    places on (features (count, n, d), choices (count, n))."""
    positions, targets = head_targets(choices, len(medusa))
    lm_head = medusa.lm_head(model)
    top1 = torch.zeros(len(medusa), device=model.device)
    topk = torch.zeros(len(medusa), device=model.device)
    for start in range(0, len(positions), chunk):
        rows = slice(start, start + chunk)
        # the features stay on the CPU; a chunk at a time goes to the model's device
        chunk_features = features[positions[rows, 0], positions[rows, 1]].to(model.device)
        logits = lm_head(medusa(chunk_features))  # (K, b, vocab)
        goal = targets[rows].T[..., None].to(model.device)  # (K, b, 1)
        top1 += (logits.argmax(-1, keepdim=True) == goal).float().sum((1, 2))
        topk += (logits.topk(top_k, dim=-1).indices == goal).any(-1).float().sum(1)
    return [{"head": k + 1, "offset": k + 2, "top1": float(top1[k]) / len(positions),
             f"top{top_k}": float(topk[k]) / len(positions)} for k in range(len(medusa))]

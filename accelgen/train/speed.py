"""Train a small model whose decoder layers share weights in a cycle, for SPEED (accelgen/exits/speed.py).

The model (models/shared_cycle.py) is a Llama of `cycle` distinct layers run `repeats` times, trained from
scratch on packed windows of text (next-token cross-entropy, AdamW, linear warm-up then cosine decay). SPEED
guesses the next token from each token's first repeat, read through the final norm and LM head, so that exit's
cross-entropy is added with weight `exit_weight`: its guesses agreeing with the last layer are SPEED's hits.

`train_speed_model` trains in train/loop.py's run_training: it shows progress, checkpoints every
`checkpoint_every` steps (weights, optimizer state and step in one atomic file) and resumes from the last
checkpoint exactly: the batches and the schedule depend on the step only. `held_out_metrics` gives the held-out
loss and perplexity, and how often the first repeat's exit agrees with the last layer (the hit rate SPEED can
expect when every earlier token is right).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from accelgen.errors import InputError
from accelgen.models import shared_cycle
from accelgen.models.layerwise import exit_logits, layer_outputs, llama_decoder
from accelgen.train.checkpoints import run_settings
from accelgen.train.layerskip import step_windows
from accelgen.train.loop import Checkpointing, ScaleOut, run_training

TRAINER_FILE = "trainer.pt"  # weights, optimizer state and step: what a rerun resumes from


@dataclass
class SpeedModelConfig:
    steps: int = 300
    batch_size: int = 8
    seq_len: int = 128
    learning_rate: float = 1e-3
    warmup: int = field(default=20, metadata={"help": "Steps of linear learning-rate warm-up."})
    cycle: int = field(default=4, metadata={"help": "Distinct decoder layers."})
    repeats: int = field(default=3, metadata={"help": "Times the cycle of layers is run per token."})
    hidden_size: int = field(default=256, metadata={"help": "Width of the model."})
    intermediate_size: int = field(default=768, metadata={"help": "Width of each layer's MLP."})
    heads: int = field(default=4, metadata={"help": "Attention heads per layer."})
    exit_weight: float = field(default=0.5, metadata={"help": "Weight of the first repeat's exit loss (SPEED's guesses)."})
    checkpoint_every: int = 25
    seed: int = 0

    def __post_init__(self):
        if min(self.steps, self.batch_size, self.seq_len, self.cycle, self.hidden_size, self.intermediate_size,
               self.heads, self.checkpoint_every) < 1:
            raise InputError("steps, batch size, sequence length, cycle, sizes, heads and checkpoint interval must be "
                             "positive")
        if self.repeats < 2:
            raise InputError(f"repeats must be >= 2 (SPEED pipelines the repeats), got {self.repeats}")
        if self.hidden_size % self.heads:
            raise InputError(f"hidden_size {self.hidden_size} is not a multiple of heads {self.heads}")
        if self.exit_weight < 0 or self.learning_rate <= 0 or self.warmup < 0:
            raise InputError("exit_weight and warmup must be >= 0, learning_rate > 0")


def new_model(vocab_size: int, config: SpeedModelConfig):
    """The untrained shared-cycle model the config describes (float32)."""
    return shared_cycle.build(vocab_size, cycle=config.cycle, repeats=config.repeats, hidden_size=config.hidden_size,
                              intermediate_size=config.intermediate_size, heads=config.heads, kv_heads=config.heads,
                              seed=config.seed)


def learning_rate(step: int, config: SpeedModelConfig) -> float:
    """Linear warm-up to the peak, then cosine decay to a tenth of it at the last step."""
    if step < config.warmup:
        return config.learning_rate * (step + 1) / config.warmup
    progress = (step - config.warmup) / max(1, config.steps - config.warmup)
    return config.learning_rate * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def losses(model, windows: torch.Tensor, cycle: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(final loss, first repeat's exit loss) of next-token prediction over windows (b, n)."""
    decoder = llama_decoder(model, "speed-model training")
    targets = windows[:, 1:].reshape(-1).to(model.device)
    exit_hidden = None
    for index, hidden in enumerate(layer_outputs(model, decoder, windows)):
        if index == cycle - 1:
            exit_hidden = hidden

    def cross_entropy(states: torch.Tensor) -> torch.Tensor:  # (b, n, d) -> next-token loss of their exit
        return F.cross_entropy(exit_logits(model, decoder, states[:, :-1]).reshape(-1, model.config.vocab_size), targets)

    return cross_entropy(hidden), cross_entropy(exit_hidden)


@torch.no_grad()
def held_out_metrics(model, windows: torch.Tensor, batch_size: int = 8) -> dict:
    """Held-out loss and perplexity of the model, and of its first repeat's exit: how often that exit's top-1 is
    the next token and agrees with the last layer's top-1."""
    cycle, _ = shared_cycle.cycle_and_repeats(model, "held-out metrics")
    decoder = llama_decoder(model, "held-out metrics")
    was_training = model.training
    model.eval()
    loss = exit_loss = agree = exit_correct = correct = 0.0
    for start in range(0, len(windows), batch_size):
        batch = windows[start : start + batch_size].to(model.device)
        outputs = list(layer_outputs(model, decoder, batch))
        final, early = (exit_logits(model, decoder, outputs[i][:, :-1]) for i in (-1, cycle - 1))
        targets = batch[:, 1:]
        loss += float(F.cross_entropy(final.flatten(0, 1), targets.flatten(), reduction="sum"))
        exit_loss += float(F.cross_entropy(early.flatten(0, 1), targets.flatten(), reduction="sum"))
        correct += float((final.argmax(-1) == targets).sum())
        exit_correct += float((early.argmax(-1) == targets).sum())
        agree += float((early.argmax(-1) == final.argmax(-1)).sum())
    model.train(was_training)
    positions = windows.shape[0] * (windows.shape[1] - 1)
    return {"loss": loss / positions, "perplexity": math.exp(loss / positions), "next_token": correct / positions,
            "exit_loss": exit_loss / positions, "exit_next_token": exit_correct / positions,
            "exit_agrees_with_last": agree / positions, "positions": positions}


def train_speed_model(model, windows: torch.Tensor, config: SpeedModelConfig, out_dir: Path,
                      progress: Callable[[dict], None] | None = None, scale: ScaleOut | None = None) -> dict:
    """Train `model` (new_model's) in place on windows (count, seq_len), resuming from out_dir's checkpoint if there
    is one (a checkpoint every `checkpoint_every` steps and at the end); scale: processes, precision, accumulation
    (train/loop.py). Returns steps, resumed_at, seconds and processes."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.learning_rate, weight_decay=0.01)

    def draw(step: int) -> dict:
        for group in optimizer.param_groups:  # draw runs first in each step, on every process
            group["lr"] = learning_rate(step, config)
        return {"windows": step_windows(windows, step, config.batch_size)}

    def loss_of(batch: dict) -> tuple[torch.Tensor, dict]:
        final, early = losses(model, batch["windows"], config.cycle)
        return final + config.exit_weight * early, {"final_loss": float(final.detach()),
                                                    "exit_loss": float(early.detach())}

    model.train()
    checkpointing = Checkpointing(Path(out_dir) / TRAINER_FILE, run_settings(config), "speed-model",
                                  config.checkpoint_every)
    times = run_training(model, optimizer, config.steps, draw, loss_of, scale=scale, checkpointing=checkpointing,
                         max_grad_norm=1.0, tokens_per_row=windows.shape[1], progress=progress)
    model.eval()
    return {"steps": config.steps, **times}

"""LayerSkip training (Elhoushi et al. 2024, arXiv:2404.16710): make a model's early exits accurate.

Two things are added to the next-token loss while fine-tuning:

- **Layer dropout that rises with depth.** In each sequence of a batch, layer l is skipped (its input passed
  through) with probability p_max · D(l), where D(l) = exp(l·ln2 / (L−1)) − 1. That is 0 for the first layer
  and 1 for the last, so the upper layers learn not to be relied on. The paper's temporal scaling S(t) is 1
  here, as in its continual-pretraining and fine-tuning runs.
- **An early-exit loss.** At the layers the curriculum enables this step, the cross-entropy of the layer's exit
  prediction is added, read through the model's own final norm and LM head (the head is shared, as in the
  paper). Layer l is weighted by e(l) = e_scale · Σ_{i≤l} i, the last layer by L − 1 + e_scale · Σ_{i<L−1} i,
  and the enabled weights are normalised to sum to 1. Two curricula:
  - *rotational*: every R-th layer, a different residue each step;
  - *gradual*: enabled from the top down as training proceeds.
  The last layer is always on.

`train_layerskip` trains on packed windows of text, with AdamW, in train/loop.py's run_training. It shows
progress (loss, tokens/s), checkpoints every `checkpoint_every` steps, and resumes from the last checkpoint
exactly (a step's batch and layer dropout depend on the step only). The trained model is saved as a normal HF
folder, which `--model FOLDER --method layerskip` (or any method) loads. `exit_accuracy` measures, per layer, how
often the exit's top-1 is the next token and agrees with the last layer's. The CLI reports it before and after
training.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import torch

from accelgen.atomic import save_pretrained_atomically, write_json_atomically
from accelgen.errors import InputError
from accelgen.models.layerwise import exit_logits, layer_outputs, llama_decoder
from accelgen.train.checkpoints import checkpoint_due, run_settings
from accelgen.train.loop import Checkpointing, ScaleOut, run_training, step_generator

TRAINER_FILE = "trainer.pt"  # weights, optimizer state and step: what a rerun resumes from
CURRICULA = ("rotational", "gradual")


@dataclass
class LayerSkipConfig:
    steps: int = 200
    batch_size: int = 4
    seq_len: int = 256
    learning_rate: float = 2e-5
    p_max: float = field(default=0.1, metadata={"help": "Layer dropout of the last layer (lower layers less)."})
    exit_scale: float = field(default=1.0, metadata={"help": "Weight of the early-exit losses (e_scale)."})
    curriculum: str = field(default="rotational", metadata={"help": "rotational or gradual."})
    rotation: int = field(default=4, metadata={"help": "rotational: exits of every R-th layer per step."})
    checkpoint_every: int = 50
    seed: int = 0

    def __post_init__(self):
        if self.curriculum not in CURRICULA:
            raise InputError(f"curriculum must be one of {', '.join(CURRICULA)}, not {self.curriculum!r}")
        if min(self.steps, self.batch_size, self.seq_len, self.rotation, self.checkpoint_every) < 1:
            raise InputError("steps, batch size, sequence length, rotation and checkpoint interval must be positive")
        if not 0.0 <= self.p_max < 1.0:
            raise InputError(f"p_max must be in [0, 1), got {self.p_max}")


def layer_dropout_rates(layer_count: int, p_max: float) -> list[float]:
    """p_max · (exp(l·ln2/(L−1)) − 1) for each layer l: 0 at the first layer, p_max at the last."""
    if layer_count == 1:
        return [0.0]
    return [p_max * (math.exp(l * math.log(2) / (layer_count - 1)) - 1) for l in range(layer_count)]


def exit_loss_weights(layer_count: int, step: int, steps: int, config: LayerSkipConfig) -> list[float]:
    """Weight of each layer's exit loss at this step: the curriculum's enabled layers, weighted by depth,
    normalised to sum to 1 (the last layer is always enabled)."""
    last = layer_count - 1
    if config.curriculum == "rotational":
        enabled = [l % config.rotation == step % config.rotation or l == last for l in range(layer_count)]
    else:  # gradual: from the top down, the lowest layer enabled at the end of training
        lowest = last - math.floor((step + 1) / steps * last)
        enabled = [l >= lowest for l in range(layer_count)]
    scale = [config.exit_scale * l * (l + 1) / 2 for l in range(last)] + [last + config.exit_scale * last * (last - 1) / 2]
    weights = [s if on else 0.0 for s, on in zip(scale, enabled)]
    total = sum(weights)
    return [w / total for w in weights]


def packed_windows(tokenizer, texts: Iterable[str], seq_len: int, count: int) -> torch.Tensor:
    """(count, seq_len) token windows cut from the texts, joined by EOS (packing: no padding)."""
    needed, stream = count * seq_len, []
    separator = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    for text in texts:
        stream += tokenizer(text, add_special_tokens=False).input_ids + separator
        if len(stream) >= needed:
            break
    if len(stream) < seq_len:
        raise InputError(f"the dataset gave {len(stream)} tokens, fewer than one window of {seq_len}")
    usable = len(stream) // seq_len * seq_len
    return torch.tensor(stream[:usable], dtype=torch.long).view(-1, seq_len)[:count]


def step_windows(windows: torch.Tensor, step: int, batch_size: int) -> torch.Tensor:
    """The (b, n) windows of a step: the next batch_size of windows (count, n), wrapping around at the end, so that
    every step's batch is whole (to split among processes and micro-batches)."""
    size = min(batch_size, len(windows))
    return windows[(step * size + torch.arange(size)) % len(windows)]


def layerskip_loss(model, windows: torch.Tensor, dropped: torch.Tensor,
                   weights: list[float]) -> tuple[torch.Tensor, dict[int, float]]:
    """The weighted early-exit loss over windows (b, n), each sequence passing over the layers dropped (b, L) bool
    marks (layer dropout); also each enabled layer's loss."""
    decoder = llama_decoder(model, "LayerSkip training")
    targets = windows[:, 1:].reshape(-1).to(model.device)
    total, per_layer = 0.0, {}
    for index, hidden in enumerate(layer_outputs(model, decoder, windows, passed_over=lambda layer: dropped[:, layer])):
        if weights[index] > 0:
            logits = exit_logits(model, decoder, hidden[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets)
            total = total + weights[index] * loss
            per_layer[index] = float(loss.detach())
    return total, per_layer


@torch.no_grad()
def exit_accuracy(model, windows: torch.Tensor, batch_size: int = 4) -> list[dict]:
    """Per layer: share of positions where its exit's top-1 is the next token, and where it agrees with the last
    layer's top-1 (what an early-exit draft needs)."""
    decoder = llama_decoder(model, "exit accuracy")
    was_training = model.training
    model.eval()
    correct = agree = None
    for start in range(0, len(windows), batch_size):
        batch = windows[start : start + batch_size].to(model.device)
        predictions = [exit_logits(model, decoder, hidden[:, :-1]).argmax(-1)
                       for hidden in layer_outputs(model, decoder, batch)]
        targets, final = batch[:, 1:], predictions[-1]
        batch_correct = torch.stack([(p == targets).sum() for p in predictions])
        batch_agree = torch.stack([(p == final).sum() for p in predictions])
        correct = batch_correct if correct is None else correct + batch_correct
        agree = batch_agree if agree is None else agree + batch_agree
    model.train(was_training)
    positions_total = windows.shape[0] * (windows.shape[1] - 1)
    return [{"layer": index, "next_token": float(c) / positions_total, "agrees_with_last": float(a) / positions_total}
            for index, (c, a) in enumerate(zip(correct, agree))]


def train_layerskip(model, tokenizer, windows: torch.Tensor, config: LayerSkipConfig, out_dir: Path,
                    progress: Callable[[dict], None] | None = None, scale: ScaleOut | None = None) -> dict:
    """Fine-tune `model` in place on windows (count, seq_len), resuming from out_dir's checkpoint if there is
    one; the model and tokenizer are saved to out_dir every `checkpoint_every` steps and at the end. scale:
    processes, precision, accumulation (train/loop.py). Returns steps, resumed_at, seconds and processes."""
    out_dir = Path(out_dir)
    layer_count = model.config.num_hidden_layers
    rates = torch.tensor(layer_dropout_rates(layer_count, config.p_max))
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.learning_rate)

    def draw(step: int) -> dict:
        batch = step_windows(windows, step, config.batch_size)
        weights = torch.tensor(exit_loss_weights(layer_count, step, config.steps, config), dtype=torch.float64)
        dropped = torch.rand((len(batch), layer_count), generator=step_generator(config.seed, step)) < rates
        return {"windows": batch, "dropped": dropped,  # (b, L) bool: the layers each sequence passes over
                "exit_weights": weights.expand(len(batch), -1)}  # (b, L): the step's curriculum, in every row

    def loss_of(batch: dict) -> tuple[torch.Tensor, dict]:
        loss, per_layer = layerskip_loss(model, batch["windows"], batch["dropped"], batch["exit_weights"][0].tolist())
        return loss, {"exit_losses": [per_layer.get(layer, math.nan) for layer in range(layer_count)]}  # nan: off

    def save_model(step: int) -> None:  # the model folder follows each checkpoint the loop saves
        if step > 0 and checkpoint_due(step, config):
            save_pretrained_atomically(out_dir, model, tokenizer)
            write_json_atomically(out_dir / "layerskip.json", {"step": step, **asdict(config)})

    model.train()
    checkpointing = Checkpointing(out_dir / TRAINER_FILE, run_settings(config), "LayerSkip", config.checkpoint_every)
    times = run_training(model, optimizer, config.steps, draw, loss_of, scale=scale, checkpointing=checkpointing,
                         max_grad_norm=1.0, tokens_per_row=windows.shape[1], progress=progress, after_step=save_model)
    model.eval()
    return {"steps": config.steps, **times}

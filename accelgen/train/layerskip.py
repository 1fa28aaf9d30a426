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

`train_layerskip` runs the loop on packed windows of text, with AdamW. It shows progress (loss,
tokens/s), checkpoints every `checkpoint_every` steps, and resumes from the last checkpoint. The trained
model is saved as a normal HF folder, which `--model FOLDER --method layerskip` (or any method) loads.
`exit_accuracy` measures, per layer, how often the exit's top-1 is the next token and agrees with the last
layer's. The CLI reports it before and after training.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import torch

from accelgen.atomic import (load_tensors, load_torch, save_pretrained_atomically, torch_save_atomically,
                             write_json_atomically)
from accelgen.models.layerwise import exit_logits, layer_outputs, llama_decoder
from accelgen.train.checkpoints import checkpoint_due

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
            raise ValueError(f"curriculum must be one of {', '.join(CURRICULA)}, not {self.curriculum!r}")
        if min(self.steps, self.batch_size, self.seq_len, self.rotation, self.checkpoint_every) < 1:
            raise ValueError("steps, batch size, sequence length, rotation and checkpoint interval must be positive")
        if not 0.0 <= self.p_max < 1.0:
            raise ValueError(f"p_max must be in [0, 1), got {self.p_max}")


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
        raise ValueError(f"the dataset gave {len(stream)} tokens, fewer than one window of {seq_len}")
    usable = len(stream) // seq_len * seq_len
    return torch.tensor(stream[:usable], dtype=torch.long).view(-1, seq_len)[:count]


def layerskip_loss(model, windows: torch.Tensor, dropout_rates: list[float], weights: list[float],
                   generator: torch.Generator) -> tuple[torch.Tensor, dict[int, float]]:
    """The weighted early-exit loss over windows (b, n), with layer dropout; also each enabled layer's loss."""
    decoder = llama_decoder(model, "LayerSkip training")
    targets = windows[:, 1:].reshape(-1).to(model.device)
    total, per_layer = 0.0, {}
    dropped = lambda index: torch.rand(windows.shape[0], generator=generator) < dropout_rates[index]  # noqa: E731
    for index, hidden in enumerate(layer_outputs(model, decoder, windows, passed_over=dropped)):
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
                    progress: Callable[[dict], None] | None = None) -> dict:
    """Fine-tune `model` in place on windows (count, seq_len), resuming from out_dir's checkpoint if there is
    one; the model and tokenizer are saved to out_dir every `checkpoint_every` steps and at the end."""
    out_dir = Path(out_dir)
    layer_count = model.config.num_hidden_layers
    rates = layer_dropout_rates(layer_count, config.p_max)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.learning_rate)
    start = resume(model, optimizer, out_dir, config)
    generator = torch.Generator().manual_seed(config.seed + start)  # each resumed step draws its own dropout
    model.train()
    started, tokens = time.perf_counter(), 0
    for step in range(start, config.steps):
        first = step * config.batch_size % len(windows)
        batch = windows[first : first + config.batch_size]
        weights = exit_loss_weights(layer_count, step, config.steps, config)
        loss, per_layer = layerskip_loss(model, batch, rates, weights, generator)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        tokens += batch.numel()
        if checkpoint_due(step + 1, config):
            save_checkpoint(model, tokenizer, optimizer, out_dir, step + 1, config)
        if progress is not None:
            progress({"step": step + 1, "steps": config.steps, "loss": float(loss.detach()), "exit_losses": per_layer,
                      "tokens_per_second": tokens / (time.perf_counter() - started)})
    model.eval()
    return {"steps": config.steps, "resumed_at": start, "seconds": time.perf_counter() - started}


def resume(model, optimizer, out_dir: Path, config: LayerSkipConfig) -> int:
    """The step to continue from: 0, or the checkpoint's (its weights and optimizer state loaded)."""
    trainer = out_dir / TRAINER_FILE
    if not trainer.exists():
        return 0
    state = load_torch(trainer, f"delete it and rerun `accelgen train layerskip --out {out_dir}` to start over")
    if state["config"] != asdict(config) | {"steps": state["config"]["steps"]}:
        raise ValueError(f"{out_dir} holds a checkpoint trained with other settings; use another --out")
    weights = state["model"] if "model" in state else model_files_weights(out_dir)
    missing = model.load_state_dict(weights, strict=False).missing_keys
    if [key for key in missing if not (key == "lm_head.weight" and model.config.tie_word_embeddings)]:
        raise ValueError(f"the checkpoint in {out_dir} does not fit this model (missing {missing[:3]} ...)")
    optimizer.load_state_dict(state["optimizer"])
    return state["step"]


def model_files_weights(out_dir: Path) -> dict:
    """The weights of the model files in out_dir: where checkpoints written before trainer.pt held them were."""
    weights = {}
    for shard in sorted(out_dir.glob("*.safetensors")):
        weights.update(load_tensors(shard, f"delete {out_dir / TRAINER_FILE} to train from the start"))
    return weights


def save_checkpoint(model, tokenizer, optimizer, out_dir: Path, step: int, config: LayerSkipConfig) -> None:
    """trainer.pt first, whole in one atomic file (weights, optimizer state, step, settings): what a rerun resumes
    from, whenever the run was killed. Then the model folder (each file atomic, config.json last) and layerskip.json."""
    torch_save_atomically(out_dir / TRAINER_FILE, {"step": step, "optimizer": optimizer.state_dict(),
                                                   "config": asdict(config), "model": model.state_dict()})
    save_pretrained_atomically(out_dir, model, tokenizer)
    write_json_atomically(out_dir / "layerskip.json", {"step": step, **asdict(config)})

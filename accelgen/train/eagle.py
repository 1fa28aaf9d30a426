"""Training an EAGLE head (heads/eagle.py) on this CPU, with the target frozen.

`accelgen train eagle` works in three stages:

1. **Cache.** The frozen target runs once over packed windows of the dataset. Their features and the target's
   own next-token choices are saved in the out folder (`features.safetensors`), and a rerun reuses them.
2. **Training.** The head trains on whole windows, fed the target's true features (teacher forcing) with a
   little uniform noise, as EAGLE does. The loss is smooth-L1 between the predicted and true features, plus
   `ce_weight` × the cross-entropy of the LM head on the predicted feature against the target's choice.
   The cross-entropy is taken on `ce_positions` random positions per step: the 152k-wide LM head is the
   costliest part on a CPU. Checkpoints (head and optimizer) are saved every `checkpoint_every` steps, and a
   rerun resumes from the last one.
3. **Draft vocabulary.** The head drafts from the `draft_vocab` tokens most frequent in the data and the
   target's choices (FR-Spec's idea). On a CPU the LM head is most of a draft step's cost: Qwen2.5's is 152k
   tokens wide, while 16k tokens carry nearly all of the text. Greedy and sampling stay exact, because
   verification decides.
4. **Evaluation.** Held-out windows give the head's top-1 and top-5 accuracy against the target's choice,
   and the share of those choices that lie in the draft vocabulary.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from accelgen.atomic import CorruptFileError, load_tensors, save_tensors_atomically
from accelgen.heads.eagle import EagleHead, new_head
from accelgen.heads.lm_head import draft_vocabulary
from accelgen.models.block import Block
from accelgen.train.checkpoints import resume, run_settings, save_checkpoint
CHECKPOINT = "eagle_trainer.pt"  # head, optimizer state and step, while training
FEATURES = "features.safetensors"  # the target's features and choices over the training windows


def whole_windows(length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions (1, length), causal additive mask (1, 1, length, length)): the head over whole windows."""
    block = Block.chain(0, length)
    return block.positions[None], block.mask(torch.float32, "cpu")


@torch.no_grad()
def collect_features(model, windows: torch.Tensor, progress: Callable[[int], None] | None = None):
    """(features (count, n, d) in the model's dtype, choices (count, n) long) over windows (count, n): the
    target's last hidden states after its final norm, and its greedy next-token choice at each position."""
    features, choices = [], []
    for index, window in enumerate(windows):
        hidden = model.model(input_ids=window[None].to(model.device)).last_hidden_state[0]
        features.append(hidden.cpu())
        choices.append(model.get_output_embeddings()(hidden).argmax(-1).cpu())
        if progress is not None:
            progress(index + 1)
    return torch.stack(features), torch.stack(choices)


def cached_features(model, windows: torch.Tensor, folder: Path, progress: Callable[[int], None] | None = None):
    """collect_features, saved in folder (atomically) and reused by a later run over the same windows."""
    path = Path(folder) / FEATURES
    saved = saved_features(path, windows, model.config.hidden_size)
    if saved is not None:
        return saved
    features, choices = collect_features(model, windows, progress)
    save_tensors_atomically(path, {"windows": windows, "features": features, "choices": choices})
    return features, choices


def saved_features(path: Path, windows: torch.Tensor, hidden_size: int):
    """(features, choices) from the cache at path if it holds those of these windows at this width, else None.
    An unreadable cache is None too, with a warning naming it: a damaged cache is computed again, never trusted."""
    if not path.exists():
        return None
    try:
        saved = load_tensors(path, "computing the features again")
    except CorruptFileError as error:
        print(f"accelgen: {error}", file=sys.stderr)
        return None
    fits = {"windows", "features", "choices"} <= saved.keys() and torch.equal(saved["windows"], windows)
    return (saved["features"], saved["choices"]) if fits and saved["features"].shape[-1] == hidden_size else None


@dataclass
class EagleConfig:
    steps: int = 600
    batch_size: int = field(default=4, metadata={"help": "Windows per step."})
    learning_rate: float = 5e-4
    ce_weight: float = field(default=0.1, metadata={"help": "Weight of the cross-entropy beside the feature loss."})
    ce_positions: int = field(default=256, metadata={"help": "Positions per step in the cross-entropy."})
    draft_vocab: int = field(default=16384, metadata={"help": "Tokens the head drafts from: the most frequent "
                                                              "(0: the whole vocabulary)."})
    noise: float = field(default=0.1, metadata={"help": "Half-width of the uniform noise on the input features."})
    checkpoint_every: int = 100

    def __post_init__(self):
        if min(self.steps, self.batch_size, self.ce_positions, self.checkpoint_every) < 1 or self.learning_rate <= 0:
            raise ValueError("steps, batch size, cross-entropy positions, checkpoint interval and learning rate "
                             "must be positive")
        if self.draft_vocab < 0:
            raise ValueError(f"draft_vocab must be >= 0 (0: the whole vocabulary), got {self.draft_vocab}")


def train_eagle(model, windows: torch.Tensor, features: torch.Tensor, choices: torch.Tensor, config: EagleConfig,
                out_dir=None, seed: int = 0, progress: Callable[[dict], None] | None = None) -> tuple[EagleHead, dict]:
    """Train a head on windows (count, n), the target's features (count, n, d) and choices (count, n); with
    out_dir, checkpointed there and resumed from its checkpoint. Returns (head, {"resumed_at", "seconds"})."""
    head = new_head(model)
    optimizer = torch.optim.AdamW(head.parameters(), lr=config.learning_rate)
    checkpoint = None if out_dir is None else Path(out_dir) / CHECKPOINT
    start = resume(head, optimizer, checkpoint, run_settings(config), "EAGLE")
    embed, lm_head = model.get_input_embeddings(), model.get_output_embeddings()
    generator = torch.Generator().manual_seed(seed + start)
    length = windows.shape[1] - 1  # input pairs (f_t, x_{t+1}) per window
    positions, mask = whole_windows(length)
    started = time.perf_counter()
    for step in range(start, config.steps):
        rows = torch.randint(0, len(windows), (min(config.batch_size, len(windows)),), generator=generator)
        true = features[rows].float()  # (b, n, d)
        inputs = true[:, :-1] + (torch.rand(true[:, :-1].shape, generator=generator) * 2 - 1) * config.noise
        with torch.no_grad():
            token_embeds = embed(windows[rows, 1:].to(model.device)).float()
        predicted = head(token_embeds, inputs, positions, mask)  # (b, n-1, d): f_{t+1}
        regression = torch.nn.functional.smooth_l1_loss(predicted, true[:, 1:])
        picked = torch.randint(0, predicted.shape[0] * length, (config.ce_positions,), generator=generator)
        logits = lm_head(predicted.reshape(-1, predicted.shape[-1])[picked].to(lm_head.weight.dtype)).float()
        goal = choices[rows, 1:].reshape(-1)[picked]
        loss = regression + config.ce_weight * torch.nn.functional.cross_entropy(logits, goal)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if checkpoint is not None and ((step + 1) % config.checkpoint_every == 0 or step + 1 == config.steps):
            save_checkpoint(checkpoint, step + 1, run_settings(config), head, optimizer)
        if progress is not None:
            seconds = time.perf_counter() - started
            progress({"step": step + 1, "steps": config.steps, "loss": float(loss.detach()),
                      "regression": float(regression.detach()),
                      "accuracy": float((logits.argmax(-1) == goal).float().mean()), "seconds": seconds,
                      "tokens_per_second": (step + 1 - start) * len(rows) * length / seconds})
    if config.draft_vocab:
        head.vocab = draft_vocabulary(windows, choices, model.config.vocab_size, config.draft_vocab)
    return head.eval(), {"resumed_at": start, "seconds": time.perf_counter() - started}


@torch.no_grad()
def evaluate_eagle(model, head: EagleHead, windows: torch.Tensor, features: torch.Tensor, choices: torch.Tensor,
                   top_k: int = 5) -> dict:
    """On windows not trained on: how often the head's top-1, and its top-k, hold the target's own next choice."""
    head = head.float()
    length = windows.shape[1] - 1
    positions, mask = whole_windows(length)
    top1 = topk = covered = 0.0
    drafted = torch.zeros(model.config.vocab_size, dtype=torch.bool)
    drafted[head.vocab if len(head.vocab) else slice(None)] = True
    for window, feature, choice in zip(windows, features, choices):
        predicted = head(model.get_input_embeddings()(window[None, 1:]).float(), feature[None, :-1].float(),
                         positions, mask)[0]
        logits = model.get_output_embeddings()(predicted.to(model.dtype)).float()  # (n-1, vocab)
        goal = choice[1:, None]
        top1 += float((logits.argmax(-1, keepdim=True) == goal).float().sum())
        topk += float((logits.topk(top_k, dim=-1).indices == goal).any(-1).float().sum())
        covered += float(drafted[choice[1:]].float().sum())
    positions_seen = len(windows) * length
    return {"top1": top1 / positions_seen, f"top{top_k}": topk / positions_seen, "positions": positions_seen,
            "draft_vocab": len(head.vocab), "choices_in_draft_vocab": covered / positions_seen}

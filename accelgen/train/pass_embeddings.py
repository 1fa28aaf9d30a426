"""Training PaSS look-ahead embeddings (heads/pass_embeddings.py) with the target frozen, through the shared
training loop (train/loop.py). Only the k × d look-ahead weights train; the model is untouched.

Training (`accelgen train pass`), per step and for a batch of packed windows of the dataset:

1. The frozen target runs over the windows once, without gradients, filling a KV cache. Its greedy choice at
   each position is the label: what the slots must guess is the target's own next token, not the dataset's.
2. At `cuts` random positions t per window, the k slots are appended as t + 1 .. t + k: each group sees the
   window up to t and its own earlier slots (one attention mask for all groups), so the real tokens' cache is
   shared and only the slots' rows carry gradients.
3. Slot i at t is trained, by cross-entropy, to give the target's choice at position t + 1 + i.

Held-out windows give each slot's top-1 accuracy, and the mean number of slots accepted in a row.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable

import torch

from accelgen import cache as kv
from accelgen.errors import InputError
from accelgen.heads.pass_embeddings import LookaheadEmbeddings
from accelgen.models.layerwise import llama_decoder
from accelgen.models.block import blocking_mask
from accelgen.train.loop import ScaleOut, run_training, step_generator, training_device


def new_embeddings(model, count: int, seed: int = 0) -> LookaheadEmbeddings:
    """k slots starting near the mean token embedding (a "typical token"), each nudged apart at random."""
    embeddings = LookaheadEmbeddings(count, model.config.hidden_size, model.config.vocab_size,
                                     str(getattr(model, "name_or_path", "")), model.config.num_hidden_layers)
    table = model.get_input_embeddings().weight.detach().float()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        noise = torch.randn(count, table.shape[1], generator=generator) * table.std(0) * 0.1
        embeddings.vectors.copy_(table.mean(0) + noise)
    return embeddings


def lookahead_layout(cuts: torch.Tensor, count: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions (c·k,), allowed (c·k, length + c·k) bool) of k slots appended after each cut of cuts (c,) in a
    window of `length` tokens: the slots of a cut see the window up to it and their own group's earlier slots."""
    slot = torch.arange(count).repeat(len(cuts))  # (c·k,) slot index i
    cut = cuts.repeat_interleave(count)  # (c·k,) the cut t of each row
    sees_window = torch.arange(length)[None, :] <= cut[:, None]
    sees_slot = (cut[:, None] == cut[None, :]) & (slot[None, :] <= slot[:, None])
    return cut + 1 + slot, torch.cat([sees_window, sees_slot], dim=1)


def random_cuts(length: int, count: int, cuts: int, generator: torch.Generator, min_context: int = 4) -> torch.Tensor:
    """(c,) distinct sorted positions t with room for k slots whose labels lie inside the window."""
    last = length - count - 1  # slot k-1 at t + k needs the target's choice at t + k <= length - 1
    if last < min_context:
        raise InputError(f"windows of {length} tokens are too short for {count} look-ahead slots")
    picked = torch.randperm(last - min_context + 1, generator=generator)[:cuts] + min_context
    return picked.sort().values


def slot_logits(model, embeddings: LookaheadEmbeddings, windows: torch.Tensor, cuts: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits (b, c·k, vocab) float32 of the slots appended at cuts (b, c) of windows (b, n), with gradients to the
    embeddings; labels (b, c·k): the target's own greedy choice at each slot's position)."""
    decoder = llama_decoder(model, "PaSS")
    lm_head = model.get_output_embeddings()
    count, length = len(embeddings), windows.shape[1]
    layouts = [lookahead_layout(row_cuts, count, length) for row_cuts in cuts.cpu()]  # built on the CPU
    positions = torch.stack([positions for positions, _ in layouts])  # (b, c·k)
    with torch.no_grad():
        cache = kv.new_cache(model.config)
        hidden = decoder(input_ids=windows.to(model.device), use_cache=True, **{kv.cache_keyword(decoder): cache}).last_hidden_state
        rows = hidden[torch.arange(len(windows))[:, None], positions]  # (b, c·k, d) the rows that choose the labels
        labels = lm_head(rows).argmax(-1)
    masks = torch.stack([blocking_mask(allowed, model.dtype)[None] for _, allowed in layouts])  # (b, 1, c·k, n + c·k)
    inputs = embeddings.vectors.to(model.dtype).repeat(len(cuts), cuts.shape[1], 1)  # (b, c·k, d)
    slots = decoder(inputs_embeds=inputs, position_ids=positions.to(model.device), attention_mask=masks.to(model.device),
                    use_cache=True, **{kv.cache_keyword(decoder): cache}).last_hidden_state
    return lm_head(slots).float(), labels


@dataclass
class PassConfig:
    count: int = field(default=4, metadata={"help": "Look-ahead embeddings: slot i guesses the token i + 2 ahead.",
                                            "names": ("-k",)})
    steps: int = 200
    batch_size: int = field(default=2, metadata={"help": "Windows per step."})
    cuts: int = field(default=16, metadata={"help": "Positions per window the slots are appended at."})
    learning_rate: float = 3e-3

    def __post_init__(self):
        if min(self.count, self.steps, self.batch_size, self.cuts) < 1 or self.learning_rate <= 0:
            raise InputError("look-ahead slots, steps, batch size, cuts and learning rate must be positive")


def train_pass(model, windows: torch.Tensor, config: PassConfig, seed: int = 0,
               progress: Callable[[dict], None] | None = None, scale: ScaleOut | None = None) -> LookaheadEmbeddings:
    """Train k look-ahead embeddings for the frozen model on windows (count, n); scale: processes, precision,
    accumulation (train/loop.py)."""
    embeddings = new_embeddings(model, config.count, seed)
    optimizer = torch.optim.Adam(embeddings.parameters(), lr=config.learning_rate)
    model.to(training_device(scale))
    batch_size = min(config.batch_size, len(windows))

    def draw(step: int) -> dict:
        return windows_with_cuts(windows, batch_size, config.count, config.cuts, step_generator(seed, step))

    def loss_of(batch: dict) -> tuple[torch.Tensor, dict]:
        return lookahead_loss(*slot_logits(model, embeddings, batch["windows"], batch["cuts"]), config.count)

    with frozen(model):
        run_training(embeddings, optimizer, config.steps, draw, loss_of, scale=scale,
                     tokens_per_row=config.cuts * config.count, progress=progress)
    return embeddings.eval()


def windows_with_cuts(windows: torch.Tensor, batch_size: int, count: int, cuts: int,
                      generator: torch.Generator) -> dict:
    """A step's batch: {"windows": (b, n) drawn from windows (count, n), "cuts": (b, c) the positions k slots are
    appended at in each}."""
    rows = torch.randint(0, len(windows), (batch_size,), generator=generator)
    picked = torch.stack([random_cuts(windows.shape[1], count, cuts, generator) for _ in rows])
    return {"windows": windows[rows], "cuts": picked}


def lookahead_loss(logits: torch.Tensor, labels: torch.Tensor, count: int) -> tuple[torch.Tensor, dict]:
    """(mean cross-entropy, {"accuracy": top-1 of each of the k slots}) of the slots' logits (b, c·k, vocab) against
    their labels (b, c·k)."""
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
    right = (logits.argmax(-1) == labels).float().reshape(-1, count)  # (b·c, k)
    return loss, {"accuracy": right.mean(0).tolist()}


@contextlib.contextmanager
def frozen(model):
    """The model's weights without gradients (only what is appended to it trains), given back after."""
    trainable = [parameter for parameter in model.parameters() if parameter.requires_grad]
    for parameter in trainable:
        parameter.requires_grad_(False)
    try:
        yield
    finally:
        for parameter in trainable:
            parameter.requires_grad_(True)


@torch.no_grad()
def evaluate_pass(model, embeddings: LookaheadEmbeddings, windows: torch.Tensor, cuts: int = 16, seed: int = 1) -> dict:
    """On windows not trained on: each slot's top-1 against the target's choice, and the mean number of slots
    right in a row (what a greedy draft of the next token + the slots would get accepted beyond the first)."""
    generator = torch.Generator().manual_seed(seed)
    count = len(embeddings)
    right = []
    for window in windows:
        window_cuts = random_cuts(len(window), count, cuts, generator)[None]
        logits, labels = slot_logits(model, embeddings, window[None], window_cuts)
        right.append((logits.argmax(-1) == labels).reshape(-1, count))
    right = torch.cat(right).float()  # (positions, k)
    in_a_row = right.cumprod(dim=1).sum(dim=1)
    return {"top1": [float(a) for a in right.mean(0)], "mean_slots_in_a_row": float(in_a_row.mean()),
            "positions": len(right)}

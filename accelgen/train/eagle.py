"""Training an EAGLE head (heads/eagle.py), with the target frozen.

`accelgen train eagle` works in three stages:

1. **Features.** The frozen target runs once over packed windows of the dataset. Their features and the target's
   own next-token choices go to the sharded feature store in the out folder (train/shards.py, `features/`),
   which a stopped extraction resumes and a rerun reuses.
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

That is the `eagle1` recipe. The `eagle3` recipe (EAGLE-3, arXiv:2503.01840; heads/eagle3.py) differs thus:

- the features are the target's residual stream entering three of its layers (`collect_layer_states`);
- the draft vocabulary is chosen first: the head's own LM head computes those rows only (d2t / t2d);
- **training-time test**: the head is unrolled `ttt_steps` times on its own outputs (`unrolled_outputs`), as it
  drafts. Step k at position t reads the token x_{t+k+1} and the head's step k-1 output there, sits at position
  t + k, attends to the true pairs up to t and to its own earlier steps at t (the chain a draft at depth k + 1
  sees), and is taught the target's choice after x_{t+k+1}. The loss is sum_k ttt_decay^k × cross-entropy; there
  is no feature regression.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from accelgen import cache as kv
from accelgen.errors import InputError
from accelgen.heads.eagle import EagleHead, new_head
from accelgen.heads.eagle3 import Eagle3Head, default_target_layers, new_eagle3_head
from accelgen.heads.lm_head import DraftLMHead, draft_vocabulary
from accelgen.models.block import Block, blocking_mask
from accelgen.train.checkpoints import run_settings
from accelgen.train.loop import Checkpointing, ScaleOut, run_training, step_generator, training_device

CHECKPOINT = "eagle_trainer.pt"  # head, optimizer state and step, while training


def whole_windows(length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions (1, length), causal additive mask (1, 1, length, length)): the head over whole windows."""
    block = Block.chain(0, length)
    return block.positions[None], block.mask(torch.float32, "cpu")


@torch.no_grad()
def collect_features(model, windows: torch.Tensor, progress: Callable[[int], None] | None = None):
    """(features (count, n, d) in the model's dtype, choices (count, n) long) over windows (count, n): the
    target's last hidden states after its final norm, and its greedy next-token choice at each position. One
    forward for all the windows (the feature store passes a shard's worth), the choices a window at a time: the
    logits of them all would be vocab × count × n large."""
    hidden = model.model(input_ids=windows.to(model.device)).last_hidden_state  # (count, n, d)
    choices = torch.stack([model.get_output_embeddings()(window).argmax(-1) for window in hidden])
    if progress is not None:
        progress(len(windows))
    return hidden.cpu(), choices.cpu()


@torch.no_grad()
def collect_layer_states(model, windows: torch.Tensor, layers: tuple[int, ...],
                         progress: Callable[[int], None] | None = None):
    """(states (count, n, len(layers) * d) in the model's dtype, choices (count, n) long) over windows (count, n):
    the residual stream entering each of layers (HF's hidden_states[i]) side by side, and the target's greedy
    next-token choices (as collect_features: one forward, the choices a window at a time)."""
    output = model.model(input_ids=windows.to(model.device), output_hidden_states=True)
    states = torch.cat([output.hidden_states[layer] for layer in layers], dim=-1)  # (count, n, 3d)
    choices = torch.stack([model.get_output_embeddings()(window).argmax(-1) for window in output.last_hidden_state])
    if progress is not None:
        progress(len(windows))
    return states.cpu(), choices.cpu()


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
    recipe: str = field(default="eagle1", metadata={"help": "eagle1 (EAGLE-1: the target's final features, feature "
                                                            "regression) or eagle3 (EAGLE-3: three layers fused, "
                                                            "training-time test, its own draft LM head)."})
    ttt_steps: int = field(default=7, metadata={"help": "eagle3: steps the head is unrolled on its own outputs."})
    ttt_decay: float = field(default=0.8, metadata={"help": "eagle3: weight of unrolled step k's loss is decay^k."})
    warmup_steps: int = field(default=0, metadata={"help": "Steps over which the learning rate rises linearly to "
                                                           "its value (e.g. 20 with --resume-from: a fresh "
                                                           "optimizer on trained weights)."})

    def __post_init__(self):
        if min(self.steps, self.batch_size, self.ce_positions, self.checkpoint_every) < 1 or self.learning_rate <= 0:
            raise InputError("steps, batch size, cross-entropy positions, checkpoint interval and learning rate "
                             "must be positive")
        if self.draft_vocab < 0:
            raise InputError(f"draft_vocab must be >= 0 (0: the whole vocabulary), got {self.draft_vocab}")
        if self.recipe not in ("eagle1", "eagle3"):
            raise InputError(f"recipe must be one of eagle1, eagle3, got {self.recipe!r}")
        if self.warmup_steps < 0:
            raise InputError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.ttt_steps < 1 or not 0 < self.ttt_decay <= 1:
            raise InputError(f"ttt_steps must be >= 1 and ttt_decay in (0, 1], got {self.ttt_steps}, {self.ttt_decay}")


def target_layers_for(model) -> tuple[int, int, int]:
    """The three layers an EAGLE-3 head of this target reads."""
    return default_target_layers(model.config.num_hidden_layers)


# --- training-time test: the head unrolled on its own outputs ------------------------------------------------


def unrolled_mask(length: int, step: int, dtype=torch.float32) -> torch.Tensor:
    """(1, 1, length - step, length + sum_{s=1..step} (length - s)) additive mask of unrolled step `step` (0: the
    teacher-forced pass), its keys cached after those of steps 0..step-1: row t sees step 0's positions <= t and
    its own position t at each later step (the chain of a draft at depth step + 1)."""
    rows = torch.arange(length - step)
    parts = [rows[:, None] >= torch.arange(length)[None]]
    parts += [rows[:, None] == torch.arange(length - s)[None] for s in range(1, step + 1)]
    return blocking_mask(torch.cat(parts, dim=1), dtype)[None, None]


def unrolled_outputs(head, token_embeds: torch.Tensor, first: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """The head's outputs at each of `steps` unrolled steps (at most the window's length): [(b, L - k, d)] for
    k < steps, from token_embeds (b, L, d) of x_1..x_L and first (b, L, d), its input at step 0 (the target's
    features at 0..L-1, fused for EAGLE-3). Step k at position t reads x_{t+k+1} and step k-1's output at t, at
    position t + k; its output is the head's guess at the feature that chooses x_{t+k+2}."""
    length = first.shape[1]
    cache = kv.new_cache(head.config)  # the keys and values of every step so far
    outputs, hidden = [], first
    for step in range(min(steps, length)):
        rows = length - step
        positions = (torch.arange(rows) + step)[None].to(first.device)
        mask = unrolled_mask(length, step, hidden.dtype).to(first.device)
        output = head(token_embeds[:, step : step + rows], hidden[:, :rows], positions, mask, cache)
        outputs.append(output)
        hidden = output[:, : rows - 1]
    return outputs


def depth_labels(labels: torch.Tensor, step: int, rows: int) -> torch.Tensor:
    """(b, rows) what unrolled step `step` is taught from labels (b, n): the target's choice after x_{t+step+1}."""
    return labels[:, step + 1 : step + 1 + rows]


def ttt_loss(head: Eagle3Head, token_embeds: torch.Tensor, states: torch.Tensor, labels: torch.Tensor, steps: int,
             decay: float) -> tuple[torch.Tensor, list[float]]:
    """(sum_k decay^k × cross-entropy of step k, top-1 accuracy per step) over windows: token_embeds (b, n-1, d) of
    x_1..x_{n-1}, states (b, n, 3d) the target's three layers, labels (b, n) its choices as draft ids (-100:
    outside the draft vocabulary, left out)."""
    outputs = unrolled_outputs(head, token_embeds, head.fuse(states[:, :-1]), steps)
    total, accuracy = 0.0, []
    for step, output in enumerate(outputs):
        logits = head.draft_logits(output)  # (b, rows, V')
        goal = depth_labels(labels, step, output.shape[1]).reshape(-1)
        flat = logits.reshape(-1, logits.shape[-1])
        counted = max(int((goal != -100).sum()), 1)
        total = total + decay ** step * torch.nn.functional.cross_entropy(flat, goal, reduction="sum") / counted
        accuracy.append(float((flat.argmax(-1) == goal).float().sum()) / counted)
    return total, accuracy


def train_eagle(model, windows: torch.Tensor, features: torch.Tensor, choices: torch.Tensor, config: EagleConfig,
                out_dir=None, seed: int = 0, progress: Callable[[dict], None] | None = None,
                on_step: Callable[[int, Callable], None] | None = None,
                scale: ScaleOut | None = None, start_head: EagleHead | None = None) -> tuple[EagleHead, dict]:
    """Train a head on windows (count, n), the target's features (count, n, d; eagle3: its three layers' states,
    (count, n, 3d)) and choices (count, n); with out_dir, checkpointed there and resumed from its checkpoint.
    on_step(step, drafting_head) is called after each step; drafting_head() gives the head as it would be saved
    (learning curves). scale: processes, precision, accumulation (train/loop.py). start_head: a trained head of
    the recipe (`load_start_head`) to go on training, its draft vocabulary kept, in place of a new one.
    Returns (head, {"resumed_at", "seconds", "processes"})."""
    if config.recipe == "eagle3":
        return train_eagle3(model, windows, features, choices, config, out_dir, seed, progress, on_step, scale,
                            start_head)
    if start_head is not None:
        head, vocab = start_head, (start_head.vocab if len(start_head.vocab) else None)
        head.vocab = torch.zeros(0, dtype=torch.long)  # the checkpoints hold the head without its vocabulary
    else:
        head = new_head(model)
        vocab = (draft_vocabulary(windows, choices, model.config.vocab_size, config.draft_vocab)
                 if config.draft_vocab else None)
    optimizer = torch.optim.AdamW(head.parameters(), lr=config.learning_rate)
    device = training_device(scale)
    model.to(device)
    embed, lm_head = model.get_input_embeddings(), model.get_output_embeddings()
    length = windows.shape[1] - 1  # input pairs (f_t, x_{t+1}) per window
    positions, mask = (tensor.to(device) for tensor in whole_windows(length))
    batch_size = min(config.batch_size, len(windows))
    per_window = -(-config.ce_positions // batch_size)  # cross-entropy positions drawn in each window

    def draw(step: int) -> dict:
        generator = step_generator(seed, step)
        rows = torch.randint(0, len(windows), (batch_size,), generator=generator)
        noise = (torch.rand((batch_size, length, features.shape[-1]), generator=generator) * 2 - 1) * config.noise
        picked = torch.randint(0, length, (batch_size, per_window), generator=generator)
        return {"tokens": windows[rows, 1:], "features": features[rows], "noise": noise, "picked": picked,
                "choices": choices[rows, 1:]}

    def loss_of(batch: dict) -> tuple[torch.Tensor, dict]:
        true = batch["features"].float()  # (b, n, d)
        with torch.no_grad():
            token_embeds = embed(batch["tokens"]).float()
        predicted = head(token_embeds, true[:, :-1] + batch["noise"], positions, mask)  # (b, n-1, d): f_{t+1}
        regression = torch.nn.functional.smooth_l1_loss(predicted, true[:, 1:])
        picked = predicted.gather(1, batch["picked"][..., None].expand(-1, -1, predicted.shape[-1]))  # (b, p, d)
        logits = lm_head(picked.reshape(-1, picked.shape[-1]).to(lm_head.weight.dtype)).float()
        goal = batch["choices"].gather(1, batch["picked"]).reshape(-1)
        loss = regression + config.ce_weight * torch.nn.functional.cross_entropy(logits, goal)
        return loss, {"regression": float(regression.detach()),
                      "accuracy": float((logits.argmax(-1) == goal).float().mean())}

    times = run_training(head, optimizer, config.steps, draw, loss_of, scale=scale, warmup_steps=config.warmup_steps,
                         checkpointing=checkpointing_of(config, out_dir, "EAGLE"), max_grad_norm=0.5,
                         tokens_per_row=length, progress=progress,
                         after_step=None if on_step is None else
                         lambda step: on_step(step, lambda: with_vocabulary(head, vocab)))
    return with_vocabulary(head, vocab).eval(), times


def load_start_head(folder, model, config: EagleConfig):
    """The head saved in folder, in float32 on the CPU, to go on training for `model` with config: refused by
    name where it does not fit the model, is of another recipe, or reads other layers than config would train."""
    from accelgen.heads.io import check_fits

    head = EagleHead.load(folder)
    check_fits(head.describe_shape(), model, f"the head in {folder} (trained for {head.base_model or 'another model'})")
    if head.recipe != config.recipe:
        raise InputError(f"the head in {folder} is an {head.recipe} head; resume it with --recipe {head.recipe}")
    if head.target_layers is not None and tuple(head.target_layers) != target_layers_for(model):
        raise InputError(f"the head in {folder} reads layers {list(head.target_layers)}, this trainer's features "
                         f"are layers {list(target_layers_for(model))}")
    return head.float().train()


def checkpointing_of(config: EagleConfig, out_dir, what: str) -> Checkpointing:
    """The head's checkpoint in out_dir (None: none), resumed only with the same config."""
    return Checkpointing(None if out_dir is None else Path(out_dir) / CHECKPOINT, run_settings(config), what,
                         config.checkpoint_every)


def with_vocabulary(head: EagleHead, vocab: torch.Tensor | None) -> EagleHead:
    """A copy of the EAGLE-1 head drafting from vocab (None: the head itself, drafting from the whole vocabulary).
    The vocabulary is set on a copy: the checkpoints hold the head without it."""
    if vocab is None:
        return head
    import copy

    drafting = copy.deepcopy(head)
    drafting.vocab = vocab
    return drafting


def train_eagle3(model, windows: torch.Tensor, states: torch.Tensor, choices: torch.Tensor, config: EagleConfig,
                 out_dir=None, seed: int = 0, progress: Callable[[dict], None] | None = None,
                 on_step: Callable[[int, Callable], None] | None = None,
                 scale: ScaleOut | None = None, start_head: Eagle3Head | None = None) -> tuple[Eagle3Head, dict]:
    """The eagle3 recipe of train_eagle: states (count, n, 3d) are the target's three layers (collect_layer_states
    at target_layers_for(model)); the loss is ttt_loss."""
    width = 3 * model.config.hidden_size
    if states.shape[-1] != width:
        raise InputError(f"EAGLE-3 trains on three layers' states side by side ({width} wide), got {states.shape[-1]}: "
                         f"collect them with collect_layer_states")
    if start_head is not None:
        head = start_head
    else:
        vocab = draft_vocabulary(windows, choices, model.config.vocab_size,
                                 config.draft_vocab or model.config.vocab_size)
        head = new_eagle3_head(model, vocab, target_layers_for(model))
    optimizer = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=config.learning_rate)
    labels = head.label_index(choices)  # (count, n) draft ids, -100 outside the draft vocabulary
    model.to(training_device(scale))
    embed = model.get_input_embeddings()
    batch_size = min(config.batch_size, len(windows))

    def draw(step: int) -> dict:
        rows = torch.randint(0, len(windows), (batch_size,), generator=step_generator(seed, step))
        return {"tokens": windows[rows, 1:], "states": states[rows], "labels": labels[rows]}

    def loss_of(batch: dict) -> tuple[torch.Tensor, dict]:
        with torch.no_grad():
            token_embeds = embed(batch["tokens"]).float()
        loss, accuracy = ttt_loss(head, token_embeds, batch["states"].float(), batch["labels"], config.ttt_steps,
                                  config.ttt_decay)
        return loss, {"regression": 0.0, "accuracy": accuracy[0], "accuracy_per_step": accuracy}

    times = run_training(head, optimizer, config.steps, draw, loss_of, scale=scale, warmup_steps=config.warmup_steps,
                         checkpointing=checkpointing_of(config, out_dir, "EAGLE-3"), max_grad_norm=0.5,
                         tokens_per_row=windows.shape[1] - 1, progress=progress,
                         after_step=None if on_step is None else lambda step: on_step(step, lambda: head))
    return head.eval(), times


@torch.no_grad()
def depth_accuracy(model, head, windows: torch.Tensor, features: torch.Tensor, choices: torch.Tensor,
                   depths: int) -> list[float]:
    """Per draft depth 1..depths, on windows (count, n) with the target's features (count, n, d or 3d) and choices:
    how often the head's top-1, unrolled on its own outputs as when it drafts, is the target's choice."""
    was_training = head.training
    head.eval()
    readout = (DraftLMHead(model.get_output_embeddings(), head.vocab) if head.target_layers is None
               else head.vocab_logits)  # EAGLE-1 reads through the target's LM head, EAGLE-3 through its own
    hits, seen = torch.zeros(depths), torch.zeros(depths)
    for window, feature, choice in zip(windows, features, choices):
        token_embeds = model.get_input_embeddings()(window[None, 1:].to(model.device)).float()
        first = head.fuse(feature[None, :-1].float().to(model.device)).float()
        for step, output in enumerate(unrolled_outputs(head.float(), token_embeds, first, depths)):
            goal = depth_labels(choice[None], step, output.shape[1]).to(model.device)
            hits[step] += float((readout(output).argmax(-1) == goal).sum())
            seen[step] += goal.numel()
    head.train(was_training)
    return [float(hit / max(count, 1)) for hit, count in zip(hits, seen)]


@torch.no_grad()
def evaluate_eagle(model, head, windows: torch.Tensor, features: torch.Tensor, choices: torch.Tensor,
                   top_k: int = 5) -> dict:
    """On windows not trained on: how often the head's top-1, and its top-k, hold the target's own next choice."""
    if head.target_layers is not None:
        return evaluate_eagle3(head, windows, features, choices, model, top_k)
    device = model.device  # the windows and features stay on the CPU; one window at a time goes to the model
    head = head.float().to(device)
    length = windows.shape[1] - 1
    positions, mask = (tensor.to(device) for tensor in whole_windows(length))
    top1 = topk = covered = 0.0
    drafted = torch.zeros(model.config.vocab_size, dtype=torch.bool, device=device)
    drafted[head.vocab if len(head.vocab) else slice(None)] = True
    for window, feature, choice in zip(windows, features, choices):
        window, feature, choice = window.to(device), feature.to(device), choice.to(device)
        predicted = head(model.get_input_embeddings()(window[None, 1:]).float(), feature[None, :-1].float(),
                         positions, mask)[0]
        logits = model.get_output_embeddings()(predicted.to(model.dtype)).float()  # (n-1, vocab)
        goal = choice[1:, None]
        top1 += float((logits.argmax(-1, keepdim=True) == goal).float().sum())
        topk += float((logits.topk(top_k, dim=-1).indices == goal).any(-1).float().sum())
        covered += float(drafted[choice[1:]].float().sum())
    positions_seen = len(windows) * length
    return {"top1": top1 / positions_seen, f"top{top_k}": topk / positions_seen, "positions": positions_seen,
            "draft_vocab": len(head.vocab), "choices_in_draft_vocab": covered / positions_seen, "recipe": "eagle1",
            "top1_per_depth": depth_accuracy(model, head, windows, features, choices, 7)}


@torch.no_grad()
def evaluate_eagle3(head: Eagle3Head, windows: torch.Tensor, states: torch.Tensor, choices: torch.Tensor, model,
                    top_k: int = 5) -> dict:
    """evaluate_eagle for an EAGLE-3 head over the target's three layers' states (count, n, 3d); also its top-1
    per draft depth, unrolled on its own outputs (depths: the head's unrolled steps, at most 7)."""
    device = model.device  # as evaluate_eagle: one window at a time goes to the model's device
    head = head.float().eval().to(device)
    length = windows.shape[1] - 1
    positions, mask = (tensor.to(device) for tensor in whole_windows(length))
    top1 = topk = covered = 0.0
    for window, state, choice in zip(windows, states, choices):
        window, state, choice = window.to(device), state.to(device), choice.to(device)
        output = head(model.get_input_embeddings()(window[None, 1:]).float(), head.fuse(state[None, :-1].float()),
                      positions, mask)[0]
        logits = head.vocab_logits(output)  # (n-1, vocab)
        goal = choice[1:, None]
        top1 += float((logits.argmax(-1, keepdim=True) == goal).float().sum())
        topk += float((logits.topk(top_k, dim=-1).indices == goal).any(-1).float().sum())
        covered += float(head.t2d[choice[1:]].float().sum())
    positions_seen = len(windows) * length
    return {"top1": top1 / positions_seen, f"top{top_k}": topk / positions_seen, "positions": positions_seen,
            "draft_vocab": len(head.d2t), "choices_in_draft_vocab": covered / positions_seen, "recipe": "eagle3",
            "top1_per_depth": depth_accuracy(model, head, windows, states, choices, 7)}

"""Training mask tokens (heads/mask_tokens.py) for BiTA and SPACE with the target frozen, through the shared
training loop (train/loop.py). Shared by train/bita.py (prompts + masks) and train/space.py (masks + a LoRA applied
at the mask positions only).

Per step, for a batch of packed windows of the dataset (as PaSS trains, train/pass_embeddings.py):

1. The frozen target runs over the windows once, without gradients and without any adapter, filling a KV cache
   (exactly what the target's own rows are at inference). Its greedy choice at each position is the label: the
   masks learn the target's own next tokens, not the dataset's (self-distillation on the dataset's text).
2. At `cuts` random positions t per window, a group (the prompts, then the k masks) is appended as t + 1 .. t +
   p + k, seeing the window up to t and its own earlier members: the layout of a group hanging from a node at
   inference (drafters/mask_drafting.py). SPACE's low-rank deltas act on these rows only, as at inference.
3. Mask i at t is trained, by cross-entropy, to give the target's choice at position t + 1 + i (the token i + 2
   after t).

Held-out windows give each mask depth's top-1 accuracy and the mean number of masks right in a row. Checkpoints
are written atomically every `checkpoint_every` steps, and a rerun with the same settings resumes from the last.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from accelgen import cache as kv
from accelgen.heads.mask_tokens import MaskTokens, lora_targets, model_fingerprint
from accelgen.models.block import blocking_mask
from accelgen.models.layerwise import llama_decoder
from accelgen.train.checkpoints import run_settings
from accelgen.train.loop import Checkpointing, ScaleOut, run_training, step_generator, training_device
from accelgen.train.pass_embeddings import frozen, lookahead_layout, lookahead_loss, random_cuts, windows_with_cuts

CHECKPOINT = "mask_tokens_checkpoint.pt"


def new_mask_tokens(model, method: str, count: int, prompt_count: int = 0, rank: int = 0, alpha: float = 16.0,
                    lora_names: tuple[str, ...] = (), seed: int = 0) -> MaskTokens:
    """Masks and prompts starting near the mean token embedding, each nudged apart at random; LoRA deltas at zero."""
    config = model.config
    tokens = MaskTokens(method, count, config.hidden_size, prompt_count, rank, alpha,
                        lora_targets(model, lora_names) if rank else None, config.vocab_size,
                        config.num_hidden_layers, model_fingerprint(model), str(getattr(model, "name_or_path", "")))
    table = model.get_input_embeddings().weight.detach().float()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for vectors in (tokens.masks, tokens.prompts):
            noise = torch.randn(vectors.shape, generator=generator) * table.std(0) * 0.1
            vectors.copy_(table.mean(0) + noise)
    return tokens


def mask_logits(model, tokens: MaskTokens, windows: torch.Tensor, cuts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits (b, c·k, vocab) float32 of the masks of the groups appended at cuts (b, c) of windows (b, n), with
    gradients to what the tokens train; labels (b, c·k): the target's greedy choice mask i of each must give)."""
    decoder = llama_decoder(model, tokens.method)
    lm_head = model.get_output_embeddings()
    size, count, length = len(tokens.group), tokens.count, windows.shape[1]
    cuts = cuts.cpu()  # the layout is built on the CPU
    layouts = [lookahead_layout(row_cuts, size, length) for row_cuts in cuts]
    positions = torch.stack([positions for positions, _ in layouts])  # (b, c·s)
    labelled = (cuts[:, :, None] + 1 + torch.arange(count)).reshape(len(cuts), -1)  # (b, c·k) rows choosing labels
    with torch.no_grad():
        cache = kv.new_cache(model.config)
        hidden = decoder(input_ids=windows.to(model.device), use_cache=True,
                         **{kv.cache_keyword(decoder): cache}).last_hidden_state
        labels = lm_head(hidden[torch.arange(len(windows))[:, None], labelled]).argmax(-1)
    masks = torch.stack([blocking_mask(allowed, model.dtype)[None] for _, allowed in layouts])  # (b, 1, c·s, n + c·s)
    inputs = tokens.group.to(model.dtype).repeat(len(cuts), cuts.shape[1], 1)  # (b, c·s, d)
    with tokens.lora_on_last(model, inputs.shape[1]):
        groups = decoder(inputs_embeds=inputs, position_ids=positions.to(model.device),
                         attention_mask=masks.to(model.device), use_cache=True,
                         **{kv.cache_keyword(decoder): cache}).last_hidden_state  # (b, c·s, d)
    mask_rows = groups.reshape(len(cuts), cuts.shape[1], size, -1)[:, :, size - count :]  # (b, c, k, d)
    return lm_head(mask_rows.reshape(len(cuts), -1, mask_rows.shape[-1])).float(), labels


def train_mask_tokens(model, tokens: MaskTokens, windows: torch.Tensor, config, out_dir: Path | None = None,
                      seed: int = 0, progress: Callable[[dict], None] | None = None,
                      scale: ScaleOut | None = None) -> tuple[MaskTokens, dict]:
    """Train tokens for the frozen model on windows (count, n); config has steps, batch_size, cuts,
    learning_rate, checkpoint_every (and lora_learning_rate with an adapter); with out_dir, checkpointed there and
    resumed; scale: processes, precision, accumulation (train/loop.py).
    Returns (tokens, {"resumed_at", "seconds", "processes"})."""
    groups = [{"params": [tokens.masks, tokens.prompts], "lr": config.learning_rate}]
    if len(tokens.lora):
        groups.append({"params": list(tokens.lora.parameters()), "lr": config.lora_learning_rate})
    optimizer = torch.optim.Adam(groups)
    model.to(training_device(scale))
    batch_size = min(config.batch_size, len(windows))

    def draw(step: int) -> dict:
        return windows_with_cuts(windows, batch_size, tokens.count, config.cuts, step_generator(seed, step))

    def loss_of(batch: dict) -> tuple[torch.Tensor, dict]:
        return lookahead_loss(*mask_logits(model, tokens, batch["windows"], batch["cuts"]), tokens.count)

    checkpointing = Checkpointing(None if out_dir is None else Path(out_dir) / CHECKPOINT, run_settings(config),
                                  tokens.method, config.checkpoint_every)
    with frozen(model):
        times = run_training(tokens, optimizer, config.steps, draw, loss_of, scale=scale, checkpointing=checkpointing,
                             tokens_per_row=config.cuts * tokens.count, progress=progress)
    return tokens.eval(), times


@torch.no_grad()
def evaluate_mask_tokens(model, tokens: MaskTokens, windows: torch.Tensor, cuts: int = 16, seed: int = 1) -> dict:
    """On windows not trained on: each mask depth's top-1 against the target's choice, and the mean number of
    masks right in a row (the draft tokens a step would get accepted)."""
    generator = torch.Generator().manual_seed(seed)
    right = []
    for window in windows:
        window_cuts = random_cuts(len(window), tokens.count, cuts, generator)[None]
        logits, labels = mask_logits(model, tokens, window[None], window_cuts)
        right.append((logits.argmax(-1) == labels).reshape(-1, tokens.count))
    right = torch.cat(right).float()  # (positions, k)
    in_a_row = right.cumprod(dim=1).sum(dim=1)
    return {"top1_per_depth": [float(a) for a in right.mean(0)], "mean_masks_in_a_row": float(in_a_row.mean()),
            "positions": len(right)}

"""EAGLE heads (Li et al. 2024, arXiv:2401.15077), trained on this CPU with the target frozen.

The target's *feature* f_t is its last hidden state at position t, after the final norm: what its LM head
reads to guess token t + 1. The head is EAGLE's. It takes f_t and the embedding of the token x_{t+1} that
followed, fuses them with fc (2d → d), and runs one Llama decoder layer to predict the next feature f_{t+1}.
The target's own LM head then turns that prediction into a guess of x_{t+2}. While drafting, the head goes on
autoregressively on its own predicted features (drafters/eagle.py).

As in EAGLE, and in the layout vLLM loads (`accelgen export vllm`):

- the layer has no input norm, because its input is made of normed features;
- there is no final norm;
- the target's embedding and LM head are shared and frozen.

The layer is the target's shape: its width, heads, MLP size and rotary settings.

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
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from accelgen.atomic import CorruptFileError, load_tensors, save_tensors_atomically
from accelgen.cache import cache_keyword
from accelgen.models.runner import additive_mask
from accelgen.train.heads import load_heads, resume, run_settings, save_checkpoint, save_heads

NAME = "eagle_head"
CHECKPOINT = "eagle_trainer.pt"  # head, optimizer state and step, while training
FEATURES = "features.safetensors"  # the target's features and choices over the training windows


def head_config(target_config):
    """The LlamaConfig of a one-layer head shaped like the target's layers."""
    from transformers import LlamaConfig

    heads = target_config.num_attention_heads
    config = LlamaConfig(
        vocab_size=target_config.vocab_size, hidden_size=target_config.hidden_size,
        intermediate_size=target_config.intermediate_size, num_hidden_layers=1, num_attention_heads=heads,
        num_key_value_heads=getattr(target_config, "num_key_value_heads", None) or heads,
        head_dim=getattr(target_config, "head_dim", None) or target_config.hidden_size // heads,
        hidden_act=target_config.hidden_act, rms_norm_eps=target_config.rms_norm_eps,
        max_position_embeddings=target_config.max_position_embeddings,
        rope_parameters=dict(target_config.rope_parameters), attention_bias=False,
    )
    config._attn_implementation = "sdpa"
    return config


class EagleHead(torch.nn.Module):
    def __init__(self, config: dict, base_model: str = "", layer_count: int = 0, draft_vocab: int = 0):
        """config: the head's LlamaConfig as a dict (`head_config(target.config).to_dict()`); draft_vocab: the
        size of the vocabulary it drafts from (0: the whole vocabulary)."""
        super().__init__()
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

        self.config = LlamaConfig(**config)
        self.config._attn_implementation = "sdpa"
        self.base_model, self.layer_count = base_model, layer_count
        d = self.config.hidden_size
        self.fc = torch.nn.Linear(2 * d, d, bias=False)
        self.layer = LlamaDecoderLayer(self.config, layer_idx=0)
        self.layer.input_layernorm = torch.nn.Identity()  # its input is made of normed features (EAGLE, vLLM)
        self.rotary = LlamaRotaryEmbedding(self.config)
        # the token ids drafts are drawn from (FR-Spec's idea: on a CPU the LM head is most of a draft step's
        # cost, and a few thousand frequent tokens carry nearly all of the text); empty: all of them
        self.register_buffer("vocab", torch.zeros(draft_vocab, dtype=torch.long))
        with torch.no_grad():  # untrained, the head passes the feature through: training starts from there
            self.fc.weight.zero_()
            self.fc.weight[:, d:] = torch.eye(d)
            self.layer.self_attn.o_proj.weight.zero_()
            self.layer.mlp.down_proj.weight.zero_()

    def forward(self, token_embeds: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                mask: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        """(b, m, d) predicted features f_{t+1} from token_embeds (b, m, d) of x_{t+1} and features (b, m, d) f_t,
        at positions (b, m); mask (b or 1, 1, m, cached + m) additive, None for a single token; cache: a
        DynamicCache the new keys and values are appended to."""
        hidden = self.fc(torch.cat([token_embeds, features], dim=-1).to(self.fc.weight.dtype))
        return self.layer(hidden, attention_mask=mask, position_ids=positions, **{cache_keyword(self.layer): cache},
                          use_cache=cache is not None, position_embeddings=self.rotary(hidden, positions))

    def describe_shape(self) -> dict:
        return {"hidden_size": self.config.hidden_size, "layer_count": self.layer_count,
                "vocab_size": self.config.vocab_size, "intermediate_size": self.config.intermediate_size}

    def save(self, folder) -> None:
        save_heads(self, folder, NAME, {"config": self.config.to_dict(), "base_model": self.base_model,
                                        "layer_count": self.layer_count, "draft_vocab": len(self.vocab)})

    @classmethod
    def load(cls, folder, model=None) -> "EagleHead":
        head = load_heads(cls, folder, NAME, "accelgen train eagle", model)
        return head if model is None else head.to(model.dtype)


def draft_vocabulary(windows: torch.Tensor, choices: torch.Tensor, vocab_size: int, size: int) -> torch.Tensor:
    """(min(size, vocab_size),) token ids to draft from: those of the data and the target's choices, most
    frequent first, then the lowest ids not among them (a BPE vocabulary numbers its early, common merges first)."""
    size = min(size, vocab_size)
    counts = torch.bincount(torch.cat([windows.reshape(-1), choices.reshape(-1)]), minlength=vocab_size)
    order = torch.sort(counts, descending=True, stable=True).indices  # ties: lower id first
    return torch.sort(order[:size]).values


def new_head(model) -> EagleHead:
    """An untrained head for the target `model`."""
    return EagleHead(head_config(model.config).to_dict(), str(getattr(model, "name_or_path", "")),
                     model.config.num_hidden_layers)


def whole_windows(length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions (1, length), causal additive mask (1, 1, length, length)): the head over whole windows."""
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    return torch.arange(length)[None], additive_mask(0, causal, torch.float32, "cpu")


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
    batch_size: int = 4  # windows per step
    learning_rate: float = 5e-4
    ce_weight: float = 0.1  # EAGLE's weight of the classification loss
    ce_positions: int = 256  # positions per step whose LM-head logits enter the cross-entropy
    draft_vocab: int = 16384  # tokens the head drafts from (0: all)
    noise: float = 0.1  # uniform noise of this half-width on the input features (EAGLE: 0.1)
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

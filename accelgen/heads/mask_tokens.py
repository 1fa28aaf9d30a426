"""Mask tokens with which a frozen target drafts for itself inside its verifying forward: BiTA (Lin et al. 2024,
arXiv:2401.12522) and SPACE (Yi et al. 2024, arXiv:2402.11809). See drafters/mask_drafting.py for how they are fed.

What is learned, all of it seen by the appended positions only (the target's own rows never are):

- `masks` (k, d): k mask embeddings; fed after a token, mask i's row guesses the token i + 2 places after it (the
  token's own row gives the next one).
- `prompts` (p, d): BiTA's soft prompt, fed before the masks of every group (p = 0 for SPACE).
- `lora`: SPACE's low-rank deltas (rank r > 0), one B·A per adapted linear layer, added to that layer's output at the
  appended rows only (`lora_on_last`). peft's LoRA adds its delta at every position of a forward, which would change
  the target's own rows in the verifying forward and break exactness, so the delta is applied by forward hooks that
  add it to the last `a` rows of the layer's output, the appended positions, and nowhere else.

An artifact is a folder: mask_tokens.safetensors and mask_tokens.json, which records the method it was trained for
and the base model's hidden size, layer count, vocabulary and weight fingerprint, so that one trained for another
model (or the other method) is refused by name.
"""

from __future__ import annotations

import contextlib
import hashlib

import torch

from accelgen.errors import InputError
from accelgen.heads.io import check_fits, load_heads, save_heads

NAME = "mask_tokens"
MASK_TOKEN_METHODS = ("bita", "space")
FINGERPRINT_ROWS = 64  # embedding rows hashed to recognise a model (as distillspec does)


def model_fingerprint(model) -> str:
    """A short hash of the model's first embedding rows, rounded to bfloat16 so that the same weights loaded in
    float32 or bfloat16 give the same fingerprint."""
    rows = model.get_input_embeddings().weight[:FINGERPRINT_ROWS].detach().to(torch.bfloat16).cpu()
    return hashlib.sha1(rows.view(torch.int16).numpy().tobytes()).hexdigest()[:16]


class LowRankDelta(torch.nn.Module):
    """x (.., d_in) -> B·A·x (.., d_out) · scale: zero at start (B = 0), as LoRA starts."""

    def __init__(self, d_in: int, d_out: int, rank: int, alpha: float):
        super().__init__()
        self.down = torch.nn.Linear(d_in, rank, bias=False)
        self.up = torch.nn.Linear(rank, d_out, bias=False)
        torch.nn.init.kaiming_uniform_(self.down.weight, a=5 ** 0.5)
        torch.nn.init.zeros_(self.up.weight)
        self.scale = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(self.down(x.to(self.down.weight.dtype))) * self.scale


class MaskTokens(torch.nn.Module):
    def __init__(self, method: str, count: int, hidden_size: int, prompt_count: int = 0, rank: int = 0,
                 alpha: float = 16.0, lora_modules: dict | None = None, vocab_size: int = 0, layer_count: int = 0,
                 fingerprint: str = "", base_model: str = ""):
        """lora_modules: {module name in the model: [d_in, d_out]} for rank > 0."""
        super().__init__()
        if method not in MASK_TOKEN_METHODS:
            raise InputError(f"mask tokens are for {' or '.join(MASK_TOKEN_METHODS)}, not {method!r}")
        if count < 1 or prompt_count < 0 or rank < 0:
            raise InputError(f"need at least one mask token (got {count}), and no negative prompt count or rank")
        self.method, self.rank, self.alpha = method, rank, alpha
        self.hidden_size, self.vocab_size, self.layer_count = hidden_size, vocab_size, layer_count
        self.fingerprint, self.base_model = fingerprint, base_model
        self.lora_modules = dict(lora_modules or {}) if rank else {}
        self.masks = torch.nn.Parameter(torch.zeros(count, hidden_size))  # (k, d)
        self.prompts = torch.nn.Parameter(torch.zeros(prompt_count, hidden_size))  # (p, d)
        self.lora = torch.nn.ModuleDict({_key(name): LowRankDelta(d_in, d_out, rank, alpha)
                                         for name, (d_in, d_out) in self.lora_modules.items()})

    @property
    def count(self) -> int:
        return len(self.masks)

    @property
    def group(self) -> torch.Tensor:
        """(p + k, d): what is fed after a token: the prompts, then the masks."""
        return torch.cat([self.prompts, self.masks])

    def describe_shape(self) -> dict:
        return {"hidden_size": self.hidden_size, "layer_count": self.layer_count, "vocab_size": self.vocab_size}

    def config(self) -> dict:
        return {"method": self.method, "count": self.count, "prompt_count": len(self.prompts), "rank": self.rank,
                "alpha": self.alpha, "lora_modules": self.lora_modules, "fingerprint": self.fingerprint,
                "base_model": self.base_model, **self.describe_shape()}

    def save(self, folder) -> None:
        save_heads(self, folder, NAME, self.config())

    @classmethod
    def load(cls, folder, model, method: str) -> MaskTokens:
        """The mask tokens in folder, checked to be `method`'s and trained for this model; else a ValueError."""
        tokens = load_heads(cls, folder, NAME, f"accelgen train {method}")  # (shape checked below, with more)
        if tokens.method != method:
            raise InputError(f"{folder} holds {tokens.method} mask tokens, not {method}'s: train them with "
                             f"`accelgen train {method}` or use --method {tokens.method}")
        what = f"these {method} mask tokens (trained for {tokens.base_model or 'another model'})"
        check_fits(tokens.describe_shape(), model, what)
        if tokens.fingerprint and tokens.fingerprint != model_fingerprint(model):
            raise InputError(f"{what} belong to another model: its weight fingerprint differs from this model's; "
                             f"train them for it with `accelgen train {method}`")
        missing = [name for name in tokens.lora_modules if not _has_module(model, name)]
        if missing:
            raise InputError(f"{what} adapt layers this model does not have: {missing[0]}")
        return tokens.to(model.device)

    @contextlib.contextmanager
    def lora_on_last(self, model, rows: int):
        """While open, each adapted linear layer of model adds its low-rank delta to the last `rows` positions of
        its output (the appended positions: the target's own rows come first and are left exactly as they are).
        The hooks are removed on exit, so the model is untouched outside."""
        if not self.lora_modules or rows == 0:
            yield
            return
        handles = [model.get_submodule(name).register_forward_hook(_adds_to_last(self.lora[_key(name)], rows))
                   for name in self.lora_modules]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()


def _adds_to_last(delta: LowRankDelta, rows: int):
    def hook(module, args, output):  # output (b, s, d_out): the delta on the last `rows` of s only
        head, tail = output[:, :-rows], output[:, -rows:]
        return torch.cat([head, tail + delta(args[0][:, -rows:]).to(output.dtype)], dim=1)
    return hook


def lora_targets(model, names: tuple[str, ...]) -> dict:
    """{module name: [d_in, d_out]} of the model's linear layers whose name ends in one of names (e.g. q_proj)."""
    found = {name: [module.in_features, module.out_features] for name, module in model.named_modules()
             if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in names and "lm_head" not in name}
    if not found:
        raise InputError(f"the model has no linear layer named {', '.join(names)} to adapt")
    return found


def _key(name: str) -> str:
    return name.replace(".", "__")  # ModuleDict keys take no dots


def _has_module(model, name: str) -> bool:
    try:
        model.get_submodule(name)
    except AttributeError:
        return False
    return True

"""MPEE's exit heads: the vertical perspective of multi-perspective early exiting (Kong et al. 2022, MPEE).

Each exit layer l_i (increasing) has a small classifier whose features are its own layer's AND the earlier exits':

    f_i = silu(W_i · rms(h_i) + C_i · f_(i-1))      (rank r; f_0 = 0, rms: a weightless RMS norm)

so an upper exit reuses what the exits below it saw. From f_i come
- the exit's prediction: the model's final norm and LM head on h_i + A_i · f_i (A_i starts at zero, so an
  untrained exit is the plain one);
- its confidence: sigmoid(c_i · f_i + b_i), the probability that this exit's top-1 equals the last layer's; one
  dot product per check, no LM-head matmul.

`accelgen train mpee` trains them by weighted self-distillation (train/mpee.py), and `mpee` exits with them
(exits/mpee.py). Saved as mpee_heads.safetensors + mpee_heads.json, with the model's shape and a fingerprint of
its embeddings: heads trained for another model are refused by name, even one of the same shape.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from accelgen.errors import InputError
from accelgen.heads.io import check_fits, load_heads, save_heads

NAME = "mpee_heads"  # mpee_heads.safetensors + mpee_heads.json
TRAIN_COMMAND = "accelgen train mpee"
FINGERPRINT_ROWS = 64  # embedding rows hashed to recognise the model the heads were trained for


def embedding_fingerprint(model) -> str:
    """A short hash of the model's first embedding rows, rounded to bfloat16 (the same weights in float32 or bfloat16
    give the same fingerprint): tells apart models of one shape (the same scheme as distillspec's)."""
    rows = model.get_input_embeddings().weight[:FINGERPRINT_ROWS].detach().to(torch.bfloat16).cpu()
    return hashlib.sha1(rows.view(torch.int16).numpy().tobytes()).hexdigest()[:16]


class MpeeHeads(torch.nn.Module):
    def __init__(self, layers: list[int], hidden_size: int, rank: int, base_model: str = "", vocab_size: int = 0,
                 layer_count: int = 0, fingerprint: str = ""):
        super().__init__()
        if not layers or len(set(layers)) != len(layers):
            raise InputError(f"MPEE heads need distinct exit layers, got {layers!r}")
        self.layers = sorted(layers)
        self.hidden_size, self.rank = hidden_size, rank
        self.base_model, self.vocab_size, self.layer_count = base_model, vocab_size, layer_count
        self.fingerprint = fingerprint
        self.own = torch.nn.ModuleDict()  # W_i: the exit's own layer
        self.carried = torch.nn.ModuleDict()  # C_i: the exit below's features (every exit but the first)
        self.adapters = torch.nn.ModuleDict()  # A_i: features -> a residual on the hidden state
        self.classifiers = torch.nn.ModuleDict()  # c_i, b_i
        for index, layer in enumerate(self.layers):
            key = str(layer)
            self.own[key] = torch.nn.Linear(hidden_size, rank)
            if index:
                self.carried[key] = torch.nn.Linear(rank, rank, bias=False)
            self.adapters[key] = torch.nn.Linear(rank, hidden_size, bias=False)
            torch.nn.init.zeros_(self.adapters[key].weight)  # untrained: the plain exit
            self.classifiers[key] = torch.nn.Linear(rank, 1)

    def below(self, layer: int) -> int | None:
        """The exit layer before `layer`, whose features `layer` carries; None for the first."""
        index = self.layers.index(layer)
        return self.layers[index - 1] if index else None

    def features(self, layer: int, hidden: torch.Tensor, carried: torch.Tensor | None) -> torch.Tensor:
        """f (.., r) of exit `layer` from its hidden state (.., d) and the exit below's features (.., r) (None for
        the first exit)."""
        key = str(layer)
        own = self.own[key]
        state = torch.nn.functional.rms_norm(hidden.to(own.weight.dtype), (self.hidden_size,))
        mixed = own(state)
        if key in self.carried:
            if carried is None:
                raise InputError(f"MPEE exit {layer} needs the features of exit {self.below(layer)} below it")
            mixed = mixed + self.carried[key](carried)
        return torch.nn.functional.silu(mixed)

    def chain(self, hidden_states: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """{layer: f (.., r)} for every exit, from {layer: hidden (.., d)} (training and evaluation, in batches)."""
        chained, carried = {}, None
        for layer in self.layers:
            carried = chained[layer] = self.features(layer, hidden_states[layer], carried)
        return chained

    def adapt(self, layer: int, hidden: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """hidden (.., d) after exit `layer`, moved by its features (.., r) so that the LM head reads the exit."""
        adapter = self.adapters[str(layer)]
        return hidden + adapter(features).to(hidden.dtype)

    def confidence(self, layer: int, features: torch.Tensor) -> torch.Tensor:
        """(..) the probability that exit `layer` agrees with the full model's top-1."""
        return torch.sigmoid(self.classifiers[str(layer)](features))[..., 0]

    def describe_shape(self) -> dict:
        return {"hidden_size": self.hidden_size, "layer_count": self.layer_count, "vocab_size": self.vocab_size}

    def check_fits(self, model) -> None:
        """A clear error if these heads were trained for another model: another shape, or other weights."""
        trained_for = self.base_model or "another model"
        check_fits(self.describe_shape(), model, f"these MPEE heads (trained for {trained_for})")
        if self.layers[-1] >= model.config.num_hidden_layers - 1:
            raise InputError(f"these MPEE heads exit at layer {self.layers[-1]}, but the model's last exit can be "
                             f"layer {model.config.num_hidden_layers - 2}")
        if self.fingerprint and self.fingerprint != embedding_fingerprint(model):
            raise InputError(f"these MPEE heads were trained for {trained_for}, whose weights differ from this "
                             f"model's (embedding fingerprint); train heads for it with `{TRAIN_COMMAND}`")

    def save(self, folder: Path) -> None:
        save_heads(self, folder, NAME, {"layers": self.layers, "rank": self.rank, "base_model": self.base_model,
                                        "fingerprint": self.fingerprint, **self.describe_shape()})

    @classmethod
    def load(cls, folder, model=None) -> "MpeeHeads":
        """Heads saved by `save`; with a model, checked to fit it and moved to its device."""
        heads = load_heads(cls, folder, NAME, TRAIN_COMMAND)
        if model is not None:
            heads.check_fits(model)
            heads.to(model.device)
        return heads

    @classmethod
    def for_model(cls, model, layers: list[int], rank: int) -> "MpeeHeads":
        """Untrained heads for this model's exit layers (each exit the plain one until trained)."""
        return cls(layers, model.config.hidden_size, rank, str(getattr(model, "name_or_path", "")),
                   model.config.vocab_size, model.config.num_hidden_layers, embedding_fingerprint(model))

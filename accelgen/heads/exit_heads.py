"""Exit heads: per-layer adapters that sharpen early exits, and CALM's early-exit classifiers.

For each chosen layer l:

- an **adapter**, a small residual MLP h + W₂·silu(W₁·h) (rank r) whose W₂ starts at zero, so an untrained
  head is exactly the plain exit (final norm + LM head on the layer's hidden state). Trained to match the last
  layer's next-token distribution, an exit through it predicts what the full model would;
- a **classifier**, a logistic regression on the hidden state that predicts whether the (adapted) exit's top-1
  equals the last layer's. This is CALM's third confidence measure (`calm -o measure=classifier`), which costs
  one dot product per check where the softmax response costs an LM-head matmul.

`accelgen train exit-heads` trains them (train/exit_heads.py); `calm` and `consistent-ee` exit with them.
"""

from __future__ import annotations

from pathlib import Path

import torch

from accelgen.heads.io import check_fits, load_heads, save_heads

NAME = "exit_heads"  # exit_heads.safetensors + exit_heads.json


class ExitHeads(torch.nn.Module):
    def __init__(self, layers: list[int], hidden_size: int, rank: int, base_model: str = "", vocab_size: int = 0,
                 layer_count: int = 0):
        super().__init__()
        self.layers = sorted(layers)
        self.hidden_size, self.rank = hidden_size, rank
        self.base_model, self.vocab_size, self.layer_count = base_model, vocab_size, layer_count
        self.adapters = torch.nn.ModuleDict()
        self.classifiers = torch.nn.ModuleDict()
        for layer in self.layers:
            adapter = torch.nn.Sequential(torch.nn.Linear(hidden_size, rank, bias=False), torch.nn.SiLU(),
                                          torch.nn.Linear(rank, hidden_size, bias=False))
            torch.nn.init.zeros_(adapter[2].weight)  # untrained: the plain exit
            self.adapters[str(layer)] = adapter
            self.classifiers[str(layer)] = torch.nn.Linear(hidden_size, 1)

    def adapt(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (.., d) after layer `layer`, adapted for an exit there (unchanged for a layer without a head)."""
        adapter = self.adapters[str(layer)] if str(layer) in self.adapters else None
        if adapter is None:
            return hidden
        return hidden + adapter(hidden.to(adapter[0].weight.dtype)).to(hidden.dtype)

    def exit_confidence(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """(..) the classifier's probability that an exit after `layer` agrees with the full model."""
        classifier = self.classifiers[str(layer)]
        return torch.sigmoid(classifier(hidden.to(classifier.weight.dtype)))[..., 0]

    def describe_shape(self) -> dict:
        return {"hidden_size": self.hidden_size, "layer_count": self.layer_count, "vocab_size": self.vocab_size}

    def check_fits(self, model) -> None:
        """A clear error if these heads were trained for a model of another shape."""
        check_fits(self.describe_shape(), model, f"these exit heads (trained for {self.base_model or 'another model'})")

    def save(self, folder: Path) -> None:
        save_heads(self, folder, NAME, {"layers": self.layers, "rank": self.rank, "base_model": self.base_model,
                                        **self.describe_shape()})

    @classmethod
    def load(cls, folder, model=None) -> "ExitHeads":
        """Heads saved by `save`; with a model, checked to fit it and moved to its device."""
        return load_heads(cls, folder, NAME, "accelgen train exit-heads", model)

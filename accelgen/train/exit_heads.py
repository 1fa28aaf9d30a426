"""Trained exit heads: per-layer adapters that sharpen early exits, and CALM's early-exit classifiers.

The base model stays frozen. For each chosen layer l:

- an **adapter**, a small residual MLP h + W₂·silu(W₁·h) (rank r) whose W₂ starts at zero, so an untrained
  head is exactly the plain exit (final norm + LM head on the layer's hidden state). It is trained to match
  the last layer's next-token distribution (KL divergence), so an exit through it predicts what the full
  model would;
- a **classifier**, a logistic regression on the hidden state that predicts whether the (adapted) exit's top-1
  equals the last layer's. This is CALM's third confidence measure (`calm -o measure=classifier`), which costs
  one dot product per check where the softmax response costs an LM-head matmul.

`accelgen train exit-heads` first runs the frozen model once over packed windows of the dataset and keeps
every chosen layer's hidden states (memory: tokens × layers × hidden size × 4 bytes). It then trains on
batches of positions, showing progress, and saves `exit_heads.safetensors` with `exit_heads.json`: the
layers, sizes and base model. A head is checked against the model it is used with, and one that does not fit
is refused with the reason.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import torch

from accelgen.models.layerwise import exit_logits, layer_outputs, llama_decoder
from accelgen.train.heads import check_fits, load_heads, save_heads

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


@torch.no_grad()
def collect_hidden_states(model, windows: torch.Tensor, layers: list[int]) -> dict[int, torch.Tensor]:
    """{layer: (positions, d) float32} for the chosen layers and the last, over windows (count, n)."""
    decoder = llama_decoder(model, "exit heads")
    wanted = sorted(set(layers) | {len(decoder.layers) - 1})
    collected: dict[int, list[torch.Tensor]] = {layer: [] for layer in wanted}
    for window in windows:
        for index, hidden in enumerate(layer_outputs(model, decoder, window[None])):
            if index in collected:
                collected[index].append(hidden[0].float().cpu())
    return {layer: torch.cat(states) for layer, states in collected.items()}


def train_exit_heads(model, hidden_states: dict[int, torch.Tensor], layers: list[int], *, rank: int = 64,
                     steps: int = 200, batch_size: int = 256, learning_rate: float = 1e-3, seed: int = 0,
                     progress: Callable[[dict], None] | None = None) -> ExitHeads:
    """Train adapters (KL to the last layer's distribution) and classifiers (does the exit's top-1 agree?)."""
    decoder = llama_decoder(model, "exit heads")
    last = len(decoder.layers) - 1
    heads = ExitHeads(layers, model.config.hidden_size, rank, base_model=str(getattr(model, "name_or_path", "")),
                      vocab_size=model.config.vocab_size, layer_count=last + 1)
    frozen = [parameter for parameter in model.parameters() if parameter.requires_grad]
    for parameter in frozen:  # the base stays as it is: no gradients for it
        parameter.requires_grad_(False)
    try:
        return _train(model, decoder, heads, hidden_states, last, steps, batch_size, learning_rate, seed, progress)
    finally:
        for parameter in frozen:
            parameter.requires_grad_(True)


def _train(model, decoder, heads, hidden_states, last, steps, batch_size, learning_rate, seed, progress) -> ExitHeads:
    optimizer = torch.optim.AdamW(heads.parameters(), lr=learning_rate)
    generator = torch.Generator().manual_seed(seed)
    count = hidden_states[last].shape[0]
    started = time.perf_counter()
    for step in range(steps):
        rows = torch.randint(0, count, (min(batch_size, count),), generator=generator)
        with torch.no_grad():
            target = torch.log_softmax(exit_logits(model, decoder, hidden_states[last][rows].to(model.dtype)), dim=-1)
        total, agreement = 0.0, {}
        for layer in heads.layers:
            hidden = hidden_states[layer][rows]
            logits = exit_logits(model, decoder, heads.adapt(layer, hidden.to(model.dtype)))
            kl = torch.nn.functional.kl_div(torch.log_softmax(logits, dim=-1), target, log_target=True,
                                            reduction="batchmean")
            agrees = (logits.argmax(-1) == target.argmax(-1)).float()
            classifier = torch.nn.functional.binary_cross_entropy(heads.exit_confidence(layer, hidden), agrees)
            total = total + kl + classifier
            agreement[layer] = float(agrees.mean())
        total.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if progress is not None:
            progress({"step": step + 1, "steps": steps, "loss": float(total.detach()), "agreement": agreement,
                      "seconds": time.perf_counter() - started})
    return heads.eval()


@torch.no_grad()
def evaluate_exit_heads(model, heads: ExitHeads, hidden_states: dict[int, torch.Tensor], chunk: int = 256) -> list[dict]:
    """Per head, on hidden states not trained on: how often the plain exit's and the adapted exit's top-1 equal
    the last layer's, and how often the classifier (at 0.5) is right about the adapted exit."""
    decoder = llama_decoder(model, "exit heads")
    last = len(decoder.layers) - 1
    counts = {layer: [0, 0, 0] for layer in heads.layers}
    total = hidden_states[last].shape[0]
    for start in range(0, total, chunk):
        final = exit_logits(model, decoder, hidden_states[last][start : start + chunk].to(model.dtype)).argmax(-1)
        for layer in heads.layers:
            hidden = hidden_states[layer][start : start + chunk].to(model.dtype)
            plain = exit_logits(model, decoder, hidden).argmax(-1) == final
            adapted = exit_logits(model, decoder, heads.adapt(layer, hidden)).argmax(-1) == final
            predicted = heads.exit_confidence(layer, hidden) > 0.5
            for slot, hits in enumerate((plain, adapted, predicted == adapted)):
                counts[layer][slot] += int(hits.sum())
    return [{"layer": layer, "plain_agreement": plain / total, "adapted_agreement": adapted / total,
             "classifier_accuracy": classified / total} for layer, (plain, adapted, classified) in counts.items()]

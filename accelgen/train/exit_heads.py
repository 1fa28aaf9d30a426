"""Training exit heads (heads/exit_heads.py) with the base model frozen: each adapter to match the last
layer's next-token distribution (KL divergence), each classifier to predict whether the adapted exit's top-1
equals the last layer's.

`accelgen train exit-heads` first runs the frozen model once over packed windows of the dataset and keeps
every chosen layer's hidden states (memory: tokens × layers × hidden size × 4 bytes). It then trains on
batches of positions, showing progress, and saves `exit_heads.safetensors` with `exit_heads.json`: the
layers, sizes and base model. A head is checked against the model it is used with, and one that does not fit
is refused with the reason.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch

from accelgen.heads.exit_heads import ExitHeads
from accelgen.models.layerwise import exit_logits, layer_outputs, llama_decoder
from accelgen.train.loop import ScaleOut, run_training, step_generator, training_device


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


@contextlib.contextmanager
def frozen_base(model):
    """The base model without gradients while heads on it train, given back as it was."""
    frozen = [parameter for parameter in model.parameters() if parameter.requires_grad]
    for parameter in frozen:
        parameter.requires_grad_(False)
    try:
        yield
    finally:
        for parameter in frozen:
            parameter.requires_grad_(True)


def classifier_loss(confidence: torch.Tensor, agrees: torch.Tensor) -> torch.Tensor:
    """Binary cross-entropy of an exit classifier's confidence (b,) against agrees (b,) 0/1, in float32 outside
    autocast (mixed precision), where torch refuses binary_cross_entropy."""
    with torch.autocast(confidence.device.type, enabled=False):
        return torch.nn.functional.binary_cross_entropy(confidence.float(), agrees.float())


def train_exit_heads(model, hidden_states: dict[int, torch.Tensor], layers: list[int], *, rank: int = 64,
                     steps: int = 200, batch_size: int = 256, learning_rate: float = 1e-3, seed: int = 0,
                     progress: Callable[[dict], None] | None = None, scale: ScaleOut | None = None) -> ExitHeads:
    """Train adapters (KL to the last layer's distribution) and classifiers (does the exit's top-1 agree?) on
    hidden_states {layer: (positions, d)} (the exits' and the last layer's); scale: processes, precision,
    accumulation (train/loop.py)."""
    decoder = llama_decoder(model, "exit heads")
    last = len(decoder.layers) - 1
    with torch.random.fork_rng():  # the same start on every process (and in every run of a seed)
        torch.manual_seed(seed)
        heads = ExitHeads(layers, model.config.hidden_size, rank, base_model=str(getattr(model, "name_or_path", "")),
                          vocab_size=model.config.vocab_size, layer_count=last + 1)
    model.to(training_device(scale))
    optimizer = torch.optim.AdamW(heads.parameters(), lr=learning_rate)
    count = hidden_states[last].shape[0]

    def draw(step: int) -> dict:
        rows = torch.randint(0, count, (min(batch_size, count),), generator=step_generator(seed, step))
        return {layer: hidden_states[layer][rows] for layer in [*heads.layers, last]}  # {layer: (b, d)}

    def loss_of(batch: dict) -> tuple[torch.Tensor, dict]:
        with torch.no_grad():
            target = torch.log_softmax(exit_logits(model, decoder, batch[last].to(model.dtype)), dim=-1)
        total, agreement = 0.0, []
        for layer in heads.layers:
            hidden = batch[layer]
            logits = exit_logits(model, decoder, heads.adapt(layer, hidden.to(model.dtype)))
            kl = torch.nn.functional.kl_div(torch.log_softmax(logits, dim=-1), target, log_target=True,
                                            reduction="batchmean")
            agrees = (logits.argmax(-1) == target.argmax(-1)).float()
            total = total + kl + classifier_loss(heads.exit_confidence(layer, hidden), agrees)
            agreement.append(float(agrees.mean()))
        return total, {"agreement": agreement}  # agreement: per head, in heads.layers' order

    with frozen_base(model):
        run_training(heads, optimizer, steps, draw, loss_of, scale=scale, progress=progress)
    return heads.eval()


@torch.no_grad()
def evaluate_exit_heads(model, heads: ExitHeads, hidden_states: dict[int, torch.Tensor], chunk: int = 256) -> list[dict]:
    """Per head, on hidden states not trained on: how often the plain exit's and the adapted exit's top-1 equal
    the last layer's, and how often the classifier (at 0.5) is right about the adapted exit (on the model's device,
    where the heads are)."""
    decoder = llama_decoder(model, "exit heads")
    last = len(decoder.layers) - 1
    counts = {layer: [0, 0, 0] for layer in heads.layers}
    total = hidden_states[last].shape[0]
    for start in range(0, total, chunk):
        rows = slice(start, start + chunk)
        final = exit_logits(model, decoder, hidden_states[last][rows].to(model.device, model.dtype)).argmax(-1)
        for layer in heads.layers:
            hidden = hidden_states[layer][rows].to(model.device, model.dtype)
            plain = exit_logits(model, decoder, hidden).argmax(-1) == final
            adapted = exit_logits(model, decoder, heads.adapt(layer, hidden)).argmax(-1) == final
            predicted = heads.exit_confidence(layer, hidden) > 0.5
            for slot, hits in enumerate((plain, adapted, predicted == adapted)):
                counts[layer][slot] += int(hits.sum())
    return [{"layer": layer, "plain_agreement": plain / total, "adapted_agreement": adapted / total,
             "classifier_accuracy": classified / total} for layer, (plain, adapted, classified) in counts.items()]

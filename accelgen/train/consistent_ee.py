"""ConsistentEE's exit policy (Zeng et al. 2024, arXiv:2312.11882), trained with policy gradient.

Training every exit to predict every token (the usual early-exit loss) asks more than inference needs: a token
only needs *one* exit that gets it right. ConsistentEE therefore learns a policy that decides, layer by layer,
whether to exit, rewarded for the exit it takes. The reward weighs accuracy against depth, per token, by how
hard the token is:

- **Memorized layer.** This is the hardness. It is the first exit layer from which every later exit's top-1
  equals the full model's (the last layer's). It falls back to the full depth if no exit is stable. The
  hardness is h = memorized layer index / number of exits, in [0, 1].
- **The reward for exiting at exit k.** R = h · log p_k(ŷ) − (1 − h) · speed_weight · depth_k, where ŷ is the
  full model's top-1, p_k the exit's distribution, and depth_k the fraction of layers run. Easy tokens
  (h ≈ 0) are rewarded for leaving early, hard ones (h ≈ 1) for being right.

The policy at each exit layer is a logistic regression on the hidden state. It is stored as the classifiers
of an `ExitHeads` folder (heads/exit_heads.py), so `consistent-ee` runs through `calm`'s runner with the
policy's exit probability as the confidence. Given trained exit heads, their adapters are kept and the policy
learns on top of them. Training is offline, on the hidden states of the dataset computed once:

- An episode walks the exits in order, exiting at exit k with probability π_k(h_k), or at the last layer.
- The policy gradient is REINFORCE with the batch's mean reward as a baseline.
"""

from __future__ import annotations

from typing import Callable

import torch

from accelgen.heads.exit_heads import ExitHeads
from accelgen.models.layerwise import exit_logits, llama_decoder
from accelgen.train.loop import ScaleOut, run_training, step_generator, training_device


def memorized_exits(agrees: torch.Tensor) -> torch.Tensor:
    """(N,) for agrees (N, K) bool (exit k's top-1 equals the full model's, exits in order): the first exit from
    which every later exit agrees, or K (only the full model) if the last exit does not.

    Example: [[F, T, T], [T, F, T], [F, F, F]]  ->  [1, 2, 3]
    """
    stable = agrees.flip(1).int().cumprod(1).flip(1).bool()  # stable[n, k]: exits k.. all agree
    count = agrees.shape[1]
    return torch.where(stable.any(1), stable.int().argmax(1), torch.full_like(stable[:, 0], count, dtype=torch.long))


def exit_rewards(log_probs: torch.Tensor, depths: torch.Tensor, hardness: torch.Tensor, speed_weight: float) -> torch.Tensor:
    """(N, K+1) reward for exiting at each exit (the last column: the full model), from log_probs (N, K+1) of the
    full model's top-1 under each exit, depths (K+1,) as fractions of the layers, hardness (N,) in [0, 1]."""
    return hardness[:, None] * log_probs - (1 - hardness[:, None]) * speed_weight * depths[None]


@torch.no_grad()
def exit_outcomes(model, heads: ExitHeads, hidden_states: dict[int, torch.Tensor], chunk: int = 256):
    """(log_probs (N, K+1), agrees (N, K)) on the CPU: the full model's top-1 under each exit and the last layer,
    and whether each exit's top-1 equals it (computed on the model's device, where the heads are)."""
    decoder = llama_decoder(model, "exit policy")
    last = len(decoder.layers) - 1
    log_probs, agrees = [], []
    for start in range(0, hidden_states[last].shape[0], chunk):
        rows = slice(start, start + chunk)
        final = exit_logits(model, decoder, hidden_states[last][rows].to(model.device, model.dtype)).log_softmax(-1)
        best = final.argmax(-1, keepdim=True)
        exit_rows, agree = [], []
        for layer in heads.layers:
            hidden = hidden_states[layer][rows].to(model.device, model.dtype)
            exit_log_probs = torch.log_softmax(exit_logits(model, decoder, heads.adapt(layer, hidden)), -1)
            exit_rows.append(exit_log_probs.gather(-1, best)[:, 0])
            agree.append(exit_log_probs.argmax(-1) == best[:, 0])
        log_probs.append(torch.stack(exit_rows + [final.gather(-1, best)[:, 0]], dim=1).cpu())
        agrees.append(torch.stack(agree, dim=1).cpu())
    return torch.cat(log_probs), torch.cat(agrees)


def exit_probabilities(heads: ExitHeads, hidden: torch.Tensor) -> torch.Tensor:
    """(b, K) the policy's probability of exiting at each exit, from the exits' hidden states (b, K, d)."""
    return torch.stack([heads.exit_confidence(layer, hidden[:, index]) for index, layer in enumerate(heads.layers)], 1)


def first_exits(leave: torch.Tensor) -> torch.Tensor:
    """(N,) the first exit taken where leave (N, K) says which exits would be; K (the full model) where none."""
    none = torch.full_like(leave[:, 0], leave.shape[1], dtype=torch.long)
    return torch.where(leave.any(1), leave.int().argmax(1), none)


def taken_agrees(agrees: torch.Tensor, taken: torch.Tensor) -> torch.Tensor:
    """(N,) whether the taken exit (N,) (K: the full model) predicts the full model's top-1, from agrees (N, K)."""
    with_full = torch.cat([agrees, torch.ones_like(agrees[:, :1])], dim=1)
    return with_full.gather(1, taken[:, None])[:, 0]


def train_exit_policy(model, hidden_states: dict[int, torch.Tensor], layers: list[int], *, heads: ExitHeads | None = None,
                      steps: int = 300, batch_size: int = 512, learning_rate: float = 1e-2, speed_weight: float = 1.0,
                      seed: int = 0, progress: Callable[[dict], None] | None = None,
                      scale: ScaleOut | None = None) -> ExitHeads:
    """REINFORCE over cached hidden states {layer: (positions, d)} (the exits' and the last layer's); returns exit
    heads whose classifiers are the policy. scale: processes, precision, accumulation (train/loop.py)."""
    layer_count = model.config.num_hidden_layers
    if heads is None:
        with torch.random.fork_rng():  # the same start on every process (and in every run of a seed)
            torch.manual_seed(seed)
            heads = ExitHeads(layers, model.config.hidden_size, 1, base_model=str(getattr(model, "name_or_path", "")),
                              vocab_size=model.config.vocab_size, layer_count=layer_count)
    device = training_device(scale)
    model.to(device)
    heads.to(device)
    log_probs, agrees = exit_outcomes(model, heads, hidden_states)
    hardness = memorized_exits(agrees).float() / len(heads.layers)
    depths = torch.tensor([(layer + 1) / layer_count for layer in heads.layers] + [1.0])
    rewards = exit_rewards(log_probs, depths, hardness, speed_weight)
    optimizer = torch.optim.Adam(heads.classifiers.parameters(), lr=learning_rate)
    count = rewards.shape[0]

    def draw(step: int) -> dict:
        """The step's episodes, played by the policy as it stands: its decisions, and so the baseline (the whole
        batch's mean reward), do not depend on how the rows are split among processes and micro-batches."""
        generator = step_generator(seed, step)
        rows = torch.randint(0, count, (min(batch_size, count),), generator=generator)
        hidden = torch.stack([hidden_states[layer][rows] for layer in heads.layers], 1)  # (b, K, d)
        chances = torch.rand((len(rows), len(heads.layers)), generator=generator)
        with torch.no_grad():
            taken = first_exits(chances < exit_probabilities(heads, hidden.to(device)).cpu())
        reward = rewards[rows, taken]
        return {"hidden": hidden, "taken": taken, "reward": reward, "advantage": reward - reward.mean(),
                "depth": depths[taken], "agrees": taken_agrees(agrees[rows], taken).float()}

    def loss_of(batch: dict) -> tuple[torch.Tensor, dict]:
        probabilities = exit_probabilities(heads, batch["hidden"])  # (b, K)
        exits = torch.arange(probabilities.shape[1], device=probabilities.device)[None]  # (1, K)
        taken = batch["taken"][:, None]  # (b, 1), K: the full model
        decisions = torch.where(exits == taken, probabilities, 1 - probabilities).clamp_min(1e-6).log()
        log_policy = (decisions * (exits <= taken)).sum(1)  # stayed at the exits before the taken one, left there
        loss = -(batch["advantage"] * log_policy).mean()
        return loss, {"reward": float(batch["reward"].mean()), "mean_depth": float(batch["depth"].mean()),
                      "agreement": float(batch["agrees"].mean())}

    run_training(heads, optimizer, steps, draw, loss_of, scale=scale, progress=progress)
    return heads.eval()


@torch.no_grad()
def evaluate_exit_policy(model, heads: ExitHeads, hidden_states: dict[int, torch.Tensor], threshold: float = 0.5) -> dict:
    """The greedy policy (exit where its probability beats threshold, as `consistent-ee` decodes) on hidden states
    not trained on: mean depth as a fraction of the layers, and agreement of the taken exits with the full model."""
    _, agrees = exit_outcomes(model, heads, hidden_states)
    leave = torch.stack([heads.exit_confidence(layer, hidden_states[layer].to(model.device)) > threshold
                         for layer in heads.layers], 1)
    taken = first_exits(leave.cpu())
    depths = torch.tensor([(layer + 1) / model.config.num_hidden_layers for layer in heads.layers] + [1.0])
    return {"mean_depth": float(depths[taken].mean()), "agreement": float(taken_agrees(agrees, taken).float().mean()),
            "exit_shares": {str(layer): float((taken == k).float().mean()) for k, layer in enumerate(heads.layers + ["full"])}}

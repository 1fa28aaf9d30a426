"""Distilling a draft model toward its target: shared by DistillSpec (`accelgen train distillspec`,
drafters/distillspec.py) and online speculative decoding (train/online.py).

The draft is taught the target's next-token distribution at chosen positions of token sequences:

- **Divergences** (`DIVERGENCES`): forward KL, KL(target ‖ draft), which spreads the draft over every token
  the target finds likely; reverse KL, KL(draft ‖ target), which makes it pick one of them; and total variation
  (TVD). With speculative sampling the acceptance rate at a position is exactly 1 − TVD, which is why
  DistillSpec (Zhou et al. 2023, arXiv:2310.08461) found TVD best for greedy verification on several tasks.
- **Temperature.** The distributions are compared at temperature 1, the logits themselves, unless a loss is
  given another: a draft whose logits match the target's matches it at every sampling temperature, and greedy
  decoding needs only the argmax to agree.
- **Top-k targets.** A target distribution may be kept as its k most likely tokens (online decoding keeps
  only that). Both distributions are then compared over those k tokens plus one bucket holding the rest of
  the mass (`with_rest`), a coarser distribution on which all three divergences stay finite.
- **Which weights train.** The decoder layers and the final norm, in float32: all layers, or the last
  `train_layers`. The embeddings and the LM head stay frozen. In Qwen2.5-0.5B they are one tied 152k × 896
  matrix, 27% of the weights. A few hundred sequences reach few of its rows, and its AdamW state alone would
  take 1.6 GB. Freezing the lower layers as well cuts the backward pass short and saves memory and time.
  bfloat16 weights would round most updates of a small learning rate away. No adapter library is needed.

**On-policy data (DistillSpec).** At each step the draft itself continues a batch of prompts (one half of
them sampled at temperature 1, the other half greedy, alternating). The target then scores the same sequences
in one forward without gradients, and the loss is taken at the generated positions only, never the prompt. The
draft is thus taught where its own drafts lead, which is where the target will judge it. The target's logits
are computed in each step's loss and dropped after its backward pass. Storing full-vocabulary logits would take
600 kB per position in float32 for Qwen's 151,936 tokens, so a step holds batch × max_new_tokens rows at most (256
rows ≈ 150 MB).
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from accelgen.atomic import save_pretrained_atomically, write_json_atomically
from accelgen.drafters.distillspec import DISTILLSPEC_FILE, model_fingerprint
from accelgen.errors import InputError
from accelgen.loop import generate
from accelgen.train.loop import ScaleOut, run_training, training_device

DIVERGENCES = ("tvd", "fkl", "rkl")


# --- divergences ---


def check_divergence(name: str) -> None:
    if name not in DIVERGENCES:
        raise InputError(f"unknown divergence {name!r}; choose one of {', '.join(DIVERGENCES)} "
                         "(tvd: total variation, fkl: KL(target ‖ draft), rkl: KL(draft ‖ target))")


def divergence(name: str, target_log_probs: torch.Tensor, draft_log_probs: torch.Tensor) -> torch.Tensor:
    """(m,) divergence between the target's and the draft's distributions at m positions, given as finite
    log-probabilities (m, n) over the same n outcomes."""
    check_divergence(name)
    target_probs, draft_probs = target_log_probs.exp(), draft_log_probs.exp()
    if name == "tvd":
        return 0.5 * (target_probs - draft_probs).abs().sum(-1)
    if name == "fkl":
        return (target_probs * (target_log_probs - draft_log_probs)).sum(-1)
    return (draft_probs * (draft_log_probs - target_log_probs)).sum(-1)


def with_rest(top_log_probs: torch.Tensor) -> torch.Tensor:
    """(m, k + 1): log-probabilities of k tokens (m, k), then of everything else as one outcome."""
    rest = (1 - top_log_probs.logsumexp(-1, keepdim=True).exp()).clamp(min=torch.finfo(top_log_probs.dtype).tiny)
    return torch.cat([top_log_probs, rest.log()], dim=-1)


@dataclass
class Example:
    """One token sequence and the positions of it where the draft is taught the target's next-token law."""

    token_ids: torch.Tensor  # (n,) long
    positions: torch.Tensor  # (m,) long: indices i whose logits (predicting token i + 1) are taught
    target_log_probs: torch.Tensor  # (m, k) float32: the target's log-probabilities there
    target_ids: torch.Tensor | None = None  # (m, k) long: the tokens of those k columns; None: the whole vocabulary


def distillation_loss(draft_logits: torch.Tensor, example: Example, name: str,
                      temperature: float = 1.0) -> torch.Tensor:
    """(m,) divergence at the example's positions from the draft's logits there (m, vocab); the example's
    target log-probabilities must have been taken at the same temperature."""
    draft_log_probs = torch.log_softmax(draft_logits.float() / temperature, dim=-1)
    target_log_probs = example.target_log_probs
    if example.target_ids is not None:  # a top-k target: compare over its k tokens + the rest
        draft_log_probs = with_rest(draft_log_probs.gather(-1, example.target_ids))
        target_log_probs = with_rest(target_log_probs)
    return divergence(name, target_log_probs, draft_log_probs)


# --- one step ---


def logits_at(model, token_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """(m, vocab) float32 logits after the tokens at positions (m,) of token_ids (n,): the decoder runs over the
    whole sequence, the vocabulary-sized LM head only at those rows."""
    return model(input_ids=token_ids[None].to(model.device), logits_to_keep=positions.to(model.device)).logits[0].float()


def trainable_parameters(model, layers: int | None = None) -> list[torch.nn.Parameter]:
    """The parameters distillation trains: the last `layers` decoder layers (all when None) and the final norm."""
    decoder = model.model.layers
    if layers is not None and not 1 <= layers <= len(decoder):
        raise InputError(f"train_layers must be between 1 and the draft's {len(decoder)} layers, got {layers}")
    chosen = decoder if layers is None else decoder[len(decoder) - layers :]
    parameters = [p for layer in chosen for p in layer.parameters()] + list(model.model.norm.parameters())
    wrong = {p.dtype for p in parameters} - {torch.float32}
    if wrong:
        raise InputError(f"the draft's weights are {sorted(map(str, wrong))}: distillation trains them in float32 "
                         "(load the draft with dtype float32; CLI: --draft-dtype float32)")
    return parameters


@contextlib.contextmanager
def training_only(model, parameters: list[torch.nn.Parameter]):
    """Gradients for these parameters alone (the backward pass stops below the lowest of them), restored after."""
    flags = {p: p.requires_grad for p in model.parameters()}
    chosen = {id(p) for p in parameters}
    for p in model.parameters():
        p.requires_grad_(id(p) in chosen)
    try:
        with torch.inference_mode(False), torch.enable_grad():
            yield
    finally:
        for p, flag in flags.items():
            p.requires_grad_(flag)


def distillation_step(draft_model, optimizer: torch.optim.Optimizer, parameters: list[torch.nn.Parameter],
                      examples: list[Example], name: str) -> float:
    """One optimizer step on the mean divergence over every position of the examples; returns that mean
    (before the step). One sequence at a time goes through forward and backward, so memory holds one."""
    total = sum(len(example.positions) for example in examples)
    if total == 0:
        raise InputError("nothing to distill: the examples have no positions")
    loss = 0.0
    with training_only(draft_model, parameters):
        for example in examples:
            draft_logits = logits_at(draft_model, example.token_ids, example.positions)  # (m, vocab), with grad
            example_loss = distillation_loss(draft_logits, example, name).sum() / total
            example_loss.backward()
            loss += float(example_loss.detach())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return loss


# --- DistillSpec: on-policy data ---


@torch.no_grad()
def on_policy_examples(target_model, draft_model, tokenizer, prompts: list[list[int]], *, max_new_tokens: int,
                       first: int = 0, seed: int = 0) -> list[Example]:
    """The draft continues each prompt, then the target scores the sequence: one Example per prompt, taught at
    the generated tokens. Prompt number `first + j` is sampled at temperature 1 when even, greedy when odd."""
    examples = []
    for number, prompt in enumerate(prompts, start=first):
        continuation = draft_continuation(draft_model, tokenizer, prompt, number, max_new_tokens, seed)
        if not continuation:
            continue
        token_ids = torch.tensor(prompt + continuation)
        positions = torch.arange(len(prompt) - 1, len(token_ids) - 1)  # each predicts a generated token
        target_log_probs = torch.log_softmax(logits_at(target_model, token_ids, positions), dim=-1)
        examples.append(Example(token_ids, positions, target_log_probs))
    return examples


@torch.no_grad()
def draft_continuation(draft_model, tokenizer, prompt: list[int], number: int, max_new_tokens: int,
                       seed: int) -> list[int]:
    """The draft's continuation of prompt number `number`: sampled at temperature 1 (seeded by the number) when it
    is even, greedy when odd."""
    return generate(draft_model, tokenizer, prompt, max_new_tokens=max_new_tokens,
                    temperature=1.0 if number % 2 == 0 else 0.0, seed=seed + number).token_ids


def distill(target_model, draft_model, tokenizer, prompts: list[list[int]], *, steps: int, batch_size: int,
            max_new_tokens: int, divergence_name: str = "fkl", learning_rate: float = 5e-6,
            train_layers: int | None = None, seed: int = 0, progress: Callable[[dict], None] | None = None,
            scale: ScaleOut | None = None) -> dict:
    """DistillSpec: `steps` AdamW steps on fresh on-policy batches of `batch_size` prompts (cycled). The draft,
    in float32, is changed in place; scale: processes, precision, accumulation (train/loop.py; a micro-batch's
    sequences are held in memory together for the backward pass). Returns the losses, the taught tokens, the
    seconds taken and the processes."""
    check_divergence(divergence_name)
    for name, value in (("steps", steps), ("batch_size", batch_size), ("max_new_tokens", max_new_tokens)):
        if value < 1:
            raise InputError(f"{name} must be >= 1, got {value}")
    if not prompts:
        raise InputError("no training prompts")
    parameters = trainable_parameters(draft_model, train_layers)
    optimizer = torch.optim.AdamW(parameters, lr=learning_rate)
    target_model.to(training_device(scale))
    losses, taught = [], 0

    def draw(step: int) -> dict:
        """The draft continues the step's prompts (on every process alike: the same weights, the same seeds)."""
        nonlocal taught
        first = step * batch_size
        batch = [prompts[(first + i) % len(prompts)] for i in range(batch_size)]
        sequences = [prompt + draft_continuation(draft_model, tokenizer, prompt, number, max_new_tokens, seed)
                     for number, prompt in enumerate(batch, start=first)]
        prompt_lengths = torch.tensor([len(prompt) for prompt in batch])
        lengths = torch.tensor([len(sequence) for sequence in sequences])
        generated = int((lengths - prompt_lengths).sum())
        taught += generated
        token_ids = torch.zeros(batch_size, int(lengths.max()), dtype=torch.long)
        for row, sequence in enumerate(sequences):
            token_ids[row, :len(sequence)] = torch.tensor(sequence)
        # the loop averages over rows: each row's summed divergence, times rows / the batch's taught positions,
        # averages to the mean divergence over every taught position of the batch
        weight = torch.full((batch_size,), batch_size / max(generated, 1))
        return {"token_ids": token_ids, "prompt_length": prompt_lengths, "length": lengths, "weight": weight}

    def loss_of(batch: dict) -> tuple[torch.Tensor, dict]:
        summed = []  # each continued row's weighted divergence
        for token_ids, prompt_length, length, weight in zip(batch["token_ids"], batch["prompt_length"],
                                                            batch["length"], batch["weight"]):
            token_ids = token_ids[:int(length)]
            positions = torch.arange(int(prompt_length) - 1, int(length) - 1)  # each predicts a generated token
            if not len(positions):  # the draft ended at once (EOS): nothing to teach
                continue
            with torch.no_grad():
                target_log_probs = torch.log_softmax(logits_at(target_model, token_ids, positions), dim=-1)
            draft_logits = logits_at(draft_model, token_ids, positions)  # (m, vocab), with grad
            example = Example(token_ids, positions, target_log_probs)
            summed.append(weight * distillation_loss(draft_logits, example, divergence_name).sum())
        if not summed:
            return torch.zeros((), requires_grad=True), {}
        return torch.stack(summed).sum() / len(batch["weight"]), {}

    def record(row: dict) -> None:
        losses.append(row["loss"])
        if progress is not None:
            progress({**row, "tokens_per_second": taught / row["seconds"]})

    with training_only(draft_model, parameters):
        times = run_training(draft_model, optimizer, steps, draw, loss_of, scale=scale, progress=record)
    return {"losses": losses, "taught_tokens": taught, "seconds": times["seconds"], "processes": times["processes"]}


def acceptance(target_model, draft_model, tokenizer, prompts: list[list[int]], *, max_new_tokens: int,
               gamma: int = 5) -> dict:
    """α (accepted / drafted tokens) and τ (new tokens per target forward) of greedy `speculative` decoding
    with this draft, pooled over the prompts."""
    drafted = accepted = new_tokens = forwards = 0
    for prompt in prompts:
        stats = generate(target_model, tokenizer, prompt, method="speculative", draft_model=draft_model,
                         max_new_tokens=max_new_tokens, temperature=0.0, gamma=gamma).stats
        drafted += stats["draft_tokens"]
        accepted += stats["accepted_draft_tokens"]
        new_tokens += stats["new_tokens"]
        forwards += stats["target_forwards"]
    return {"acceptance_rate": accepted / drafted if drafted else 0.0,
            "mean_accepted_tokens": new_tokens / forwards if forwards else 0.0,
            "prompts": len(prompts), "new_tokens": new_tokens}


# --- prompts ---


def distillation_prompts(dataset: str, tokenizer, count: int, held_out: int) -> tuple[list[list[int]], list[list[int]]]:
    """(up to `count` training prompts, `held_out` prompts to measure α on), as token ids. Benchmark prompts
    never train:

    humaneval     the first held_out tasks are held out: the ones `accelgen bench --dataset humaneval
                  --limit N` runs for N <= held_out; the tasks after them train
    sharegpt      held out: the first prompts of the `sharegpt` benchmark's sample; training: the first human
                  turns of the other conversations
    jsonl:FILE    (or specbench:FILE) the first held_out prompts are held out, the ones after them train
    """
    from accelgen.datasets import load_dataset, prompt_token_ids

    if count < 1 or held_out < 1:
        raise InputError(f"need at least one training and one held-out prompt, got {count} and {held_out}")
    if dataset == "sharegpt":
        held, training = load_dataset("sharegpt", limit=held_out), sharegpt_training_prompts(count)
    else:
        prompts = load_dataset(dataset)
        held, training = prompts[:held_out], prompts[held_out : held_out + count]
    if len(held) < held_out or not training:
        raise InputError(f"dataset {dataset!r} gave {len(held)} held-out and {len(training)} training prompts; "
                         f"--held-out {held_out} and at least one to train on are needed")
    return ([prompt_token_ids(tokenizer, p) for p in training], [prompt_token_ids(tokenizer, p) for p in held])


def sharegpt_training_prompts(count: int) -> list:
    """The first count ShareGPT prompts outside the `sharegpt` benchmark's sample, in file order."""
    from accelgen.datasets import unsampled_sharegpt_prompts

    return list(itertools.islice(unsampled_sharegpt_prompts(), count))


# --- saving a distilled draft ---


def distilled_for(target_model, target_name: str) -> dict:
    """What `distillspec.json` records about the target, so that the draft is refused for any other."""
    return {"target": target_name, "target_fingerprint": model_fingerprint(target_model),
            "target_vocab_size": target_model.config.vocab_size}


def save_distilled(draft_model, tokenizer, folder: Path, info: dict) -> None:
    """The draft as a model folder (weights, config, tokenizer) with distillspec.json beside its weights; every file
    written atomically, distillspec.json removed first and written last (never an old one beside new weights)."""
    (Path(folder) / DISTILLSPEC_FILE).unlink(missing_ok=True)
    save_pretrained_atomically(folder, draft_model, tokenizer)
    write_json_atomically(Path(folder) / DISTILLSPEC_FILE, info)

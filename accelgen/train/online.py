"""Online speculative decoding (Liu et al. 2023, arXiv:2310.07177): the draft model keeps learning from
the target while serving, on the positions where the target rejected its drafts.

The method lives here, beside the distillation it runs (train/distill.py), because its drafter is also a
learner: nothing below the trainers may import training code.

Drafting is `speculative`'s (OnlineDrafter is a DraftModelDrafter). After each verification, a rejected draft
is recorded in an `OnlineLearner`: the committed context up to the rejected token, and the target's
distribution at that position, which the verifier's logits already hold. Only the k most likely tokens of that
distribution are kept (`target_top_k`); the divergence then compares the two models over those k tokens and
the rest of the mass (train/distill.py). A request's tokens are stored once, with its rejected positions, so
a buffered position costs a few hundred bytes (k ids and log-probabilities), not a vocabulary-sized row.

Every `interval` requests, the learner runs `update_steps` AdamW steps on everything buffered, with the
chosen divergence, and then clears the buffer. Each step takes one draft forward and backward per buffered
request. The draft model is **updated in place**: every later request sees the new weights, and so does
anything else that uses the same model object. Training needs float32 weights (see
trainable_parameters). It trains the last `train_layers` decoder layers, or all of them, and the final norm.

Sharing: the learner is passed as the `learner=` option, as `trie-lookahead` is given its trie, so that it
persists across requests: `learner = OnlineLearner()`, then the same learner for every call. There is no
hidden module-level learner. Without the option each call gets a fresh one, which can learn only from that
one request, and only with interval 1. `accelgen serve --method online` keeps one learner for the server's
life. A learner trains one draft model: the first one it is used with. It is not thread-safe: share it
between requests that run one after another, or under one lock, as the server's engine does. Training runs
when a request ends, so with interval 5 every fifth request pays for the update before it returns.

Lossless: verification is unchanged, and the weights change only between requests, after a request has
finished; so decoding stays greedy-exact at temperature 0 and keeps the target's distribution when sampling.
(In the server, requests in flight during an update go on with the new weights and their stale draft cache.
That makes their drafts worse, but their output is still exact.)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from accelgen.atomic import save_figure_atomically
from accelgen.draft import Draft, Verdict
from accelgen.drafters.base import BuildContext
from accelgen.drafters.draft_model import DraftingOptions, DraftModelDrafter, scheduled_draft_model_drafter
from accelgen.errors import InputError
from accelgen.loop import generate
from accelgen.registry import MethodOptions, MethodSpec, Part, register
from accelgen.train.distill import Example, check_divergence, distillation_step, trainable_parameters


@dataclass
class Rejections:
    """One request's rejected draft positions; tokens[:i + 1] is the context of position i, whose logits predict
    the token the draft got wrong."""

    tokens: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    target_ids: list[torch.Tensor] = field(default_factory=list)  # (k,) long each: the target's top-k tokens
    target_log_probs: list[torch.Tensor] = field(default_factory=list)  # (k,) float32 each: their log-probabilities

    def add(self, tokens: list[int], target_logits: torch.Tensor, top_k: int) -> None:
        """A rejection after context `tokens`, where the target's logits were target_logits (vocab,)."""
        top = torch.log_softmax(target_logits.float(), dim=-1).topk(min(top_k, len(target_logits)))
        self.tokens = tokens  # the context grows within a request: the latest one holds every earlier one
        self.positions.append(len(tokens) - 1)
        self.target_ids.append(top.indices.clone())  # clones: the verifier's logits may be inference tensors
        self.target_log_probs.append(top.values.clone())

    def drop_oldest(self) -> None:
        for column in (self.positions, self.target_ids, self.target_log_probs):
            del column[0]

    def example(self) -> Example:
        return Example(torch.tensor(self.tokens[: self.positions[-1] + 1]), torch.tensor(self.positions),
                       torch.stack(self.target_log_probs), torch.stack(self.target_ids))


class OnlineLearner:
    """The rejected positions buffered across requests, the request count, and the draft model it trains
    (with its AdamW state, kept from update to update). `updates` has a row per update: what it trained on,
    its loss before and after, how long it took."""

    def __init__(self):
        self.buffer: list[Rejections] = []  # oldest request first
        self.requests = 0  # requests ended
        self.updates: list[dict] = []
        self.draft_model = None
        self.train_layers: int | None = None
        self.parameters: list[torch.nn.Parameter] = []
        self.optimizer: torch.optim.AdamW | None = None

    @property
    def buffered(self) -> int:
        """Rejected positions in the buffer."""
        return sum(len(rejections.positions) for rejections in self.buffer)

    def bind(self, draft_model, train_layers: int | None) -> None:
        """Train this draft model (the first one given; any other is an error), float32, its last train_layers."""
        if not isinstance(draft_model, torch.nn.Module):
            raise InputError("online trains its draft model: pass a model, not a runner")
        if self.draft_model is None:
            self.parameters = trainable_parameters(draft_model, train_layers)
            self.draft_model, self.train_layers = draft_model, train_layers
        elif draft_model is not self.draft_model:
            raise InputError("this OnlineLearner trains another draft model: use one learner per draft model")
        elif train_layers != self.train_layers:
            raise InputError(f"this OnlineLearner trains train_layers={self.train_layers}, not {train_layers}")

    def record(self, rejections: Rejections, tokens: list[int], target_logits: torch.Tensor, top_k: int,
               buffer_size: int) -> None:
        """Add a rejection to a request's record (buffered from its first rejection); the oldest positions go
        once more than buffer_size are held."""
        if not any(held is rejections for held in self.buffer):
            self.buffer.append(rejections)
        rejections.add(tokens, target_logits, top_k)
        while self.buffered > buffer_size:
            self.buffer[0].drop_oldest()
            if not self.buffer[0].positions:
                del self.buffer[0]

    def end_request(self, *, interval: int, update_steps: int, divergence: str, learning_rate: float) -> None:
        """Count a finished request; every interval-th one, learn from the buffer and clear it."""
        self.requests += 1
        if self.requests % interval == 0 and self.buffer:
            self.learn(update_steps=update_steps, divergence=divergence, learning_rate=learning_rate)

    def learn(self, *, update_steps: int, divergence: str, learning_rate: float) -> dict:
        """update_steps AdamW steps on every buffered position, then an empty buffer; returns the update's row."""
        started = time.perf_counter()
        if self.optimizer is None:
            self.optimizer = torch.optim.AdamW(self.parameters, lr=learning_rate)
        for group in self.optimizer.param_groups:
            group["lr"] = learning_rate
        examples = [rejections.example() for rejections in self.buffer]
        losses = [distillation_step(self.draft_model, self.optimizer, self.parameters, examples, divergence)
                  for _ in range(update_steps)]
        row = {"after_request": self.requests, "positions": self.buffered, "requests_buffered": len(self.buffer),
               "loss_first_step": losses[0], "loss_last_step": losses[-1], "seconds": time.perf_counter() - started}
        self.updates.append(row)
        self.buffer = []
        return row


class OnlineDrafter(DraftModelDrafter):
    """`speculative`'s drafter that also records its rejected drafts in a learner, and tells it when the
    request ends (close)."""

    def __init__(self, draft_model, sampling, generator, *, learner: OnlineLearner, interval: int = 5,
                 buffer_size: int = 512, divergence: str = "fkl", learning_rate: float = 1e-5, update_steps: int = 4,
                 target_top_k: int = 32, train_layers: int | None = None, **draft_options):
        for name, value in (("interval", interval), ("buffer_size", buffer_size), ("update_steps", update_steps),
                            ("target_top_k", target_top_k)):
            if not isinstance(value, int) or value < 1:
                raise InputError(f"{name} must be an integer >= 1, got {value!r}")
        if not isinstance(learning_rate, (int, float)) or learning_rate <= 0:
            raise InputError(f"learning_rate must be a number > 0, got {learning_rate!r}")
        check_divergence(divergence)
        if not isinstance(learner, OnlineLearner):
            raise InputError(f"learner must be an OnlineLearner, not {type(learner).__name__}")
        super().__init__(draft_model, sampling, generator, **draft_options)
        learner.bind(draft_model, train_layers)
        self.learner = learner
        self.learning = dict(interval=interval, update_steps=update_steps, divergence=divergence,
                             learning_rate=learning_rate)
        self.buffer_size, self.target_top_k = buffer_size, target_top_k
        self.rejections = Rejections()  # this request's
        self.context: list[int] = []  # the context of the last draft
        self.closed = False

    def draft_steps(self, context: torch.Tensor, max_nodes: int):
        self.context = context.tolist()
        return (yield from super().draft_steps(context, max_nodes))

    def update(self, draft: Draft, verdict: Verdict, target_logits: torch.Tensor) -> None:
        """target_logits: (n + 1, vocab), row i is the target's distribution for draft node i (a chain)."""
        super().update(draft, verdict, target_logits)
        accepted = len(verdict.accepted)
        if accepted < len(draft):  # node `accepted` was rejected: learn what the target wanted there
            tokens = self.context + draft.tokens[:accepted].tolist()
            self.learner.record(self.rejections, tokens, target_logits[accepted], self.target_top_k, self.buffer_size)

    def close(self) -> None:
        """The request has ended: the learner counts it, and may update the draft (once per request)."""
        if not self.closed:
            self.closed = True
            self.learner.end_request(**self.learning)


@dataclass(frozen=True)
class LearningOptions(MethodOptions):
    learner: object = None  # an OnlineLearner shared across calls (None: one for this request alone)
    interval: int = 5  # requests between updates
    buffer_size: int = 512  # rejected positions kept
    divergence: str = "fkl"
    learning_rate: float = 1e-5
    update_steps: int = 4  # optimizer steps per update
    target_top_k: int = 32  # target probabilities kept per rejected position
    train_layers: int | None = None  # the draft's last layers trained (None: all)


@dataclass(frozen=True)
class OnlineOptions(DraftingOptions, LearningOptions):
    """The learning options, then speculative's drafting ones (a dataclass lists its last base's fields first)."""


def _make(build: BuildContext, options: OnlineOptions) -> OnlineDrafter:
    learner = OnlineLearner() if options.learner is None else options.learner
    return scheduled_draft_model_drafter(build, OnlineDrafter, **{**options.as_dict(), "learner": learner})


register(
    MethodSpec(
        name="online",
        family="speculative",
        lossless="distribution-exact",
        paper="Liu et al. 2023, arXiv:2310.07177",
        summary="speculative decoding whose draft model keeps distilling, between requests, on the positions the "
                "target rejected; share the learner across calls via learner=",
        drafter=Part(_make, OnlineOptions),
        needs=("draft_model",),
        draft_budget="measured",  # drafts capped by the measured costs unless the request fixes their length
        pytorch_draft=True,  # it trains the draft's weights
    )
)


# --- a stream of requests, for `accelgen train online` ---


def stream_requests(target_model, draft_model, tokenizer, prompts: list[list[int]], learner: OnlineLearner, *,
                    max_new_tokens: int, gamma: int = 5, baseline_draft=None,
                    progress: Callable[[dict], None] | None = None, **learning) -> list[dict]:
    """Greedy `online` decoding of each prompt in turn with one learner (learning: the method's options);
    a row per request with its α, τ and the update that followed it (None if none). With baseline_draft (an
    untouched copy of the draft), each request also runs `speculative` with it: α without learning."""
    rows = []
    for index, prompt in enumerate(prompts):
        updates = len(learner.updates)
        stats = generate(target_model, tokenizer, prompt, method="online", draft_model=draft_model,
                         max_new_tokens=max_new_tokens, temperature=0.0, gamma=gamma, learner=learner,
                         **learning).stats
        row = {"request": index + 1, "acceptance_rate": stats["acceptance_rate"],
               "mean_accepted_tokens": stats["mean_accepted_tokens"], "new_tokens": stats["new_tokens"],
               "seconds": stats["seconds"], "update": learner.updates[-1] if len(learner.updates) > updates else None}
        if baseline_draft is not None:
            baseline = generate(target_model, tokenizer, prompt, method="speculative", draft_model=baseline_draft,
                                max_new_tokens=max_new_tokens, temperature=0.0, gamma=gamma).stats
            row["baseline_acceptance_rate"] = baseline["acceptance_rate"]
        rows.append(row)
        if progress is not None:
            progress({"step": index + 1, **row, "updates": len(learner.updates)})
    return rows


def moving_average(values: list[float], window: int) -> list[float]:
    """The mean of each value and the up to window - 1 values before it."""
    return [sum(values[max(0, i - window + 1) : i + 1]) / (i + 1 - max(0, i - window + 1)) for i in range(len(values))]


def plot_acceptance(rows: list[dict], path: Path, window: int) -> None:
    """α per request, its moving average over `window` requests, the updates, and the baseline if measured."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    requests = [row["request"] for row in rows]
    figure, axes = plt.subplots(figsize=(8, 4))
    series = [("acceptance_rate", "online", "C0")]
    if rows and "baseline_acceptance_rate" in rows[0]:
        series.append(("baseline_acceptance_rate", "draft not updated (speculative)", "0.5"))
    for key, label, color in series:
        alpha = [100 * row[key] for row in rows]
        axes.plot(requests, alpha, "o", color=color, alpha=0.35, markersize=4)
        axes.plot(requests, moving_average(alpha, window), color=color, label=f"{label}, mean of last {window}")
    for row in rows:
        if row["update"] is not None:
            axes.axvline(row["request"] + 0.5, color="C1", alpha=0.25, linewidth=1)
    axes.set_xlabel("request (vertical lines: draft updated)")
    axes.set_ylabel("acceptance rate α (%)")
    axes.set_title("Online speculative decoding: acceptance over a stream of requests")
    axes.legend()
    figure.tight_layout()
    save_figure_atomically(figure, path)
    plt.close(figure)

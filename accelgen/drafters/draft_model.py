"""Draft-model speculative decoding (Leviathan et al. 2023) and speculative sampling (Chen et al. 2023).

A smaller model with the same vocabulary drafts gamma tokens autoregressively; the target verifies them in
one forward. The draft model keeps its own KV cache; before each proposal it is rolled back to the longest
prefix it shares with the committed context, so rejected draft tokens are forgotten.

gamma_schedule: "constant"; "heuristic" (HF's: grow by 2 on full acceptance, shrink by 1 otherwise); or
"cost": the γ with the best predicted speedup (accelgen/theory.py) from running estimates of the acceptance
α and the cost ratio c, both measured while generating, so γ fits this machine, these models and this text.
"""

from __future__ import annotations

import time

import torch

from accelgen.draft import Draft, Verdict
from accelgen.models.batch import forward_alone
from accelgen.models.llamacpp import LlamaCppModel
from accelgen.models.runner import ModelRunner, runner_for
from accelgen.registry import MethodSpec, register
from accelgen.sampling import SamplingConfig, logits_to_probs, sample
from accelgen.costs import PROBE_EVERY, best_draft_length, verify_ratios
from accelgen.profile import interpolate
from accelgen.theory import AcceptanceEstimate

GAMMA_SCHEDULES = ("constant", "heuristic", "cost")
# the options of DraftModelDrafter's drafting, for every method that drafts with it (speculative, distillspec, online)
DRAFTING_OPTIONS = {"gamma": 5, "gamma_schedule": "constant", "max_gamma": 32, "confidence_threshold": 0.0}


class DraftModelDrafter:
    def __init__(
        self,
        draft_model,
        sampling: SamplingConfig,
        generator: torch.Generator | None,
        gamma: int = 5,
        gamma_schedule: str = "constant",
        max_gamma: int = 32,
        confidence_threshold: float = 0.0,
        greedy_draft_probs: bool = False,
        verify_ratio: dict[int, float] | None = None,
    ):
        """draft_model: a model, or a runner over one (`self-speculative`: the target with layers skipped;
        `layerskip`: the target's first layers, in the target's own cache).
        greedy_draft_probs: at temperature 0, also attach the draft model's distribution (softmax at
        temperature 1) at each drafted position, for verification rules that use it (`contrastive`).
        verify_ratio: the target's measured r(k) (accelgen/costs.py), for gamma_schedule="cost"."""
        if gamma < 1:
            raise ValueError(f"gamma must be >= 1, got {gamma}")
        if gamma_schedule not in GAMMA_SCHEDULES:
            raise ValueError(f"unknown gamma_schedule {gamma_schedule!r}; choose one of {GAMMA_SCHEDULES}")
        self.runner = runner_for(draft_model) if isinstance(draft_model, (torch.nn.Module, LlamaCppModel)) else draft_model
        self.sampling = sampling
        self.generator = generator
        self.gamma = gamma
        self.gamma_schedule = gamma_schedule
        self.max_gamma = max_gamma
        self.confidence_threshold = confidence_threshold
        self.greedy_draft_probs = greedy_draft_probs
        self.cached_tokens: list[int] = []  # tokens whose KV the draft cache holds, in order
        self.costs = CostEstimate(verify_ratio or {1: 1.0}) if gamma_schedule == "cost" else None

    def propose(self, context: torch.Tensor, max_nodes: int) -> Draft:
        return forward_alone(self.draft_steps(context, max_nodes))

    def draft_steps(self, context: torch.Tensor, max_nodes: int):
        """propose() as a generator of its draft-model forwards: yields (runner, token_ids) and is sent back
        the (vocab,) logits after them, so a server can run many sequences' drafts in one batched forward."""
        # the draft model may have a shorter context than the target: draft less, or not at all
        gamma = min(self.gamma, max_nodes, self.runner.max_positions - len(context))
        if gamma <= 0:
            return Draft.empty()
        started = time.perf_counter()
        context_ids = context.tolist()
        logits = yield from catch_up_steps(self.runner, self.cached_tokens, context_ids)
        self.cached_tokens = context_ids
        tokens, probs = [], []
        for step in range(gamma):
            if self.sampling.greedy:
                token = int(logits.argmax())
                confidence = float(torch.softmax(logits, -1)[token]) if self.confidence_threshold else 1.0
                if self.greedy_draft_probs:
                    probs.append(torch.softmax(logits, -1))
            else:
                step_probs = logits_to_probs(logits, self.sampling)
                token = sample(step_probs, self.generator)
                probs.append(step_probs)
                confidence = float(step_probs[token])
            tokens.append(token)
            # a draft the draft model itself doubts is likely rejected: stop drafting (depends on the draft alone,
            # so verification stays exact)
            if confidence < self.confidence_threshold:
                break
            if step < gamma - 1:  # the last draft token needs no forward of its own
                logits = yield self.runner, torch.tensor([token])
                self.cached_tokens.append(token)
        draft_probs = torch.stack(probs) if probs else None
        if self.costs is not None:
            self.costs.drafted(forwards=len(tokens), seconds=time.perf_counter() - started)
        return Draft.chain(torch.tensor(tokens), draft_probs)

    def update(self, draft: Draft, verdict: Verdict, target_logits: torch.Tensor) -> None:
        if self.gamma_schedule == "heuristic":  # as HF assisted generation: grow on full acceptance, else shrink
            if len(verdict.accepted) == len(draft):
                self.gamma = min(self.gamma + 2, self.max_gamma)
            else:
                self.gamma = max(self.gamma - 1, 1)
        elif self.costs is not None:
            self.costs.verified(drafted=len(draft), accepted=len(verdict.accepted))
            self.gamma = self.costs.best_gamma(self.gamma, self.max_gamma)


class CostEstimate:
    """Running estimates of α (per draft token) and c (draft forward / target step) for gamma_schedule="cost",
    and the target's measured verification cost r(k).

    The target step is timed from the end of a proposal to its verdict (the target forward over γ + 1 tokens
    and verification), so one decoding step is that time over r(γ + 1). The first step is left out of the
    timings: there both models also read the prompt. Old observations fade (DECAY per step), so γ follows the
    text: long on boilerplate, short where the draft model guesses badly, and 0 (plain decoding) where no
    draft length pays; then one step in PROBE_EVERY drafts a single token, so α keeps being measured.
    """

    DECAY = AcceptanceEstimate.DECAY

    def __init__(self, verify_ratio: dict[int, float]):
        self.acceptance = AcceptanceEstimate()
        self.verify_ratio = lambda tokens: interpolate(verify_ratio, tokens)
        self.draft_seconds: float | None = None  # per draft forward
        self.target_seconds: float | None = None  # per one-token target step
        self.steps = 0
        self.steps_without_draft = 0
        self._draft_done = 0.0
        self._drafted = 0

    def drafted(self, forwards: int, seconds: float) -> None:
        self._draft_done = time.perf_counter()
        if self.steps > 0 and forwards > 0:
            self.draft_seconds = _fade(self.draft_seconds, seconds / forwards)

    def verified(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return  # a plain decoding step (γ = 0): neither α nor the costs are observed
        if self.steps > 0:
            step = (time.perf_counter() - self._draft_done) / self.verify_ratio(drafted + 1)
            self.target_seconds = _fade(self.target_seconds, step)
        self.steps += 1
        self.acceptance.observe(drafted, accepted)

    def best_gamma(self, gamma: int, max_gamma: int) -> int:
        """The γ (0 = no draft) with the best predicted speedup; `gamma` unchanged until both costs are measured."""
        if self.draft_seconds is None or self.target_seconds is None:
            return gamma
        best = best_draft_length(self.acceptance.alpha, self.draft_seconds / self.target_seconds, max_gamma,
                                 self.verify_ratio)
        if best == 0:
            self.steps_without_draft += 1
            if self.steps_without_draft % PROBE_EVERY == 0:
                best = 1
        return best


def _fade(average: float | None, value: float) -> float:
    return value if average is None else CostEstimate.DECAY * average + (1 - CostEstimate.DECAY) * value


def catch_up(runner: ModelRunner, cached_tokens: list[int], context: list[int]) -> torch.Tensor:
    """Roll a draft cache holding cached_tokens back to what it shares with context and feed the rest;
    returns the (vocab,) logits after context. At least the last token is always fed, to get its logits."""
    return forward_alone(catch_up_steps(runner, cached_tokens, context))


def catch_up_steps(runner: ModelRunner, cached_tokens: list[int], context: list[int]):
    """catch_up as a generator of its one forward (see DraftModelDrafter.draft_steps)."""
    shared = roll_back(runner, cached_tokens, context)
    return (yield runner, torch.tensor(context[shared:]))


def roll_back(runner: ModelRunner, cached_tokens: list[int], context: list[int]) -> int:
    """Keep the longest cached prefix shared with context, short of its last token; returns its length."""
    shared = shared_prefix(cached_tokens, context)
    runner.keep(shared, [])
    return shared


def shared_prefix(cached_tokens: list[int], context: list[int]) -> int:
    """Length of the longest prefix of cached_tokens that context shares, short of context's last token."""
    shared = 0
    limit = min(len(cached_tokens), len(context) - 1)
    while shared < limit and cached_tokens[shared] == context[shared]:
        shared += 1
    return shared


def check_vocabularies(target_model, draft_model) -> None:
    target_vocab, draft_vocab = target_model.config.vocab_size, draft_model.config.vocab_size
    if target_vocab != draft_vocab:
        raise ValueError(
            f"draft model vocabulary ({draft_vocab} tokens) differs from the target's ({target_vocab}); "
            "speculative decoding needs a draft model with the same tokenizer"
        )


def _make(target_model, *, draft_model, sampling, generator, tokenizer=None, **options):
    check_vocabularies(target_model, draft_model)
    return DraftModelDrafter(draft_model, sampling, generator, **cost_options(target_model, options))


def cost_options(target_model, options: dict) -> dict:
    """options, plus the target's measured r(k) when γ follows the costs (measured once per machine, cached)."""
    if options.get("gamma_schedule") != "cost":
        return options
    return {**options, "verify_ratio": verify_ratios(target_model)}


register(
    MethodSpec(
        name="speculative",
        family="speculative",
        lossless="distribution-exact",
        paper="Leviathan et al. 2023, arXiv:2211.17192; Chen et al. 2023, arXiv:2302.01318",
        summary="a small draft model proposes gamma tokens, the target verifies them in one forward",
        make_drafter=_make,
        needs=("draft_model",),
        options=dict(DRAFTING_OPTIONS),
    )
)

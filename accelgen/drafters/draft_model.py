"""Draft-model speculative decoding (Leviathan et al. 2023) and speculative sampling (Chen et al. 2023).

A smaller model with the same vocabulary drafts gamma tokens autoregressively; the target verifies them in
one forward. The draft model keeps its own KV cache; before each proposal it is rolled back to the longest
prefix it shares with the committed context, so rejected draft tokens are forgotten.

gamma_schedule: "constant"; "heuristic" (HF's: grow by 2 on full acceptance, shrink by 1 otherwise); or
"cost": each step, the γ in 0..max_gamma with the best predicted speedup E(α, γ) / (γc + r(γ+1)) from the
target's verification cost r(k) and the draft's cost ratio c, measured once per machine (accelgen/costs.py),
and the running acceptance α, c following what each step measures; γ = 0 (plain decoding) when no length
pays. So γ fits this machine, these models and this text (`scheduled` wraps the drafter in the budget).

The draft model's logits go through the request's logits processors (sampling.processors) with the context of
each drafted position, as the target's do, and with a seed it draws each position with the target's Gumbel noise
(sampling.noise): both only raise acceptance, verification is exact for any draft.
"""

from __future__ import annotations

import torch

from accelgen.costs import BudgetedDrafter, measured_budget
from accelgen.draft import Draft, Verdict
from accelgen.models.batch import forward_alone
from accelgen.models.llamacpp import LlamaCppModel
from accelgen.models.runner import ModelRunner, runner_for
from accelgen.registry import MethodSpec, register
from accelgen.sampling import SamplingConfig, gumbel_choice, logits_to_probs, sample

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
    ):
        """draft_model: a model, or a runner over one (`self-speculative`: the target with layers skipped;
        `layerskip`: the target's first layers, in the target's own cache).
        greedy_draft_probs: at temperature 0, also attach the draft model's distribution (softmax at
        temperature 1) at each drafted position, for verification rules that use it (`contrastive`).
        gamma_schedule="cost": drafts max_gamma tokens, for the measured budget to cap (see `scheduled`)."""
        if gamma < 1:
            raise ValueError(f"gamma must be >= 1, got {gamma}")
        if gamma_schedule not in GAMMA_SCHEDULES:
            raise ValueError(f"unknown gamma_schedule {gamma_schedule!r}; choose one of {GAMMA_SCHEDULES}")
        self.runner = runner_for(draft_model) if isinstance(draft_model, (torch.nn.Module, LlamaCppModel)) else draft_model
        self.sampling = sampling
        self.generator = generator
        self.gamma = max_gamma if gamma_schedule == "cost" else gamma
        self.gamma_schedule = gamma_schedule
        self.max_gamma = max_gamma
        self.confidence_threshold = confidence_threshold
        self.greedy_draft_probs = greedy_draft_probs
        self.cached_tokens: list[int] = []  # tokens whose KV the draft cache holds, in order

    def propose(self, context: torch.Tensor, max_nodes: int) -> Draft:
        return forward_alone(self.draft_steps(context, max_nodes))

    def draft_steps(self, context: torch.Tensor, max_nodes: int):
        """propose() as a generator of its draft-model forwards: yields (runner, token_ids) and is sent back
        the (vocab,) logits after them, so a server can run many sequences' drafts in one batched forward."""
        # the draft model may have a shorter context than the target: draft less, or not at all
        gamma = min(self.gamma, max_nodes, self.runner.max_positions - len(context))
        if gamma <= 0:
            return Draft.empty()
        context_ids = context.tolist()
        logits = yield from catch_up_steps(self.runner, self.cached_tokens, context_ids)
        self.cached_tokens = list(context_ids)  # a copy: it grows with the drafted tokens, context_ids must not
        tokens, probs = [], []
        for step in range(gamma):
            if self.sampling.processors is not None:
                logits = self.sampling.processors.row(torch.tensor(context_ids + tokens), logits)
            if self.sampling.greedy:
                token = int(logits.argmax())
                confidence = float(torch.softmax(logits, -1)[token]) if self.confidence_threshold else 1.0
                if self.greedy_draft_probs:
                    probs.append(torch.softmax(logits, -1))
            else:
                step_probs = logits_to_probs(logits, self.sampling)
                token = self.draw(step_probs, position=len(context_ids) + step)
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
        return Draft.chain(torch.tensor(tokens), draft_probs)

    def draw(self, probs: torch.Tensor, position: int) -> int:
        """A draft token for an absolute position from its (vocab,) sampling probabilities: with the seeded
        per-position noise when there is one (the target's choice there whenever the two models agree), else a
        sample from the generator."""
        noise = self.sampling.noise
        if noise is None:
            return sample(probs, self.generator)
        return int(gumbel_choice(probs[None], noise.at(position)[None])[0])

    def update(self, draft: Draft, verdict: Verdict, target_logits: torch.Tensor) -> None:
        if self.gamma_schedule == "heuristic":  # as HF assisted generation: grow on full acceptance, else shrink
            if len(verdict.accepted) == len(draft):
                self.gamma = min(self.gamma + 2, self.max_gamma)
            else:
                self.gamma = max(self.gamma - 1, 1)


def scheduled(drafter: DraftModelDrafter, target_model, draft_model=None, cost_ratio: float | None = None):
    """The drafter as its gamma_schedule asks: itself, or for "cost" capped each step by the budget measured for
    this target and draft model (cost_ratio: c before it is measured, where there is no draft model to time)."""
    if drafter.gamma_schedule != "cost":
        return drafter
    return BudgetedDrafter(drafter, measured_budget(target_model, draft_model, drafter.max_gamma, cost_ratio))


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
    return scheduled(DraftModelDrafter(draft_model, sampling, generator, **options), target_model, draft_model)


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

"""Draft-model speculative decoding (Leviathan et al. 2023) and speculative sampling (Chen et al. 2023).

A smaller model with the same vocabulary drafts gamma tokens autoregressively; the target verifies them in
one forward. The draft model keeps its own KV cache; before each proposal it is rolled back to the longest
prefix it shares with the committed context, so rejected draft tokens are forgotten (drafters/draft_decoding.py,
the draft loop this drafter shares with `universal` and `triforce`).

gamma_schedule: "constant"; "heuristic" (HF's: grow by 2 on full acceptance, shrink by 1 otherwise); or
"cost": each step, the γ in 0..max_gamma with the best predicted speedup E(α, γ) / (γc + r(γ+1)) from the
target's verification cost r(k) and the draft's cost ratio c, measured once per machine (accelgen/costs.py),
and the running acceptance α, c following what each step measures; γ = 0 (plain decoding) when no length
pays. So γ fits this machine, these models and this text (`scheduled` wraps the drafter in the budget).
By default (gamma "auto") the loop caps each step's draft of at most DRAFT_GAMMA tokens by that same measured
budget (`MethodSpec.draft_budget`), so that the defaults never lose to plain decoding; gamma=N fixes the length.

The draft model's logits go through the request's logits processors (sampling.processors) with the context of
each drafted position, as the target's do, and with a seed it draws each position with the target's Gumbel noise
(sampling.noise): both only raise acceptance, verification is exact for any draft.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from accelgen.costs import SELF_DRAFT_COST, measured_budget
from accelgen.draft import Draft, Verdict
from accelgen.drafters.budget import AUTO_LENGTH, BudgetedDrafter, draft_length
from accelgen.drafters.draft_decoding import TokenChoice, decode_draft_steps
from accelgen.models.batch import forward_alone
from accelgen.models.llamacpp import LlamaCppModel
from accelgen.models.engines import runner_for
from accelgen.drafters.base import BuildContext, ContextCursor, Drafter
from accelgen.errors import InputError
from accelgen.registry import MethodOptions, MethodSpec, Part, register
from accelgen.sampling import SamplingConfig

GAMMA_SCHEDULES = ("constant", "heuristic", "cost")
DRAFT_GAMMA = 5  # a draft model's usual draft length (gamma="auto")
SELF_DRAFT_GAMMA = 4  # the target's own layers' usual draft length (gamma="auto")


@dataclass(frozen=True)
class DraftingOptions(MethodOptions):
    """The options of DraftModelDrafter's drafting, for every method that drafts with it (speculative,
    distillspec, online)."""

    gamma: int | str = AUTO_LENGTH  # tokens drafted per step (AUTO_LENGTH: DRAFT_GAMMA, capped by the measured costs)
    gamma_schedule: str = "constant"  # one of GAMMA_SCHEDULES
    max_gamma: int = 32  # the longest draft a "heuristic" or "cost" schedule grows to
    confidence_threshold: float = 0.0  # stop drafting after a token the draft model gives less


@dataclass(frozen=True)
class SelfDraftingOptions(MethodOptions):
    """The drafting options of methods whose target drafts for itself (self-speculative, layerskip)."""

    gamma: int | str = AUTO_LENGTH  # tokens drafted per step (AUTO_LENGTH: SELF_DRAFT_GAMMA, capped by the costs)
    gamma_schedule: str = "constant"  # one of GAMMA_SCHEDULES
    max_gamma: int = 32  # the longest draft a "heuristic" or "cost" schedule grows to


@dataclass(frozen=True)
class GammaOptions(MethodOptions):
    """The drafting options of methods whose own part is the verification rule (specdec, contrastive, ...)."""

    gamma: int = 5  # tokens drafted per step


class DraftModelDrafter(Drafter):
    batches_draft_forwards = True  # draft_steps

    def __init__(
        self,
        draft_model,
        sampling: SamplingConfig,
        generator: torch.Generator | None,
        gamma: int | str = DRAFT_GAMMA,
        gamma_schedule: str = "constant",
        max_gamma: int = 32,
        confidence_threshold: float = 0.0,
        greedy_draft_probs: bool = False,
    ):
        """draft_model: a model, or a runner over one (`self-speculative`: the target with layers skipped;
        `layerskip`: the target's first layers, in the target's own cache).
        greedy_draft_probs: at temperature 0, also attach the draft model's distribution (softmax at
        temperature 1) at each drafted position, for verification rules that use it (`contrastive`).
        gamma_schedule="cost": drafts max_gamma tokens, for the measured budget to cap (see `scheduled`).
        gamma "auto": DRAFT_GAMMA (the loop caps each draft by the measured costs: MethodSpec.draft_budget)."""
        gamma = draft_length(gamma, DRAFT_GAMMA)
        if gamma_schedule not in GAMMA_SCHEDULES:
            raise InputError(f"unknown gamma_schedule {gamma_schedule!r}; choose one of {GAMMA_SCHEDULES}")
        self.runner = runner_for(draft_model) if isinstance(draft_model, (torch.nn.Module, LlamaCppModel)) else draft_model
        self.choice = TokenChoice(sampling, generator, confidence_threshold, greedy_draft_probs)
        self.gamma = max_gamma if gamma_schedule == "cost" else gamma
        self.gamma_schedule = gamma_schedule
        self.max_gamma = max_gamma
        self.cached_tokens: list[int] = []  # tokens whose KV the draft cache holds, in order
        self.read = ContextCursor()  # the context as a list, read a step's tokens at a time

    def propose(self, context: torch.Tensor, max_nodes: int) -> Draft:
        return forward_alone(self.draft_steps(context, max_nodes))

    def draft_steps(self, context: torch.Tensor, max_nodes: int):
        """propose() as a generator of its draft-model forwards: yields (runner, token_ids) and is sent back
        the (vocab,) logits after them, so a server can run many sequences' drafts in one batched forward."""
        self.read.new_since_last(context)
        tokens, draft_probs = yield from decode_draft_steps(self.runner, self.cached_tokens, self.read.tokens,
                                                            min(self.gamma, max_nodes), self.choice)
        return Draft.chain(torch.tensor(tokens, dtype=torch.long), draft_probs)

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


def check_vocabularies(target_model, draft_model) -> None:
    target_vocab, draft_vocab = target_model.config.vocab_size, draft_model.config.vocab_size
    if target_vocab != draft_vocab:
        raise InputError(
            f"draft model vocabulary ({draft_vocab} tokens) differs from the target's ({target_vocab}); "
            "speculative decoding needs a draft model with the same tokenizer"
        )


def draft_model_drafter(build: BuildContext, drafter_class: type = DraftModelDrafter, **arguments):
    """drafter_class(draft model, sampling, generator, **arguments) over the build's draft model, which must
    share the target's vocabulary: the drafter of every method that drafts with a draft model of its own."""
    check_vocabularies(build.target_model, build.draft_model)
    return drafter_class(build.draft_model, build.sampling, build.generator, **arguments)


def scheduled_draft_model_drafter(build: BuildContext, drafter_class: type = DraftModelDrafter, **arguments):
    """draft_model_drafter, as its gamma_schedule asks (speculative, distillspec, online)."""
    return scheduled(draft_model_drafter(build, drafter_class, **arguments), build.target_model, build.draft_model)


def make_gamma_drafter(build: BuildContext, options: GammaOptions) -> DraftModelDrafter:
    """The drafter of a method whose own part is its verification rule: gamma draft-model tokens per step."""
    return draft_model_drafter(build, gamma=options.gamma)


def make_self_drafter(runner, build: BuildContext, options: SelfDraftingOptions):
    """The target drafting for itself through `runner`, over its own layers (some skipped, or the first ones)."""
    drafter = DraftModelDrafter(runner, build.sampling, build.generator,
                                gamma=draft_length(options.gamma, SELF_DRAFT_GAMMA),
                                gamma_schedule=options.gamma_schedule, max_gamma=options.max_gamma)
    return scheduled(drafter, build.target_model, cost_ratio=SELF_DRAFT_COST)


def _make(build: BuildContext, options: DraftingOptions):
    return scheduled_draft_model_drafter(build, **options.as_dict())


register(
    MethodSpec(
        name="speculative",
        family="speculative",
        lossless="distribution-exact",
        paper="Leviathan et al. 2023, arXiv:2211.17192; Chen et al. 2023, arXiv:2302.01318",
        summary="a small draft model proposes gamma tokens, the target verifies them in one forward",
        drafter=Part(_make, DraftingOptions),
        needs=("draft_model",),
        draft_budget="measured",  # drafts capped by the measured costs unless the request fixes their length
    )
)

"""A drafter capped each step by the measured draft budget (accelgen/costs.py's DraftBudget), down to no draft.

`BudgetedDrafter` wraps another drafter: the budget decides each step's longest worthwhile draft from the
target's measured r(k), the drafting cost c and the running acceptance α, and the wrapped drafter drafts at most
that. It is a `Drafter` like any other: it declares what it does from the wrapped drafter's declared
capabilities (read once, when it is built), and forwards `update`, `close` and `describe` to it.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from accelgen import hardware
from accelgen.costs import MAX_DRAFT, SELF_DRAFT_COST, DraftBudget, measured_budget
from accelgen.draft import Draft, Verdict
from accelgen.drafters.base import Drafter
from accelgen.errors import InputError
from accelgen.models.batch import forward_alone

# The default of a draft-length option (gamma) of the methods whose drafts the measured budget caps by default
# (`MethodSpec.draft_budget`): the method's usual length, each step capped by the budget (accelgen/loop.py)
AUTO_LENGTH = "auto"


class BudgetedDrafter(Drafter):
    """A drafter whose drafts a DraftBudget caps each step; the drafting itself is the wrapped drafter's.

    A step the budget gives no draft is plain decoding, and the wrapped drafter takes no part in it (neither
    `propose` nor `update`): it reads the tokens committed meanwhile with its next context. Drafting is timed
    from the call to the draft, the step from the draft to `update`; only steps right after another drafting
    step are typical (the first also reads the prompt, and after plain steps a draft model first reads what it
    missed).

    Capabilities: `batches_draft_forwards` is the wrapped drafter's (its draft-model forwards stay batchable
    through `draft_steps`); `draft_budget` is the budget. A drafter that drafts with the target's own forward
    (`drafts_with_target`) or inside the verifying forward (`drafts_in_verify`) pays that forward whatever its
    draft's length, so no budget applies to it: wrapping one is refused.
    """

    def __init__(self, inner: Drafter, budget: DraftBudget):
        if inner.drafts_with_target or inner.drafts_in_verify:
            raise InputError(f"{type(inner).__name__} drafts within a target forward, which it pays whatever its "
                             "draft's length: a draft budget cannot apply to it")
        self.inner = inner
        self.draft_budget = budget
        self.batches_draft_forwards = inner.batches_draft_forwards
        self._drafting = False  # whether the wrapped drafter proposed this step's draft
        self._drafted_before = False  # whether the step before did
        self._draft_seconds = 0.0
        self._drafted_at = 0.0

    def propose(self, context: torch.Tensor, max_nodes: int) -> Draft:
        return forward_alone(self.draft_steps(context, max_nodes))

    def draft_steps(self, context: torch.Tensor, max_nodes: int):
        """The wrapped drafter's draft_steps (or propose) at most the budget's length, as a generator of its model
        forwards (none for a drafter that does not batch them); context (L,) long."""
        limit = min(max_nodes, self.draft_budget.limit())
        self._drafting = limit > 0
        if not self._drafting:
            return Draft.empty()
        self._wait_for_device()
        started = time.perf_counter()
        if self.inner.batches_draft_forwards:
            draft = yield from self.inner.draft_steps(context, limit)
        else:
            draft = self.inner.propose(context, limit)
        self._wait_for_device()
        self._drafted_at = time.perf_counter()
        self._draft_seconds = self._drafted_at - started
        return draft

    def _wait_for_device(self) -> None:
        """Before a clock is read for the cost the budget learns: the device's queued work done. Only then: a
        model-free draft's cost is not learnt, and its steps keep their one host read."""
        if self.draft_budget.learn_cost:
            hardware.synchronize(self.draft_budget.device)

    def update(self, draft: Draft, verdict: Verdict, target_logits: torch.Tensor) -> None:
        drafting, typical = self._drafting, self._drafted_before
        self._drafting = False
        self._drafted_before = drafting
        if not drafting:
            return
        if typical:
            self._wait_for_device()
            step_seconds = time.perf_counter() - self._drafted_at
            self.draft_budget.observe(len(draft), len(verdict.accepted), self._draft_seconds, step_seconds)
        else:
            self.draft_budget.observe(len(draft), len(verdict.accepted))
        self.inner.update(draft, verdict, target_logits)

    def close(self) -> None:
        self.inner.close()

    def describe(self) -> dict | None:
        return self.inner.describe()


def draft_length(value: int | str, usual: int, name: str = "gamma") -> int:
    """A draft-length option as a count: `usual` for AUTO_LENGTH, else the integer given (>= 1)."""
    if value == AUTO_LENGTH:
        return usual
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InputError(f"{name} must be an integer >= 1 or {AUTO_LENGTH!r}, got {value!r}")
    return value


def budgeted(drafter: Drafter, target_model, draft_model=None) -> BudgetedDrafter:
    """Any drafter, capped each step by the measured budget: c measured from its draft model; for drafts by the
    target's own layers (model forwards, no draft model) SELF_DRAFT_COST until measured; else 0 (model-free)."""
    if draft_model is None and drafter.batches_draft_forwards:
        return BudgetedDrafter(drafter, measured_budget(target_model, cost_ratio=SELF_DRAFT_COST))
    return BudgetedDrafter(drafter, measured_budget(target_model, draft_model))


def sized_by_costs(build: Callable[[int], Drafter], size, target_model, fixed_nodes: int = 0) -> Drafter:
    """A model-free drafter of `size` tokens or tree nodes per step, build(size); with size "auto":
    build(MAX_DRAFT + fixed_nodes), each step capped by the measured budget (`DraftBudget`), so that its drafts
    follow this machine's r(k)."""
    if size == "auto":
        budget = measured_budget(target_model, fixed_nodes=fixed_nodes)
        return BudgetedDrafter(build(MAX_DRAFT + fixed_nodes), budget)
    return build(size)

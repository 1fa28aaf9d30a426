"""The budgeted drafter: a Drafter capped each step by the measured draft budget, declaring the wrapped
drafter's capabilities (fake r(k) tables, no real timing)."""

from __future__ import annotations

import pytest
import torch

from accelgen import costs, hardware
from accelgen.costs import DraftBudget
from accelgen.draft import Draft, Verdict
from accelgen.drafters.base import Drafter
from accelgen.drafters.budget import BudgetedDrafter

LINEAR = {k: float(k) for k in (1, 2, 4, 8, 16)}  # every verified token costs a whole forward
FLAT = {k: 1.0 for k in (1, 2, 4, 8, 16)}  # verification as cheap as decoding one token
PROMPT = [5, 17, 923, 4410, 77, 12, 5, 17, 923]


class FakeDrafter(Drafter):
    """Proposes copies of token 7 (as many as max_nodes), recording each call."""

    def __init__(self):
        self.calls = []

    def propose(self, context, max_nodes):
        self.calls.append(("propose", max_nodes))
        return Draft.chain(torch.full((max_nodes,), 7))

    def update(self, draft, verdict, target_logits):
        self.calls.append(("update", len(draft)))

    def close(self):
        self.calls.append(("close",))

    def describe(self):
        return {"drafted": "sevens"}


class FakeModelDrafter(FakeDrafter):
    """Drafts with model forwards a server can batch: yields one ("runner", tokens) per drafted token."""

    batches_draft_forwards = True

    def draft_steps(self, context, max_nodes):
        self.calls.append(("draft_steps", max_nodes))
        for _ in range(max_nodes):
            yield "runner", [7]
        return Draft.chain(torch.full((max_nodes,), 7))


class FakeTargetDrafter(FakeDrafter):
    drafts_with_target = True


def test_caps_drafts_and_leaves_plain_steps_to_the_loop():
    inner = FakeDrafter()
    budgeted = BudgetedDrafter(inner, DraftBudget(FLAT, max_length=5))
    assert isinstance(budgeted, Drafter) and not budgeted.batches_draft_forwards  # no model forwards to batch
    assert budgeted.draft_budget is not None and not budgeted.drafts_with_target and not budgeted.drafts_in_verify
    draft = budgeted.propose(torch.tensor(PROMPT), max_nodes=8)
    assert len(draft) == 5 and inner.calls == [("propose", 5)]
    budgeted.update(draft, Verdict([0, 1], 3), None)
    assert inner.calls[-1] == ("update", 5)
    budgeted.close()
    assert inner.calls[-1] == ("close",) and budgeted.describe() == {"drafted": "sevens"}

    inner = FakeDrafter()
    budgeted = BudgetedDrafter(inner, DraftBudget(LINEAR))
    draft = budgeted.propose(torch.tensor(PROMPT), max_nodes=8)
    budgeted.update(draft, Verdict([], 3), None)
    assert len(draft) == 0 and inner.calls == []  # a plain step: the drafter takes no part in it


def test_a_drafter_of_model_forwards_keeps_them_batchable():
    inner = FakeModelDrafter()
    budgeted = BudgetedDrafter(inner, DraftBudget(FLAT, max_length=3))
    assert budgeted.batches_draft_forwards
    steps = budgeted.draft_steps(torch.tensor(PROMPT), max_nodes=8)
    forwards = []
    try:
        while True:
            forwards.append(next(steps) if not forwards else steps.send(None))
    except StopIteration as done:
        draft = done.value
    assert forwards == [("runner", [7])] * 3 and len(draft) == 3 and inner.calls == [("draft_steps", 3)]


def test_a_drafter_within_a_target_forward_is_refused():
    with pytest.raises(ValueError, match="FakeTargetDrafter drafts within a target forward"):
        BudgetedDrafter(FakeTargetDrafter(), DraftBudget(FLAT))


@pytest.mark.parametrize("cost_ratio, waits", [(0.1, 5), (None, 0)], ids=["draft-model", "model-free"])
def test_a_budget_times_its_drafts_after_the_device_is_done(measured_costs, tiny_target, monkeypatch, cost_ratio,
                                                            waits):
    """A draft model's drafting and the step are timed between synchronizations of the target's device (no-ops on
    the CPU): before and after each drafting, and before a typical step's end. A model-free draft's cost is not
    learnt, so its steps wait for nothing."""
    measured_costs({tiny_target: (0.02, FLAT)})
    waited = []
    monkeypatch.setattr(hardware, "synchronize", lambda device: waited.append(device))
    budget = costs.measured_budget(tiny_target, cost_ratio=cost_ratio)
    assert budget.device == tiny_target.device
    budgeted = BudgetedDrafter(FakeDrafter(), budget)
    for _ in range(2):  # the second step is a typical one: its whole step is timed
        draft = budgeted.propose(torch.tensor(PROMPT), max_nodes=4)
        budgeted.update(draft, Verdict(list(range(len(draft))), 3), None)
    assert waited == [tiny_target.device] * waits

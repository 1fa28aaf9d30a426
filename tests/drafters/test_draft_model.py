import pytest
import torch

import accelgen
from accelgen.draft import Draft, Verdict
from accelgen.costs import DraftBudget, probe_interval
from accelgen.drafters.draft_model import DraftModelDrafter, scheduled
from accelgen.models.runner import ModelRunner
from accelgen.sampling import SamplingConfig

PROMPT = [5, 17, 923, 4410, 77, 12]
GREEDY = SamplingConfig()


def test_heuristic_schedule_grows_on_full_acceptance_and_shrinks_otherwise(tiny_target):
    drafter = DraftModelDrafter(tiny_target, GREEDY, None, gamma=4, gamma_schedule="heuristic", max_gamma=7)
    draft = Draft.chain(torch.tensor([1, 2, 3, 4]))
    drafter.update(draft, Verdict([0, 1, 2, 3], 9), None)
    assert drafter.gamma == 6
    drafter.update(draft, Verdict([0, 1, 2, 3], 9), None)
    assert drafter.gamma == 7  # capped at max_gamma
    drafter.update(draft, Verdict([0], 9), None)
    assert drafter.gamma == 6
    for _ in range(10):
        drafter.update(draft, Verdict([], 9), None)
    assert drafter.gamma == 1  # never below one token


FLAT = {1: 1.0, 32: 1.0}  # verification as cheap as one token (weight-bound forwards)
LINEAR = {1: 1.0, 32: 32.0}  # every verified token costs a whole forward (compute-bound)


def test_cost_schedule_picks_the_gamma_the_theory_predicts_best():
    budget = DraftBudget(FLAT, cost_ratio=0.05)
    budget.acceptance.accepted, budget.acceptance.rejections = 38, 9  # α = 39 / 49 ≈ 0.8 (Laplace)
    assert budget.limit() == 8  # see tests/test_theory.py
    budget.acceptance.accepted, budget.acceptance.rejections = 0, 20
    assert budget.limit() == 0  # α ≈ 0.05: no draft pays, decode plainly


def test_cost_schedule_falls_back_to_plain_decoding_when_verification_costs_as_much_as_decoding():
    budget = DraftBudget(LINEAR, cost_ratio=0.05)
    budget.acceptance.accepted, budget.acceptance.rejections = 38, 9  # α ≈ 0.8: still nothing pays when r(k) = k
    interval = probe_interval(0.05 + LINEAR[1] + 1 - 1)  # a rejected probe costs c + r(2) − 1 steps
    # not even a probe: with r(k) = k no draft would pay were every token accepted, so α cannot change the answer
    assert [budget.limit() for _ in range(3 * interval)] == [0] * 3 * interval


def test_cost_schedule_measures_as_it_goes(measured_costs, tiny_target, tiny_draft):
    measured_costs({tiny_target: (0.2, FLAT), tiny_draft: (0.01, FLAT)})  # c = 0.05
    drafter = scheduled(DraftModelDrafter(tiny_draft, GREEDY, None, gamma_schedule="cost", max_gamma=6),
                        tiny_target, tiny_draft)
    assert drafter.draft_budget.cost_ratio == pytest.approx(0.05) and drafter.draft_budget.max_length == 6
    context = torch.tensor(PROMPT)
    lengths = []
    for step in range(4):
        draft = drafter.propose(context, max_nodes=8)
        lengths.append(len(draft))
        drafter.update(draft, Verdict([], 7), None)  # every draft rejected
        context = torch.cat([context, torch.tensor([7])])
    assert lengths[0] == 4 and lengths[-1] == 0  # γ = 4 at the prior α 0.6 and c = 0.05; none once rejected
    assert drafter.draft_budget.cost_ratio != pytest.approx(0.05)  # c followed the steps' timings
    assert drafter.draft_budget.acceptance.alpha < 0.4  # from the prior 0.6, after two rejected drafts


def test_draft_cache_forgets_rejected_tokens(tiny_target, tiny_draft, assert_reordered):
    """After a rejection the drafter's KV cache equals a fresh one over the committed context."""
    drafter = DraftModelDrafter(tiny_draft, GREEDY, None, gamma=4)
    context = torch.tensor(PROMPT)
    first = drafter.propose(context, max_nodes=8)
    committed = torch.cat([context, first.tokens[:1], torch.tensor([31337])])  # one accepted, then a correction
    second = drafter.propose(committed, max_nodes=8)

    fresh = DraftModelDrafter(tiny_draft, GREEDY, None, gamma=4)
    assert torch.equal(second.tokens, fresh.propose(committed, max_nodes=8).tokens)
    reference = ModelRunner(tiny_draft)
    reference.forward(torch.cat([committed, second.tokens[:-1]]))
    for ours, theirs in zip(drafter.runner.cache.layers, reference.cache.layers):
        assert_reordered(ours.keys, theirs.keys)


def test_a_stop_token_ends_the_draft_after_it(tiny_target):
    """The draft model's EOS ends its draft (the tokens are read once, at the end, so drafting ran on past it);
    the next proposal rolls the cache back to the committed context as if it had stopped there."""
    from accelgen.drafters.draft_decoding import TokenChoice, decode_draft

    free, _ = decode_draft(ModelRunner(tiny_target), [], PROMPT, 6)
    stop = free[2]
    runner, cached_tokens = ModelRunner(tiny_target), []
    tokens, _ = decode_draft(runner, cached_tokens, PROMPT, 6, TokenChoice(stop_tokens=frozenset({stop})))
    assert tokens == free[: free.index(stop) + 1] and len(tokens) < 6
    following, _ = decode_draft(runner, cached_tokens, PROMPT + tokens, 3)
    assert following == decode_draft(ModelRunner(tiny_target), [], PROMPT + tokens, 3)[0]


@pytest.mark.slow  # SmolLM2 and a second copy of it; the tiny-model tests here run speculative by default
def test_confidence_threshold_drafts_less_and_stays_lossless(smollm):
    model, tokenizer = smollm
    prompt = [{"role": "user", "content": "List three uses of Python dictionaries."}]
    plain = accelgen.generate(model, tokenizer, prompt, max_new_tokens=24)
    shallow_draft = accelgen.load_model("smollm2-135m", dtype="float32")[0]  # first 12 of 30 layers
    shallow_draft.model.layers = shallow_draft.model.layers[:12]
    shallow_draft.config.num_hidden_layers = 12
    runs = {threshold: accelgen.generate(model, tokenizer, prompt, method="speculative", draft_model=shallow_draft,
                                         max_new_tokens=24, gamma=6, confidence_threshold=threshold)
            for threshold in (0.0, 0.6)}
    assert runs[0.0].token_ids == runs[0.6].token_ids == plain.token_ids
    assert runs[0.6].stats["draft_tokens"] < runs[0.0].stats["draft_tokens"]

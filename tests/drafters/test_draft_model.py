import torch

import accelgen
from accelgen.draft import Draft, Verdict
from accelgen.costs import PROBE_EVERY
from accelgen.drafters.draft_model import CostEstimate, DraftModelDrafter
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
    costs = CostEstimate(FLAT)
    assert costs.best_gamma(5, 16) == 5  # nothing measured yet: keep the starting gamma
    costs.draft_seconds, costs.target_seconds = 0.01, 0.2  # c = 0.05
    costs.acceptance.accepted, costs.acceptance.rejections = 38, 9  # α = 39 / 49 ≈ 0.8 (Laplace)
    assert costs.best_gamma(5, 16) == 8  # see tests/test_theory.py
    costs.acceptance.accepted, costs.acceptance.rejections = 0, 20
    assert costs.best_gamma(5, 16) == 0  # α ≈ 0.05: no draft pays, decode plainly


def test_cost_schedule_falls_back_to_plain_decoding_when_verification_costs_as_much_as_decoding():
    costs = CostEstimate(LINEAR)
    costs.draft_seconds, costs.target_seconds = 0.01, 0.2
    costs.acceptance.accepted, costs.acceptance.rejections = 38, 9  # α ≈ 0.8: still nothing pays when r(k) = k
    chosen = [costs.best_gamma(5, 16) for _ in range(PROBE_EVERY)]
    assert chosen[:-1] == [0] * (PROBE_EVERY - 1) and chosen[-1] == 1  # one probe step keeps α measured


def test_cost_schedule_measures_as_it_goes(tiny_target, tiny_draft):
    drafter = DraftModelDrafter(tiny_draft, GREEDY, None, gamma=4, gamma_schedule="cost", max_gamma=6, verify_ratio=FLAT)
    context = torch.tensor(PROMPT)
    for step in range(3):
        draft = drafter.propose(context, max_nodes=8)
        drafter.update(draft, Verdict([], 7), None)  # every draft rejected
        context = torch.cat([context, torch.tensor([7])])
    assert drafter.costs.draft_seconds > 0 and drafter.costs.target_seconds > 0
    assert drafter.costs.acceptance.rejections > 1 and drafter.gamma == 0  # rejected twice: drafting stopped


def test_draft_cache_forgets_rejected_tokens(tiny_target, tiny_draft):
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
        torch.testing.assert_close(ours.keys, theirs.keys, rtol=1e-4, atol=1e-5)


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

"""Staged speculative decoding: the n-gram/bigram stage, the draft model speculating on itself (same greedy
tokens, same sampling law, fewer forwards), and `staged` end to end: lossless greedy, exact sampling, edges."""

import copy
import math

import pytest
import torch

import accelgen
from accelgen.draft import ROOT, Verdict
from accelgen.drafters.draft_model import DraftModelDrafter
from accelgen.drafters.stage_two import ContextNGramModel, SelfSpeculatingDraftModel
from accelgen.drafters.staged import StagedDrafter
from accelgen.sampling import SamplingConfig, sample

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = [5, 17, 923, 4410, 77, 12]
GREEDY = SamplingConfig()


# --- the n-gram/bigram model ----------------------------------------------------------------------------


def test_ngram_model_continues_the_most_recent_longest_match():
    cheap = ContextNGramModel(max_ngram=3)
    cheap.observe([7, 8, 9, 7, 8, 5, 7, 8])
    assert cheap.propose([7, 8, 9, 7, 8, 5, 7, 8], 3) == [5, 7, 8]  # [7 8] last ended at 5; copied on periodically
    # a sequence extended by unverified draft tokens: its tail [7 8 9] matched in the observed context
    assert cheap.propose([7, 8, 9, 7, 8, 5, 7, 8, 9], 2) == [7, 8]
    assert cheap.propose([7, 8, 9, 7, 8, 5, 7, 8], 0) == []


def test_bigram_model_chains_most_frequent_followers():
    cheap = ContextNGramModel(max_ngram=1)  # the bigram model alone
    cheap.observe([1, 2, 1, 2, 1, 3, 1])
    assert cheap.propose([1, 2, 1, 2, 1, 3, 1], 3) == [2, 1, 2]  # 1 -> 2 twice, 1 -> 3 once (the most recent)
    cheap.observe([1, 2, 1, 2, 1, 3, 1, 4])  # 4 was never followed by anything
    assert cheap.propose([1, 2, 1, 2, 1, 3, 1, 4], 3) == []


# --- stage two: the draft model speculating on itself ---------------------------------------------------


def test_stage_two_makes_the_draft_models_own_greedy_chain_in_fewer_forwards(cycling_model, cycle_prompt):
    drafter = SelfSpeculatingDraftModel(cycling_model, GREEDY, None, stage_two_tokens=4, max_ngram=3)
    tokens, logits = drafter.chain(cycle_prompt, 8)
    alone = DraftModelDrafter(cycling_model, GREEDY, None, gamma=8).propose(torch.tensor(cycle_prompt), 8)
    assert tokens == alone.tokens.tolist()
    assert logits.shape == (8, cycling_model.config.vocab_size) and logits.argmax(-1).tolist() == tokens
    assert drafter.forwards == 2 and drafter.accepted == drafter.proposed == 6  # the cycle is in the context


def test_stage_two_with_wrong_proposals_still_gives_the_draft_models_chain(tiny_target, tiny_draft):
    """The random draft model does not continue the prompt's n-grams: its corrections replace the proposals."""
    context = PROMPT + [5, 17]  # the tail [5 17] matches the prompt: a proposal [923 4410 ..] is made
    drafter = SelfSpeculatingDraftModel(tiny_draft, GREEDY, None, stage_two_tokens=3, max_ngram=2)
    tokens, _ = drafter.chain(context, 6)
    alone = DraftModelDrafter(tiny_draft, GREEDY, None, gamma=6).propose(torch.tensor(context), 6)
    assert tokens == alone.tokens.tolist()
    assert drafter.proposed > drafter.accepted


def test_stage_two_cache_forgets_rejected_tokens(cycling_model, cycle_prompt):
    """After the target rejects draft tokens, the next chain equals a fresh drafter's, from a cache that holds
    the committed context and the new chain but its last token."""
    drafter = SelfSpeculatingDraftModel(cycling_model, GREEDY, None, stage_two_tokens=4, max_ngram=3)
    first, _ = drafter.chain(cycle_prompt, 6)
    committed = cycle_prompt + first[:2] + [999]  # two accepted, then a correction
    second, _ = drafter.chain(committed, 5)
    fresh = SelfSpeculatingDraftModel(cycling_model, GREEDY, None, stage_two_tokens=4, max_ngram=3)
    assert second == fresh.chain(committed, 5)[0]
    assert drafter.runner.length == len(committed) + 5 - 1


def test_sampled_chain_rows_are_the_draft_models_logits_after_each_prefix(sampling_model, assert_reordered):
    """The rows the target's speculative sampling uses as q: each the draft model's logits after the prefix."""
    prompt = [1, 3, 4, 5, 1, 3, 4, 5, 1, 3]
    drafter = SelfSpeculatingDraftModel(sampling_model, SamplingConfig(1.0), torch.Generator().manual_seed(1),
                                        stage_two_tokens=3, max_ngram=2)
    for _ in range(5):
        tokens, logits = drafter.chain(prompt, 4)
        with torch.no_grad():
            reference = sampling_model(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1 :]
        assert_reordered(logits, reference)
    assert drafter.accepted > 0


def exact_chain_marginals(model, prompt: list[int], length: int) -> torch.Tensor:
    """(length, vocab): the law of each of the model's next `length` tokens at temperature 1, by enumeration."""
    vocab = model.config.vocab_size
    marginals = torch.zeros(length, vocab, dtype=torch.float64)
    paths = [([], 1.0)]
    for position in range(length):
        with torch.no_grad():
            probs = torch.softmax(model(torch.tensor([prompt + path for path, _ in paths])).logits[:, -1].double(), -1)
        marginals[position] = sum(weight * row for (_, weight), row in zip(paths, probs))
        paths = [(path + [token], weight * float(row[token])) for (path, weight), row in zip(paths, probs)
                 for token in range(vocab)]
    return marginals


def resample_on_rejection(draft, draft_logits, generator) -> Verdict:
    """A wrong stage-two rule: after rejecting a proposed token it draws from q itself instead of q with that
    token removed, so proposed tokens come out too often."""
    probs = torch.softmax(draft_logits, dim=-1)  # (n+1, vocab)
    accepted = []
    for node, token in enumerate(draft.tokens.tolist()):
        if torch.rand((), generator=generator) >= probs[node, token]:
            return Verdict(accepted, sample(probs[node], generator))
        accepted.append(node)
    return Verdict(accepted, sample(probs[len(accepted)], generator))


STAGE_TWO_PROMPT = [1, 3, 4, 5, 1, 3, 4, 5, 1, 3]  # the tail [1 3] is always matched: [4 5] is proposed
STAGE_TWO_DRAWS = 1000


def stage_two_distance(model, verify) -> tuple[float, float, SelfSpeculatingDraftModel]:
    """(largest total variation over the first 3 tokens between stage-two samples and the model's law, the
    bound a correct sampler exceeds with probability < 1e-3, the drafter)."""
    drafter = SelfSpeculatingDraftModel(model, SamplingConfig(1.0), torch.Generator().manual_seed(0),
                                        stage_two_tokens=2, max_ngram=2, verify=verify)
    exact = exact_chain_marginals(model, STAGE_TWO_PROMPT, 3)
    counts = torch.zeros_like(exact)
    for _ in range(STAGE_TWO_DRAWS):
        tokens, _ = drafter.chain(STAGE_TWO_PROMPT, 3)
        counts[torch.arange(3), torch.tensor(tokens)] += 1
    distance = max(0.5 * float((counts[i] / STAGE_TWO_DRAWS - exact[i]).abs().sum()) for i in range(3))
    categories = exact.shape[1]
    bound = 0.5 * math.sqrt(categories / STAGE_TWO_DRAWS) + math.sqrt(math.log(1e3) / (2 * STAGE_TWO_DRAWS))
    return distance, bound, drafter


def test_stage_two_sampling_keeps_the_draft_models_distribution(sampling_model):
    distance, bound, drafter = stage_two_distance(sampling_model, verify=None)
    assert distance < bound
    assert 0 < drafter.accepted < drafter.proposed  # proposals were both accepted and rejected


def test_a_wrong_stage_two_rule_fails_the_same_test(sampling_model):
    distance, bound, _ = stage_two_distance(sampling_model, verify=resample_on_rejection)
    assert distance > 1.5 * bound


# --- staged end to end ----------------------------------------------------------------------------------


def test_draft_is_the_chain_plus_alternative_first_tokens(tiny_target):
    drafter = StagedDrafter(tiny_target, GREEDY, None, gamma=4, branches=3)
    draft = drafter.propose(torch.tensor(PROMPT), max_nodes=16)
    assert draft.parents.tolist() == [ROOT, 0, 1, 2, ROOT, ROOT]
    assert len(set(draft.tokens[[0, 4, 5]].tolist())) == 3  # distinct first tokens
    assert draft.draft_probs is None
    assert drafter.propose(torch.tensor(PROMPT), max_nodes=5).parents.tolist() == [ROOT, 0, 1, 2, ROOT]
    assert drafter.propose(torch.tensor(PROMPT), max_nodes=2).parents.tolist() == [ROOT, 0]

    sampled = StagedDrafter(tiny_target, SamplingConfig(1.0), torch.Generator().manual_seed(0), gamma=4, branches=3)
    draft = sampled.propose(torch.tensor(PROMPT), max_nodes=16)
    assert draft.draft_probs.shape == (6, tiny_target.config.vocab_size)
    assert torch.equal(draft.draft_probs[4], draft.draft_probs[0])  # alternatives come from q at the root


def test_self_draft_accepts_every_chain_token(tiny_target, tokenizer, assert_lossless):
    result = assert_lossless(tiny_target, tokenizer, PROMPT, "staged", 40, draft_model=tiny_target, gamma=4)
    assert result.stats["accepted_per_step"][:5] == [4] * 5


def test_random_draft_is_lossless(tiny_target, tiny_draft, tokenizer, assert_lossless):
    result = assert_lossless(tiny_target, tokenizer, PROMPT, "staged", 30, draft_model=tiny_draft, branches=3)
    assert result.stats["accepted_draft_tokens"] == 0


def test_smollm_draft_is_lossless_with_partial_acceptance(smollm, smollm_26_layers, copy_prompt, assert_lossless):
    model, tokenizer = smollm
    result = assert_lossless(model, tokenizer, copy_prompt, "staged", 16, draft_model=smollm_26_layers, gamma=4)
    assert 0 < result.stats["acceptance_rate"] < 1 and result.stats["mean_accepted_tokens"] > 1.3


@pytest.mark.parametrize("max_new_tokens", [1, 2, 3])
def test_max_new_tokens_smaller_than_a_draft(tiny_target, tokenizer, assert_lossless, max_new_tokens):
    result = assert_lossless(tiny_target, tokenizer, PROMPT, "staged", max_new_tokens, draft_model=tiny_target,
                             gamma=6)
    assert len(result.token_ids) == max_new_tokens


def test_eos_inside_a_draft_ends_generation_there(tiny_target, tokenizer, greedy):
    plain = greedy(tiny_target, tokenizer, PROMPT, 20).token_ids
    position = next(i for i in range(2, 20) if plain[i] not in plain[:i])  # its first occurrence
    model = copy.deepcopy(tiny_target)
    model.generation_config.eos_token_id = plain[position]
    result = accelgen.generate(model, tokenizer, PROMPT, method="staged", draft_model=model, max_new_tokens=20,
                               gamma=8)
    assert result.token_ids == plain[: position + 1] and result.finish_reason == "stop"


def test_draft_model_with_a_shorter_context(tiny_target, tokenizer, make_tiny_model, assert_lossless):
    short = make_tiny_model("qwen2", seed=0, max_positions=len(PROMPT) + 4)  # the target's weights, 10 positions
    result = assert_lossless(tiny_target, tokenizer, PROMPT, "staged", 12, draft_model=short, gamma=3)
    assert result.stats["accepted_draft_tokens"] > 0 and result.stats["draft_tokens"] < 12


@pytest.mark.slow  # 1,500 sampled generations; this file's greedy tests run the method by default
def test_sampling_keeps_the_target_distribution(assert_samples_target, sampling_draft):
    # 3 new tokens leave room for 2 draft nodes: the draft model's token and one alternative, drawn i.i.d. from
    # q (drafting the top-2 instead fails this test); stage two's own sampling is tested above
    assert_samples_target("staged", [1, 3, 4, 5, 6, 7, 0, 1, 3], draft_model=sampling_draft, gamma=1, branches=2)


def test_clear_errors(tiny_target, tokenizer, make_tiny_model):
    def run(**options):
        draft_model = options.pop("draft_model", tiny_target)
        accelgen.generate(tiny_target, tokenizer, PROMPT, method="staged", draft_model=draft_model, **options)

    for option, message in [({"gamma": 0}, "gamma"), ({"branches": 0}, "branches"),
                            ({"stage_two_tokens": 0}, "stage_two_tokens"), ({"max_ngram": 0}, "max_ngram"),
                            ({"ngram": 3}, "no option"), ({"draft_model": None}, "needs a draft model"),
                            ({"draft_model": make_tiny_model(vocab_size=1024)}, "vocabulary")]:
        with pytest.raises(ValueError, match=message):
            run(**option)

"""Jacobi decoding: the fixed-point iteration, the drafter's update rule, and lossless generation."""

import pytest
import torch

from accelgen.draft import Verdict
from accelgen.drafters.jacobi import JacobiDrafter, next_guess

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = [5, 17, 923, 4410, 77, 12]


@pytest.fixture(scope="module")
def fixed_point_model(make_tiny_model):
    """Attention output zeroed (a token's logits depend on it alone), and a seed whose greedy output settles
    on one repeated token after three: the Jacobi iterate then stops changing and must be accepted whole."""
    model = make_tiny_model("qwen2", seed=0, vocab_size=256)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
    return model


def one_hot_logits(tokens, vocab=10):
    """(len(tokens), vocab) logits whose argmax rows are tokens."""
    return torch.nn.functional.one_hot(torch.tensor(tokens), vocab).float()


def jacobi_acceptances(model, prompt: list[int], expected: list[int], block_size: int) -> list[int]:
    """The guesses each step of Jacobi decoding accepts, from the method's definition and one full forward per step
    (no cache, no verifier): the guesses equal to greedy decoding's tokens (`expected`) are accepted, one token more
    is committed, and the forward's argmaxes after those are the next guesses, padded with the last (with the
    context's last token before there are any). A step drafts no further than the tokens still to come, less one."""
    committed, guess, accepted = 0, [], []
    while committed < len(expected):
        context = prompt + expected[:committed]
        size = min(block_size, len(expected) - committed - 1)
        block = guess[:size]
        block += [block[-1] if block else context[-1]] * (size - len(block))
        matched = next((i for i, (g, e) in enumerate(zip(block, expected[committed:])) if g != e), len(block))
        with torch.no_grad():
            logits = model(torch.tensor([context + block])).logits[0, len(context) - 1 :]  # (size + 1, vocab)
        guess = logits[matched + 1 :].argmax(dim=-1).tolist()
        accepted.append(matched)
        committed += matched + 1
    return accepted


# --- the iteration ----------------------------------------------------------------------------------------


def test_jacobi_iteration_reaches_greedy_within_block_size_iterations(tiny_target, tokenizer, greedy):
    """The fixed point of y_i <- argmax p(y_i | prompt, y_<i) is the greedy output; after k iterations at
    least the first k positions are right, whatever the first guess."""
    expected = greedy(tiny_target, tokenizer, PROMPT, 6).token_ids
    guess = [0] * 6
    for iteration in range(1, 7):
        with torch.no_grad():
            logits = tiny_target(torch.tensor([PROMPT + guess])).logits[0, len(PROMPT) - 1 : -1]  # (6, vocab)
        guess = logits.argmax(dim=-1).tolist()
        assert guess[:iteration] == expected[:iteration]
    assert guess == expected


def test_next_guess_is_the_iterate_after_the_committed_tokens():
    # rows: after root, after node 0, ..., after node 3; one node accepted, so rows 0 and 1 were committed
    logits = one_hot_logits([4, 5, 6, 7, 8])
    assert next_guess(logits, accepted=1) == [6, 7, 8]
    assert next_guess(logits, accepted=4) == []
    assert next_guess(logits, accepted=0) == [5, 6, 7, 8]


def test_drafter_proposes_the_iterate_padded_with_its_last_token():
    drafter = JacobiDrafter(block_size=4)
    first = drafter.propose(torch.tensor([1, 2, 3]), 10)
    assert first.tokens.tolist() == [3, 3, 3, 3] and first.is_chain
    drafter.update(first, Verdict([], 4), one_hot_logits([4, 5, 6, 7, 8]))
    assert drafter.propose(torch.tensor([1, 2, 3, 4]), 10).tokens.tolist() == [5, 6, 7, 8]
    drafter.update(first, Verdict([0, 1], 7), one_hot_logits([5, 6, 7, 9, 9]))
    assert drafter.propose(torch.tensor([1, 2, 3, 4, 5, 6, 7]), 10).tokens.tolist() == [9, 9, 9, 9]
    assert len(drafter.propose(torch.tensor([1]), 2)) == 2


def test_bad_block_size_is_refused():
    with pytest.raises(ValueError):
        JacobiDrafter(block_size=0)


# --- lossless generation -----------------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [1, 4, 8])
def test_random_model_is_lossless_and_accepts_what_the_iteration_predicts(tiny_target, tokenizer, assert_lossless,
                                                                          block_size):
    result = assert_lossless(tiny_target, tokenizer, PROMPT, "jacobi", 30, block_size=block_size)
    assert result.stats["accepted_per_step"] == jacobi_acceptances(tiny_target, PROMPT, result.token_ids, block_size)


def test_converged_iterate_is_accepted_whole(fixed_point_model, tokenizer, assert_lossless):
    prompt = [5, 17, 23, 41, 7, 12]
    result = assert_lossless(fixed_point_model, tokenizer, prompt, "jacobi", 30, block_size=8)
    predicted = jacobi_acceptances(fixed_point_model, prompt, result.token_ids, 8)
    assert sum(predicted) > 0  # the iteration converges here: a drafter accepting nothing extra fails below
    assert result.stats["accepted_per_step"] == predicted
    assert result.stats["mean_accepted_tokens"] > 3
    assert max(result.stats["accepted_per_step"]) == 8


def test_smollm_is_lossless(smollm, copy_prompt, assert_lossless):
    model, tokenizer = smollm
    assert_lossless(model, tokenizer, copy_prompt, "jacobi", 24, block_size=4)


@pytest.mark.slow  # 1,500 sampled generations; this file's greedy tests run the method by default
def test_sampling_keeps_the_target_distribution(assert_samples_target):
    assert_samples_target("jacobi", [1, 3, 4, 5, 3, 4], block_size=2)

"""The point-expanding stage: every point in one batched forward per step, each point decoded as if alone."""

import pytest

import accelgen
from accelgen.skeleton.expand import expand_points
from accelgen.skeleton.prompts import point_prompt_ids

pytestmark = pytest.mark.usefixtures("one_thread")

POINTS = ["Plan ahead", "Set a budget", "Book early", "Travel light"]


@pytest.fixture
def forwards(tiny_target):
    """The batch size of every forward of the tiny target while the test runs."""
    batches = []

    def count(module, args, kwargs, output):
        batches.append(kwargs["input_ids"].shape[0] if "input_ids" in kwargs else args[0].shape[0])

    hook = tiny_target.register_forward_hook(count, with_kwargs=True)
    yield batches
    hook.remove()


def point_prompts(tokenizer):
    return [point_prompt_ids(tokenizer, "How do I travel cheaply?", POINTS, index) for index in range(1, 5)]


def test_the_points_are_expanded_in_one_batched_forward_per_step(tiny_target, tokenizer, forwards):
    results = expand_points(tiny_target, tokenizer, point_prompts(tokenizer), max_new_tokens=12, temperature=0.0)
    steps = max(result.stats["target_forwards"] for result in results)
    # one forward for the shared prefix, then one per step for every point still decoding
    assert forwards[0] == 1 and len(forwards) == 1 + steps
    still_decoding = [sum(result.stats["target_forwards"] > step for result in results) for step in range(steps)]
    assert forwards[1:] == still_decoding
    assert forwards[1] == len(POINTS)  # all points together, not one after the other
    assert sum(result.stats["target_forwards"] for result in results) > len(forwards)


def test_each_expansion_equals_its_point_decoded_alone(tiny_target, tokenizer):
    prompts = point_prompts(tokenizer)
    together = expand_points(tiny_target, tokenizer, prompts, max_new_tokens=12, temperature=0.0)
    for prompt, result in zip(prompts, together):
        alone = accelgen.generate(tiny_target, tokenizer, prompt, max_new_tokens=12, temperature=0.0)
        assert result.token_ids == alone.token_ids and result.text == alone.text


def test_a_method_that_drafts_expands_the_points_too(tiny_target, tokenizer):
    prompts = point_prompts(tokenizer)[:2]
    drafted = expand_points(tiny_target, tokenizer, prompts, max_new_tokens=10, temperature=0.0, method="pld")
    plain = expand_points(tiny_target, tokenizer, prompts, max_new_tokens=10, temperature=0.0)
    assert [result.token_ids for result in drafted] == [result.token_ids for result in plain]


def test_bad_generation_arguments_are_refused(tiny_target, tokenizer):
    with pytest.raises(ValueError, match="unknown method"):
        expand_points(tiny_target, tokenizer, point_prompts(tokenizer), max_new_tokens=4, method="nope")

"""LayerSkip self-speculation: drafts from an early exit of the target itself; lossless, exact sampling."""

import pytest

import accelgen

pytestmark = pytest.mark.usefixtures("one_thread")


def test_smollm_early_exit_drafts_are_lossless(smollm, copy_prompt, assert_lossless):
    model, tokenizer = smollm
    result = assert_lossless(model, tokenizer, copy_prompt, "layerskip", 24, exit_layer=19)
    assert 0 < result.stats["acceptance_rate"] < 1


def test_sampling_keeps_the_target_distribution(assert_samples_target):
    assert_samples_target("layerskip", [1, 3, 4], exit_layer=0)


def test_an_exit_at_the_last_layer_is_refused(tiny_target, tokenizer):
    with pytest.raises(ValueError, match="exit_layer must be a layer below the last \\(0..0\\)"):
        accelgen.generate(tiny_target, tokenizer, [5, 6], method="layerskip", exit_layer=1)

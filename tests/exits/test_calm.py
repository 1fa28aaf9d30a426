"""CALM: confidence measures, threshold 1.0 = the full model, lower thresholds exit earlier, clear errors."""

import copy
import json

import pytest
import torch

import accelgen
from accelgen.exits.calm import CALIBRATION_FILE, default_exit_layers, make_rule, saturation, softmax_response
from accelgen.models.early_exit import EarlyExitRunner
from accelgen.prompts import encode_prompt
from accelgen.sampling import SamplingConfig, logits_to_probs, sample

CHAT = [{"role": "user", "content": "Write a Python function that returns the squares of a list."}]


def test_softmax_response_is_the_gap_between_the_top_two_probabilities():
    assert softmax_response(torch.tensor([0.0, 0.0, -1e9])) == pytest.approx(0.0)
    assert softmax_response(torch.tensor([20.0, 0.0, 0.0])) == pytest.approx(1.0, abs=1e-6)
    probs = torch.tensor([0.6, 0.3, 0.1])
    assert softmax_response(probs.log()) == pytest.approx(0.3)


def test_saturation_is_the_cosine_of_a_layers_input_and_output():
    assert saturation(torch.tensor([1.0, 0.0]), torch.tensor([2.0, 0.0])) == pytest.approx(1.0)
    assert saturation(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 3.0])) == pytest.approx(0.0)
    assert saturation(torch.tensor([0.3, 0.7, 0.1]), torch.tensor([0.3, 0.7, 0.1])) <= 1.0


def test_default_exit_layers_run_from_the_middle_up():
    assert default_exit_layers(30) == [15, 18, 21, 24, 27]
    assert default_exit_layers(4) == [2]


@pytest.mark.parametrize("measure", ["softmax", "saturation"])
def test_threshold_one_is_the_full_model(smollm, measure):
    model, tokenizer = smollm
    expected = accelgen.generate(model, tokenizer, CHAT, max_new_tokens=20)
    result = accelgen.generate(model, tokenizer, CHAT, method="calm", max_new_tokens=20, measure=measure, threshold=1.0)
    assert result.token_ids == expected.token_ids
    assert result.stats["mean_layers"] == result.stats["layers"] == 30


@pytest.mark.parametrize("measure, thresholds", [("softmax", [1.0, 0.9, 0.5, 0.0]),
                                                 ("saturation", [1.0, 0.95, 0.9, 0.0])])
def test_lower_thresholds_exit_earlier(smollm, measure, thresholds):
    """From the same state, a lower threshold leaves at the same layer or earlier (over whole generations the
    contexts differ, so only the ends are fixed: all 30 layers at 1.0, the first exit, after layer 15, at 0)."""
    model, tokenizer = smollm
    context = encode_prompt(tokenizer, CHAT) + accelgen.generate(model, tokenizer, CHAT, max_new_tokens=3).token_ids
    for end in range(len(context) - 3, len(context)):  # three states, each rerunning the prompt through 30 layers
        prompt = EarlyExitRunner(model, make_rule(model, measure=measure, threshold=1.0, exit_layers=None))
        prompt.forward(torch.tensor(context[:end]))
        depths = []
        for threshold in thresholds:
            runner = EarlyExitRunner(model, make_rule(model, measure=measure, threshold=threshold, exit_layers=None))
            runner.cache = copy.deepcopy(prompt.cache)
            runner.forward(torch.tensor([context[end]]))
            depths += runner.layers_used
        assert depths == sorted(depths, reverse=True) and depths[0] == 30 and depths[-1] == 16
    layers = [accelgen.generate(model, tokenizer, CHAT, method="calm", max_new_tokens=8, measure=measure,
                                threshold=threshold).stats["mean_layers"] for threshold in (1.0, 0.0)]
    assert layers == [30, 16]


def test_sampling_from_the_exit(smollm):
    """Sampled tokens are draws from the exit's distribution. With threshold 0 and one exit layer every decoded
    token leaves after layer 15, whose cache is then exact: the exit's logits are the full forward's layer-15
    state read through the final norm and LM head (the first token comes from the prompt's full-depth forward)."""
    model, tokenizer = smollm
    result = accelgen.generate(model, tokenizer, CHAT, method="calm", max_new_tokens=8, temperature=1.0, seed=2,
                               threshold=0.0, exit_layers=[15], output_scores=True)
    assert len(result.token_ids) == 8 and result.stats["mean_layers"] == 16
    prompt = encode_prompt(tokenizer, CHAT)
    with torch.inference_mode():
        output = model(torch.tensor([prompt + result.token_ids[:-1]]), output_hidden_states=True)
    exits = model.lm_head(model.model.norm(output.hidden_states[16][0, len(prompt):]))  # (7, vocab)
    logits = torch.cat([output.logits[0, len(prompt) - 1 : len(prompt)], exits]).float()  # (8, vocab)
    torch.testing.assert_close(result.scores, logits, rtol=1e-4, atol=1e-4)
    assert result.token_ids != logits.argmax(dim=-1).tolist()  # sampled: this seed draws some unlikelier tokens
    generator = torch.Generator().manual_seed(2)  # generate's draws, one per step, from those distributions
    assert [sample(logits_to_probs(row, SamplingConfig(1.0)), generator) for row in logits] == result.token_ids


def test_calibrated_threshold_is_read_from_beside_the_model(tiny_target, tokenizer, tmp_path, monkeypatch):
    monkeypatch.setattr(tiny_target, "name_or_path", str(tmp_path), raising=False)
    with pytest.raises(ValueError, match="accelgen calibrate calm --measure softmax"):
        accelgen.generate(tiny_target, tokenizer, [5, 6], method="calm", threshold="calibrated")
    (tmp_path / CALIBRATION_FILE).write_text(json.dumps({"softmax": {"threshold": 0.0}}))
    result = accelgen.generate(tiny_target, tokenizer, [5, 6], method="calm", threshold="calibrated", exit_layers=[0],
                               max_new_tokens=4)
    assert result.stats["mean_layers"] == 1  # threshold 0: every token leaves after layer 0 of 2


@pytest.mark.parametrize("options, problem", [
    ({"measure": "entropy"}, "measure must be one of softmax, saturation"),
    ({"threshold": 1.5}, "threshold must be a number in \\[0, 1\\]"),
    ({"exit_layers": [9]}, "layers 0..1, not \\[9\\]"),
])
def test_bad_options_are_named(tiny_target, tokenizer, options, problem):
    with pytest.raises(ValueError, match=problem):
        accelgen.generate(tiny_target, tokenizer, [5, 6], method="calm", **options)

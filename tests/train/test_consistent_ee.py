"""ConsistentEE: the hardness (memorized exit), the reward, a policy that follows the speed weight, the method
and the command."""

import json

import pytest
import torch
from typer.testing import CliRunner

import accelgen
from accelgen.cli import app
from accelgen.train.consistent_ee import evaluate_exit_policy, exit_rewards, memorized_exits, train_exit_policy
from accelgen.train.exit_heads import collect_hidden_states
from accelgen.train.layerskip import packed_windows
from accelgen.train.loop import ScaleOut

PROMPT = [5, 17, 923, 4410, 77, 12]


def test_the_memorized_exit_is_where_the_exits_stop_changing_their_minds():
    agrees = torch.tensor([[False, True, True], [True, False, True], [False, False, False], [True, True, True]])
    assert memorized_exits(agrees).tolist() == [1, 2, 3, 0]


def test_easy_tokens_are_paid_for_leaving_early_and_hard_ones_for_being_right():
    log_probs = torch.tensor([[-3.0, -0.1], [-3.0, -0.1]])  # exit 0 unsure of the full model's token; the full model sure
    depths = torch.tensor([0.5, 1.0])
    rewards = exit_rewards(log_probs, depths, hardness=torch.tensor([0.0, 1.0]), speed_weight=1.0)
    assert rewards[0].argmax() == 0 and rewards[1].argmax() == 1


@pytest.fixture(scope="module")
def four_layers(make_tiny_model):
    return make_tiny_model("qwen2", seed=8, layers=4)


@pytest.fixture(scope="module")
def hidden(four_layers, tokenizer):
    windows = packed_windows(tokenizer, ["for i in range(10):\n    print(i * i)\n"] * 60, seq_len=16, count=12)
    return collect_hidden_states(four_layers, windows, [0, 1, 2])


def test_the_policy_follows_the_price_of_depth(four_layers, hidden):
    depth = {}
    for weight in (0.0, 20.0):  # most of these tokens are hard: a small price of depth moves the policy little
        policy = train_exit_policy(four_layers, hidden, [0, 1, 2], steps=150, batch_size=128, speed_weight=weight)
        depth[weight] = evaluate_exit_policy(four_layers, policy, hidden)["mean_depth"]
    assert depth[20.0] < depth[0.0] - 0.03


def test_micro_batches_train_the_policy_the_whole_batch_does(four_layers, hidden):
    whole, accumulated = (train_exit_policy(four_layers, hidden, [0, 1, 2], steps=3, batch_size=64, speed_weight=5.0,
                                            scale=scale).state_dict() for scale in (ScaleOut(), ScaleOut(grad_accum=3)))
    for name, value in whole.items():  # the rounding of summing in parts, through 3 Adam steps of lr 1e-2
        torch.testing.assert_close(accumulated[name], value, rtol=0, atol=1e-6)


def test_the_method_decodes_with_the_policy(four_layers, tokenizer, hidden, tmp_path):
    policy = train_exit_policy(four_layers, hidden, [0, 1, 2], steps=20, batch_size=64, speed_weight=5.0)
    policy.save(tmp_path / "policy")
    full = accelgen.generate(four_layers, tokenizer, PROMPT, max_new_tokens=8)
    never = accelgen.generate(four_layers, tokenizer, PROMPT, method="consistent-ee", max_new_tokens=8,
                              heads=str(tmp_path / "policy"), threshold=1.0)
    assert never.token_ids == full.token_ids and never.stats["mean_layers"] == 4
    always = accelgen.generate(four_layers, tokenizer, PROMPT, method="consistent-ee", max_new_tokens=8,
                               heads=str(tmp_path / "policy"), threshold=0.0)
    assert always.stats["mean_layers"] == 1
    with pytest.raises(ValueError, match="needs a trained exit policy"):
        accelgen.generate(four_layers, tokenizer, PROMPT, method="consistent-ee")


def test_the_command_trains_and_evaluates(command_inputs, tmp_path):
    folder, dataset = command_inputs(9, layers=4)
    out = tmp_path / "policy"
    result = CliRunner().invoke(app, ["train", "consistent-ee", "--model", str(folder), "--dataset", dataset,
                                      "--out", str(out), "--layers", "1,2", "--windows", "6", "--held-out", "2",
                                      "--seq-len", "8", "--steps", "5", "--batch-size", "16"])
    assert result.exit_code == 0, result.output
    evaluation = json.loads((out / "evaluation.json").read_text())
    assert 0 < evaluation["mean_depth"] <= 1 and set(evaluation["exit_shares"]) == {"1", "2", "full"}

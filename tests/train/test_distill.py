"""Distillation shared by DistillSpec and online decoding: the divergences, top-k targets, the training step,
on-policy data, and the `accelgen train distillspec` / `accelgen train online` commands."""

import json
import math

import pytest
import torch
from typer.testing import CliRunner

import accelgen
from accelgen.cli import app
from accelgen.train import distill as distillation
from accelgen.train.distill import (DIVERGENCES, Example, distill, distillation_loss, distillation_step, divergence,
                                    logits_at, on_policy_examples, trainable_parameters, with_rest)
from accelgen.train.loop import ScaleOut

PROMPTS = [[5, 17, 92, 44, 77, 12], [5, 17, 92, 44, 77, 13]]


def log_probs(*rows):
    return torch.tensor(rows, dtype=torch.float64).log()


def test_every_divergence_is_zero_between_equal_distributions():
    same = torch.log_softmax(torch.randn(3, 10, generator=torch.Generator().manual_seed(0)), dim=-1)
    for name in DIVERGENCES:
        torch.testing.assert_close(divergence(name, same, same), torch.zeros(3))


def test_divergences_on_a_worked_example():
    target, draft = log_probs([0.5, 0.5]), log_probs([0.9, 0.1])
    assert float(divergence("tvd", target, draft)) == pytest.approx(0.4)
    assert float(divergence("fkl", target, draft)) == pytest.approx(0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(5))
    assert float(divergence("rkl", target, draft)) == pytest.approx(0.9 * math.log(1.8) + 0.1 * math.log(0.2))


def test_total_variation_lies_between_zero_and_one_and_within_pinskers_bound():
    generator = torch.Generator().manual_seed(1)
    target = torch.log_softmax(3 * torch.randn(200, 16, generator=generator, dtype=torch.float64), dim=-1)
    draft = torch.log_softmax(3 * torch.randn(200, 16, generator=generator, dtype=torch.float64), dim=-1)
    tvd = divergence("tvd", target, draft)
    assert bool((tvd >= 0).all()) and bool((tvd <= 1).all())
    assert bool((tvd <= (divergence("fkl", target, draft) / 2).sqrt() + 1e-12).all())  # Pinsker
    apart = log_probs([1 - 1e-12, 1e-12], [1e-12, 1 - 1e-12])  # disjoint, up to rounding
    assert float(divergence("tvd", apart[:1], apart[1:])) == pytest.approx(1.0)


def test_an_unknown_divergence_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="unknown divergence 'jsd'; choose one of tvd, fkl, rkl"):
        divergence("jsd", log_probs([1.0]), log_probs([1.0]))


def test_a_top_k_target_compares_k_tokens_and_the_rest_and_never_exceeds_the_full_divergence():
    generator = torch.Generator().manual_seed(2)
    target_logits, draft_logits = torch.randn(5, 50, generator=generator), torch.randn(5, 50, generator=generator)
    target = torch.log_softmax(target_logits, dim=-1)
    top = target.topk(4)
    coarse = with_rest(top.values)
    assert coarse.shape == (5, 5)
    torch.testing.assert_close(coarse.exp().sum(-1), torch.ones(5))
    full = Example(torch.zeros(6, dtype=torch.long), torch.arange(5), target)
    kept = Example(torch.zeros(6, dtype=torch.long), torch.arange(5), top.values, top.indices)
    for name in DIVERGENCES:  # merging outcomes can only lose information (data processing inequality)
        assert bool((distillation_loss(draft_logits, kept, name) <= distillation_loss(draft_logits, full, name) + 1e-6).all())


def test_on_policy_examples_teach_the_drafts_own_continuations_and_not_the_prompt(sharp_target, make_tiny_model,
                                                                                   tokenizer):
    draft = make_tiny_model("llama", seed=1, vocab_size=1024)
    sampled, greedy = on_policy_examples(sharp_target, draft, tokenizer, PROMPTS, max_new_tokens=8, first=0, seed=3)
    expected = accelgen.generate(draft, tokenizer, PROMPTS[1], max_new_tokens=8).token_ids  # odd number: greedy
    assert greedy.token_ids.tolist() == PROMPTS[1] + expected
    again = on_policy_examples(sharp_target, draft, tokenizer, PROMPTS[:1], max_new_tokens=8, first=0, seed=3)[0]
    assert torch.equal(again.token_ids, sampled.token_ids)  # sampled, but seeded
    for example, prompt in ((sampled, PROMPTS[0]), (greedy, PROMPTS[1])):
        assert example.positions.tolist() == list(range(len(prompt) - 1, len(example.token_ids) - 1))
        with torch.no_grad():
            target = torch.log_softmax(sharp_target(example.token_ids[None]).logits[0, example.positions], dim=-1)
        torch.testing.assert_close(example.target_log_probs, target)


def agreement_and_divergence(draft, examples, name):
    with torch.no_grad():
        logits = [logits_at(draft, example.token_ids, example.positions) for example in examples]
        agrees = torch.cat([row.argmax(-1) == example.target_log_probs.argmax(-1) for row, example in zip(logits, examples)])
        loss = torch.cat([distillation_loss(row, example, name) for row, example in zip(logits, examples)])
    return float(agrees.float().mean()), float(loss.mean())


@pytest.mark.parametrize("name", DIVERGENCES)
def test_distillation_steps_lower_the_divergence_and_raise_agreement(sharp_target, make_tiny_model, tokenizer, name):
    draft = make_tiny_model("llama", seed=1, vocab_size=1024)
    examples = on_policy_examples(sharp_target, draft, tokenizer, PROMPTS, max_new_tokens=16)
    frozen = draft.model.embed_tokens.weight.clone(), draft.lm_head.weight.clone()
    agreement, loss = agreement_and_divergence(draft, examples, name)
    parameters = trainable_parameters(draft)
    optimizer = torch.optim.AdamW(parameters, lr=1e-2)
    for _ in range(10):
        distillation_step(draft, optimizer, parameters, examples, name)
    trained_agreement, trained_loss = agreement_and_divergence(draft, examples, name)
    assert trained_loss < 0.9 * loss and trained_agreement > agreement, (loss, trained_loss, agreement, trained_agreement)
    if name == "fkl":
        assert trained_agreement > 0.5
    assert torch.equal(draft.model.embed_tokens.weight, frozen[0]) and torch.equal(draft.lm_head.weight, frozen[1])
    assert all(p.requires_grad for p in draft.parameters())  # given back


def test_gradient_accumulation_distills_the_same_draft(sharp_target, make_tiny_model, tokenizer, monkeypatch):
    """The step's loss is the mean divergence over every taught position of the batch, whichever rows share a
    micro-batch: continuations of 2, 5 or 8 tokens (as EOS ends some early) give micro-batches unequal shares."""
    continuation = distillation.draft_continuation
    monkeypatch.setattr(distillation, "draft_continuation",
                        lambda *arguments: continuation(*arguments)[:2 + arguments[3] % 3 * 3])  # by prompt number
    drafts = []
    for scale in (None, ScaleOut(grad_accum=2)):
        draft = make_tiny_model("llama", seed=1, vocab_size=1024)
        distill(sharp_target, draft, tokenizer, PROMPTS, steps=2, batch_size=4, max_new_tokens=8, learning_rate=1e-2,
                scale=scale)
        drafts.append(draft.state_dict())
    whole, halves = drafts
    for name, tensor in whole.items():
        # AdamW divides by the gradient's size: where it is near zero, the rounding of summing the batch in two
        # halves moves a weight by up to ~1e-4 of a step (1e-2); a wrongly weighted micro-batch, by ~a step
        torch.testing.assert_close(halves[name], tensor, rtol=0, atol=1e-5)


def test_trainable_parameters_are_the_last_layers_and_need_float32(make_tiny_model):
    draft = make_tiny_model("llama", seed=1, vocab_size=64, layers=3)
    last = trainable_parameters(draft, 1)
    assert {id(p) for p in last} == {id(p) for p in [*draft.model.layers[2].parameters(), *draft.model.norm.parameters()]}
    with pytest.raises(ValueError, match="between 1 and the draft's 3 layers, got 4"):
        trainable_parameters(draft, 4)
    with pytest.raises(ValueError, match="float32"):
        trainable_parameters(draft.to(torch.bfloat16))


# --- the commands ---


@pytest.fixture
def two_models(command_inputs, make_tiny_model, tokenizer, tmp_path):
    """(target folder, draft folder, "jsonl:FILE" of prompts): two tiny models with one vocabulary."""
    target, _ = command_inputs(4)
    draft = tmp_path / "draft"
    make_tiny_model("llama", seed=5).save_pretrained(draft)
    tokenizer.save_pretrained(draft)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"def task_{i}(x):"}) + "\n" for i in range(6)))
    return target, draft, f"jsonl:{prompts}"


def invoke(*arguments):
    return CliRunner().invoke(app, [str(argument) for argument in arguments])


def message(result) -> str:
    """The command's output with the console's line wrapping undone."""
    return " ".join(result.output.split())


def test_distillspec_command_saves_a_draft_that_decodes_exactly(two_models, tmp_path):
    target, draft, dataset = two_models
    out = tmp_path / "distilled"
    result = invoke("train", "distillspec", "--model", target, "--draft", draft, "--dataset", dataset, "--out", out,
                    "--divergence", "fkl", "--steps", 2, "--prompts", 3, "--held-out", 2, "--max-new-tokens", 6,
                    "--batch-size", 2, "--learning-rate", 1e-3)
    assert result.exit_code == 0, result.output
    assert "α on 2 held-out prompts" in message(result)
    info = json.loads((out / "distillspec.json").read_text())
    assert info["target"] == str(target) and info["draft"] == str(draft) and info["divergence"] == "fkl"
    assert info["steps"] == 2 and info["training_prompts"] == 3 and len(info["losses"]) == 2
    assert set(info["before"]) >= {"acceptance_rate", "mean_accepted_tokens"} and info["after"]["prompts"] == 2
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()

    plain = invoke("generate", "--model", target, "--json", "-n", 16, "def add(a, b):")
    distilled = invoke("generate", "--model", target, "--draft", out, "--method", "distillspec", "--json", "-n", 16,
                       "def add(a, b):")
    assert distilled.exit_code == 0, distilled.output
    assert json.loads(distilled.stdout)["token_ids"] == json.loads(plain.stdout)["token_ids"]
    refused = invoke("generate", "--model", target, "--draft", draft, "--method", "distillspec", "def add(a, b):")
    assert refused.exit_code == 2 and "accelgen train distillspec" in message(refused)


def test_distillspec_command_reports_bad_input(two_models, tmp_path):
    target, draft, dataset = two_models
    result = invoke("train", "distillspec", "--model", target, "--draft", draft, "--dataset", dataset, "--out",
                    tmp_path / "x", "--divergence", "js", "--steps", 1, "--held-out", 1, "--max-new-tokens", 2)
    assert result.exit_code == 2 and "unknown divergence 'js'" in message(result)
    result = invoke("train", "distillspec", "--model", target, "--draft", draft, "--dataset", dataset, "--out",
                    tmp_path / "x", "--held-out", 6)
    assert result.exit_code == 2 and "gave 6 held-out and 0 training prompts" in message(result)


def test_online_command_writes_acceptance_per_request_and_the_plot(two_models, tmp_path):
    target, draft, dataset = two_models
    out = tmp_path / "online"
    result = invoke("train", "online", "--model", target, "--draft", draft, "--dataset", dataset, "--out", out,
                    "--requests", 4, "--interval", 2, "--max-new-tokens", 6, "--update-steps", 1,
                    "--learning-rate", 1e-3, "--baseline", "--save-draft")
    assert result.exit_code == 0, result.output
    report = json.loads((out / "online.json").read_text())
    assert [row["request"] for row in report["rows"]] == [1, 2, 3, 4] and report["interval"] == 2
    assert all(0 <= row["acceptance_rate"] <= 1 and "baseline_acceptance_rate" in row for row in report["rows"])
    assert [update["after_request"] for update in report["updates"]] == [2, 4]  # a random draft: rejections every time
    assert [row["update"] is not None for row in report["rows"]] == [False, True, False, True]
    assert (out / "online.png").stat().st_size > 0 and (out / "draft" / "config.json").is_file()

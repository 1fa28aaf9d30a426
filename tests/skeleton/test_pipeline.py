"""Skeleton-of-Thought end to end on a tiny model: the skeleton path, the fallbacks, the router's call, the CLI."""

import json

import pytest
import torch
from typer.testing import CliRunner

import accelgen
from accelgen.cli import app
from accelgen.loop import GenerationResult
from accelgen.skeleton import SkeletonRouter, generate, pipeline
from accelgen.skeleton.evaluation import summaries
from accelgen.skeleton.prompts import point_prompt_ids

pytestmark = pytest.mark.usefixtures("one_thread")

QUESTION = "How do I travel cheaply?"


def normal_text(model, tokenizer, max_new_tokens):
    return accelgen.generate(model, tokenizer, [{"role": "user", "content": QUESTION}], max_new_tokens=max_new_tokens,
                             temperature=0.0).text


def test_the_points_are_expanded_with_the_answer_budget_split_between_them(tiny_target, tokenizer, monkeypatch):
    points = ["Plan", "Budget", "Book"]
    skeleton = GenerationResult([7, 8], " Plan\n2. Budget\n3. Book", "stop")
    monkeypatch.setattr(pipeline, "outline", lambda *args: (skeleton, points))
    answer = generate(tiny_target, tokenizer, QUESTION, max_new_tokens=24, temperature=0.0)
    assert answer.used_skeleton and answer.points == points and answer.skeleton == "1. Plan\n2. Budget\n3. Book"
    for index, expansion in enumerate(answer.expansions, start=1):
        alone = accelgen.generate(tiny_target, tokenizer, point_prompt_ids(tokenizer, QUESTION, points, index),
                                  max_new_tokens=8, temperature=0.0)  # 24 tokens for 3 points
        assert expansion == alone.text
    assert answer.text.startswith("1. Plan:") and "\n2. Budget:" in answer.text
    assert answer.tokens["skeleton"] == 2 and 3 <= answer.tokens["expansion"] <= 24
    assert set(answer.seconds) == {"skeleton", "expansion", "total"}


def test_a_skeleton_without_points_falls_back_to_normal_decoding(tiny_target, tokenizer):
    answer = generate(tiny_target, tokenizer, QUESTION, max_new_tokens=10, skeleton_tokens=6, temperature=0.0)
    assert not answer.used_skeleton and "no numbered list" in answer.reason and answer.skeleton.startswith("1.")
    assert answer.text == normal_text(tiny_target, tokenizer, 10)


def test_a_question_the_router_rejects_is_decoded_normally(tiny_target, tokenizer):
    router = SkeletonRouter.for_model(tiny_target)
    with torch.no_grad():
        router.linear.weight.zero_()
        router.linear.bias.fill_(-5.0)  # "never suits SoT"
    answer = generate(tiny_target, tokenizer, QUESTION, router=router, max_new_tokens=10, temperature=0.0)
    assert answer.router_accepted is False and answer.router_score < 0.01 and not answer.used_skeleton
    assert answer.text == normal_text(tiny_target, tokenizer, 10) and "router" in answer.seconds


def test_bad_input_is_refused(tiny_target, make_tiny_model, tokenizer):
    with pytest.raises(ValueError, match="question is empty"):
        generate(tiny_target, tokenizer, " ")
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(tiny_target, tokenizer, QUESTION, max_new_tokens=0)
    with pytest.raises(ValueError, match="do not fit"):
        generate(make_tiny_model(layers=3), tokenizer, QUESTION, router=SkeletonRouter.for_model(tiny_target))


def test_the_command_answers_and_refuses_an_empty_question(tiny_target, tokenizer, tmp_path):
    tiny_target.save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    runner = CliRunner()
    result = runner.invoke(app, ["sot", QUESTION, "-m", str(tmp_path / "tiny"), "-n", "6", "--skeleton-tokens", "4",
                                 "--json"])
    assert result.exit_code == 0, result.output
    answer = json.loads(result.stdout.strip().splitlines()[-1])
    assert answer["text"] and answer["used_skeleton"] is False and "total" in answer["seconds"]
    result = runner.invoke(app, ["sot", "  ", "-m", str(tmp_path / "tiny")])
    assert result.exit_code == 2 and "question is empty" in result.output


def test_the_benchmark_summary_counts_what_happened():
    def row(dataset, ratio, accepted, label, verdict):
        return {"dataset": dataset, "latency_ratio": ratio, "router_accepted": accepted, "label": label,
                "judge": verdict, "used_skeleton": True, "rouge_l": 0.5, "normal_seconds": 4.0,
                "sot_r_latency_ratio": ratio if accepted else 0.9}

    rows = [row("sharegpt", 2.0, True, 1, "win"), row("sharegpt", 8.0, True, 0, "tie"),
            row("humaneval", 0.5, False, 0, "loss")]
    result = summaries(rows)
    assert result["sharegpt"]["latency_ratio"] == pytest.approx(4.0)  # geometric mean
    assert result["all"]["router_accuracy"] == pytest.approx(2 / 3) and result["all"]["router_accepted"] == 2
    assert result["all"]["judge"] == {"win": 1, "tie": 1, "loss": 1}
    assert result["humaneval"]["latency_ratio_router_accepted"] is None

"""Skeleton-of-Thought measured as the paper measures it (Ning et al. 2023, arXiv:2307.15337, sections 3-4), on
this machine: for each question, the latency to the full answer of SoT and of normal decoding by the same model
with the same answer budget (run one after the other, in a seeded random order), the ROUGE-L of SoT's answer
against normal decoding's, a judged pairwise preference by a larger model with the two answers in a seeded random
order, and the router's decision beside the label the judge model gives the question (the router's labels).

SoT-R's latency is the router's time plus SoT's where the router accepts the question, and plus normal
decoding's where it does not (that answer is then normal decoding's own).
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass

from accelgen.bench.report import table
from accelgen.loop import generate as decode
from accelgen.quality import rouge_l
from accelgen.skeleton.asking import calibrated_label, pairwise_verdict, router_probabilities
from accelgen.skeleton.pipeline import generate as skeleton_of_thought

VERDICT_FOR_SOT = {("sot", "first"): "win", ("sot", "second"): "loss", ("normal", "first"): "loss",
                   ("normal", "second"): "win"}


@dataclass
class Setup:
    """The models of a run: SoT's (with its router, or None) and the judge (with its content-free answer to the
    router prompt, which calibrates its labels: asking.py), and the answer budget."""

    model: object
    tokenizer: object
    router: object
    judge: object
    judge_tokenizer: object
    label_bias: dict
    max_new_tokens: int


def timed(run):
    started = time.perf_counter()
    return run(), time.perf_counter() - started


def warm_up(setup: Setup) -> None:
    """Run every stage once, untimed: the first forwards of a freshly loaded model are several times slower (kernel
    selection, memory first touched), which would count against whichever answer came first."""
    question = "Give three tips for a good night's sleep."
    skeleton_of_thought(setup.model, setup.tokenizer, question, temperature=0.0, max_new_tokens=12, skeleton_tokens=24)
    decode(setup.model, setup.tokenizer, [{"role": "user", "content": question}], temperature=0.0, max_new_tokens=12)
    pairwise_verdict(setup.judge, setup.judge_tokenizer, question, "Sleep.", "Rest.")


def measure_question(setup: Setup, question: str, rng: random.Random) -> dict:
    """One question's row: both answers with their latencies, quality, the judge's verdict, the router's call."""
    greedy = dict(temperature=0.0, max_new_tokens=setup.max_new_tokens)

    def normal():
        return decode(setup.model, setup.tokenizer, [{"role": "user", "content": question}], **greedy)

    def sot():
        return skeleton_of_thought(setup.model, setup.tokenizer, question, **greedy)

    sot_first = rng.random() < 0.5  # which runs first: drift in the machine's speed hits both alike
    if sot_first:
        (answer, sot_seconds), (plain, normal_seconds) = timed(sot), timed(normal)
    else:
        (plain, normal_seconds), (answer, sot_seconds) = timed(normal), timed(sot)
    row = {"normal_seconds": normal_seconds, "sot_seconds": sot_seconds, "latency_ratio": normal_seconds / sot_seconds,
           "normal_tokens": len(plain.token_ids), "sot_tokens": answer.tokens, "used_skeleton": answer.used_skeleton,
           "reason": answer.reason, "points": len(answer.points), "sot_stage_seconds": answer.seconds,
           "rouge_l": rouge_l(setup.tokenizer(plain.text).input_ids, setup.tokenizer(answer.text).input_ids),
           "normal_answer": plain.text, "sot_answer": answer.text, "skeleton": answer.skeleton}
    row.update(judged(setup, question, answer.text, plain.text, rng))
    row.update(routed(setup, question, row))
    return row


def judged(setup: Setup, question: str, sot_answer: str, normal_answer: str, rng: random.Random) -> dict:
    """The judge's verdict for SoT ("win", "tie" or "loss"), the answers shown in a random order."""
    shown_first = "sot" if rng.random() < 0.5 else "normal"
    first, second = (sot_answer, normal_answer) if shown_first == "sot" else (normal_answer, sot_answer)
    verdict, probabilities = pairwise_verdict(setup.judge, setup.judge_tokenizer, question, first, second)
    return {"judge": VERDICT_FOR_SOT.get((shown_first, verdict), "tie"), "judge_shown_first": shown_first,
            "judge_probabilities": probabilities}


def routed(setup: Setup, question: str, row: dict) -> dict:
    """The judge model's label of the question, the router's call (when there is a router) and SoT-R's latency."""
    label = calibrated_label(router_probabilities(setup.judge, setup.judge_tokenizer, question), setup.label_bias)
    if setup.router is None:
        return {"label": label}
    (accepted, score), seconds = timed(lambda: setup.router.accepts(setup.model, setup.tokenizer, question))
    routed_seconds = seconds + (row["sot_seconds"] if accepted else row["normal_seconds"])
    return {"label": label, "router_accepted": accepted, "router_score": score, "router_seconds": seconds,
            "sot_r_seconds": routed_seconds, "sot_r_latency_ratio": row["normal_seconds"] / routed_seconds}


def geometric_mean(values: list[float]) -> float | None:
    return math.exp(sum(map(math.log, values)) / len(values)) if values else None


def summarize(rows: list[dict]) -> dict:
    """Aggregates of some rows: latency ratios (geometric means), ROUGE-L, the judge's verdicts, router accuracy."""
    accepted = [row for row in rows if row.get("router_accepted")]
    routed_rows = [row for row in rows if "router_accepted" in row]
    return {
        "questions": len(rows),
        "skeleton_parsed": sum(row["used_skeleton"] for row in rows),
        "latency_ratio": geometric_mean([row["latency_ratio"] for row in rows]),
        "latency_ratio_router_accepted": geometric_mean([row["latency_ratio"] for row in accepted]),
        "sot_r_latency_ratio": geometric_mean([row["sot_r_latency_ratio"] for row in routed_rows]),
        "router_accepted": len(accepted),
        "router_accuracy": (sum(row["router_accepted"] == bool(row["label"]) for row in routed_rows) / len(routed_rows)
                            if routed_rows else None),
        "suits_sot_by_label": sum(row["label"] for row in rows),
        "rouge_l": sum(row["rouge_l"] for row in rows) / len(rows) if rows else None,
        "rouge_l_router_accepted": sum(row["rouge_l"] for row in accepted) / len(accepted) if accepted else None,
        "judge": {verdict: sum(row["judge"] == verdict for row in rows) for verdict in ("win", "tie", "loss")},
        "judge_router_accepted": {verdict: sum(row["judge"] == verdict for row in accepted)
                                  for verdict in ("win", "tie", "loss")},
    }


def summaries(rows: list[dict]) -> dict:
    """summarize() over every dataset and over all rows ("all")."""
    datasets = sorted({row["dataset"] for row in rows})
    return {**{name: summarize([row for row in rows if row["dataset"] == name]) for name in datasets},
            "all": summarize(rows)}


def ratio(value) -> str:
    return "n/a" if value is None else f"{value:.2f}×"


def share(value) -> str:
    return "n/a" if value is None else f"{value:.1%}"


def summary_lines(results: dict) -> list[str]:
    """The report's table: one row per dataset and one for all questions."""
    rows = []
    for scope, summary in results["summaries"].items():
        verdicts = summary["judge"]
        rows.append([scope, summary["questions"], summary["skeleton_parsed"], ratio(summary["latency_ratio"]),
                     f"{summary['router_accepted']}/{summary['questions']}",
                     ratio(summary["latency_ratio_router_accepted"]), ratio(summary["sot_r_latency_ratio"]),
                     share(summary["router_accuracy"]), f"{summary['rouge_l']:.3f}",
                     f"{verdicts['win']}/{verdicts['tie']}/{verdicts['loss']}"])
    return table(["questions", "n", "skeleton parsed", "latency ratio, SoT on all", "router accepts",
                  "latency ratio, accepted", "latency ratio, SoT-R", "router accuracy", "ROUGE-L vs normal",
                  "judge: SoT win/tie/loss"], rows)


def question_lines(rows: list[dict]) -> list[str]:
    """A row per question: its latencies, points, router call and label, ROUGE-L and the verdict."""
    return table(["question", "dataset", "normal s", "SoT s", "ratio", "points", "router", "label", "ROUGE-L", "judge"],
                 [[row["id"], row["dataset"], f"{row['normal_seconds']:.1f}", f"{row['sot_seconds']:.1f}",
                   f"{row['latency_ratio']:.2f}", row["points"],
                   {True: "SoT", False: "normal", None: "-"}[row.get("router_accepted")],
                   "SoT" if row["label"] else "normal", f"{row['rouge_l']:.3f}", row["judge"]] for row in rows])

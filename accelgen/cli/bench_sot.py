"""`accelgen bench-sot`: Skeleton-of-Thought against normal decoding of the same model on ShareGPT and HumanEval
questions (accelgen/skeleton/evaluation.py): latency to the full answer, ROUGE-L, a judged preference, and the
router's calls. Writes OUT/results.json (after every question: a rerun with the same settings goes on from
there), OUT/report.md and OUT/sot.png."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Optional

import typer

from accelgen.cli.common import (DEVICE_OPTION, MODEL_HELP, THREADS_OPTION, console, load_with_progress,
                                 reported_errors, require_modules, set_threads)


def bench_sot(
    model: str = typer.Option("qwen2.5-coder-0.5b", "--model", "-m", help=MODEL_HELP),
    weights: Optional[str] = typer.Option("bf16", "--weights", help="Weight format of --model (a PyTorch one)."),
    router: Optional[Path] = typer.Option(None, "--router", help="A router from `accelgen train sot-router`."),
    judge: str = typer.Option("qwen2.5-coder-1.5b", "--judge", help="The model judging the answers pairwise and "
                              "labelling the questions as the router's training labels are."),
    judge_weights: Optional[str] = typer.Option("bf16", "--judge-weights",
                                                help="Weight format of --judge (a PyTorch one)."),
    sharegpt: int = typer.Option(10, "--sharegpt", min=0, help="ShareGPT questions (the first ones)."),
    humaneval: int = typer.Option(10, "--humaneval", min=0, help="HumanEval prompts (the first ones)."),
    max_new_tokens: int = typer.Option(160, "--max-new-tokens", "-n", min=1, help="The answer budget of both."),
    seed: int = typer.Option(0, help="Seeds the order of the runs and of the answers shown to the judge."),
    out: Path = typer.Option(..., "--out", help="Folder for results.json, report.md and sot.png."),
    threads: Optional[int] = THREADS_OPTION,
    device: Optional[str] = DEVICE_OPTION,
):
    """Skeleton-of-Thought vs normal decoding: latency to the full answer, ROUGE-L, judged preference, router."""
    require_modules("matplotlib", "rouge_score")
    from accelgen.atomic import write_json_atomically, write_text_atomically
    from accelgen.datasets import load_dataset
    from accelgen.hardware import describe
    from accelgen.skeleton import SkeletonRouter
    from accelgen.skeleton.asking import content_free_bias
    from accelgen.skeleton.evaluation import Setup, measure_question, warm_up
    from accelgen.skeleton.plots import sot_plot

    set_threads(threads)
    settings = {"model": model, "weights": weights, "router": str(router) if router else None, "judge": judge,
                "judge_weights": judge_weights, "max_new_tokens": max_new_tokens, "seed": seed,
                **({"device": device} if device not in (None, "cpu") else {})}  # a CPU run's settings as before
    with reported_errors():
        prompts = ([*load_dataset("sharegpt", limit=sharegpt)] if sharegpt else []) + \
                  ([*load_dataset("humaneval", limit=humaneval)] if humaneval else [])
        rows = earlier_rows(out / "results.json", settings)
        target_model, tokenizer = load_with_progress(model, None, weights, device)
        judge_model, judge_tokenizer = load_with_progress(judge, None, judge_weights, device)
        setup = Setup(target_model, tokenizer, None if router is None else SkeletonRouter.load(router, target_model),
                      judge_model, judge_tokenizer, content_free_bias(judge_model, judge_tokenizer), max_new_tokens)
        with console.status("warming up …"):
            warm_up(setup)
        done = {row["id"] for row in rows}
        for index, prompt in enumerate(prompts):
            if prompt.id in done:
                continue
            rng = random.Random(f"{seed}:{prompt.id}")  # per question: a resumed run draws the same
            rows.append({"id": prompt.id, "dataset": prompt.category, **measure_question(setup, prompt.text, rng)})
            write_json_atomically(out / "results.json", results(settings, rows, describe(threads)))
            console.print(f"{index + 1}/{len(prompts)} {prompt.id}: SoT {rows[-1]['latency_ratio']:.2f}× faster, "
                          f"ROUGE-L {rows[-1]['rouge_l']:.2f}, judge: {rows[-1]['judge']}")
    content = results(settings, rows, describe(threads))
    write_json_atomically(out / "results.json", content)
    write_text_atomically(out / "report.md", report(content))
    sot_plot(rows, out / "sot.png")
    console.print(f"→ {out}/report.md, results.json, sot.png")


def earlier_rows(path: Path, settings: dict) -> list[dict]:
    """The rows of an earlier run with the same settings (to go on from), else none."""
    if not path.exists():
        return []
    content = json.loads(path.read_text(encoding="utf-8"))
    return content["rows"] if content.get("settings") == settings else []


def results(settings: dict, rows: list[dict], machine: dict) -> dict:
    from accelgen.skeleton.evaluation import summaries

    return {"settings": settings, "machine": machine, "summaries": summaries(rows), "rows": rows}


def report(content: dict) -> str:
    from accelgen.hardware import flags_text
    from accelgen.skeleton.evaluation import question_lines, summary_lines

    settings = content["settings"]
    router = f" --router {settings['router']}" if settings["router"] else ""
    command = (f"accelgen bench-sot --model {settings['model']} --weights {settings['weights']}{router} "
               f"--judge {settings['judge']} "
               f"--judge-weights {settings['judge_weights']} --max-new-tokens {settings['max_new_tokens']} "
               f"--seed {settings['seed']}" + (f" --device {settings['device']}" if settings.get("device") else ""))
    machine = content["machine"]
    lines = ["# Skeleton-of-Thought vs normal decoding", "",
             f"Measured by `{command}` on {flags_text(machine)}, {machine['torch_threads']} threads.", "",
             "Latency ratio: normal decoding's seconds to the full answer / SoT's (geometric mean over questions; "
             "above 1: SoT answers sooner). SoT-R: the router's call decides, a rejected question is decoded "
             "normally. Router accuracy: its calls against the judge model's labels of the same questions (the "
             "labels it was trained on, asked of these held-out questions). Judge: the judge model's pairwise "
             "verdict for SoT's answer against normal decoding's, the two shown in a seeded random order.", "",
             *summary_lines(content), "", "## Per question", "", *question_lines(content["rows"]), ""]
    return "\n".join(lines)

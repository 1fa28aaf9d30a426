"""`accelgen sot`: answer one question with Skeleton-of-Thought (accelgen/skeleton/): the answer on stdout, the
skeleton, the router's decision and the timings on stderr (or all of it as --json)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from accelgen.cli.common import (DEVICE_OPTION, DTYPE_HELP, MODEL_HELP, THREADS_OPTION, WEIGHTS_OPTION, console,
                                 load_with_progress, reported_errors, set_threads)
from accelgen.method_options import parse_options_of


def sot(
    question: str = typer.Argument(..., help="The question ('-' reads it from standard input)."),
    model: str = typer.Option("qwen2.5-coder-0.5b", "--model", "-m", help=MODEL_HELP),
    weights: Optional[str] = WEIGHTS_OPTION,
    dtype: Optional[str] = typer.Option(None, help=DTYPE_HELP),
    device: Optional[str] = DEVICE_OPTION,
    router: Optional[Path] = typer.Option(None, "--router", help="A router folder from `accelgen train sot-router` "
                                          "(default: no router, SoT is always tried)."),
    method: str = typer.Option("autoregressive", "--method", help="The method every stage decodes with."),
    option: list[str] = typer.Option([], "--option", "-o", metavar="[METHOD.]NAME=VALUE",
                                     help="Option of --method, name=value (or method.name=value; repeatable)."),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", "-n", min=1,
                                       help="The answer's budget, split between the points."),
    skeleton_tokens: int = typer.Option(96, "--skeleton-tokens", min=1, help="The skeleton's own budget."),
    as_json: bool = typer.Option(False, "--json", help="Print the answer, skeleton, points and timings as JSON."),
    threads: Optional[int] = THREADS_OPTION,
):
    """Answer a question with Skeleton-of-Thought: a skeleton of points, then every point expanded at once."""
    import accelgen
    from accelgen.skeleton import SkeletonRouter, generate
    from accelgen.skeleton.prompts import check_question

    set_threads(threads)
    if question == "-":
        question = sys.stdin.read()
    with reported_errors():
        check_question(question)  # before loading the model, which takes a while
        spec = accelgen.get_method(method)
        options = spec.check_options(parse_options_of(method, option))
        target_model, tokenizer = load_with_progress(model, dtype, weights, device)
        chosen_router = None if router is None else SkeletonRouter.load(router, target_model)
        answer = generate(target_model, tokenizer, question, router=chosen_router, max_new_tokens=max_new_tokens,
                          skeleton_tokens=skeleton_tokens, method=method, temperature=0.0, **options)
    if as_json:
        print(json.dumps(answer.to_dict()))
        return
    print(answer.text)
    seconds = ", ".join(f"{stage} {value:.2f}s" for stage, value in answer.seconds.items())
    console.print(f"[dim]{'skeleton-of-thought' if answer.used_skeleton else 'normal decoding'}: {answer.reason}; "
                  f"{seconds}[/dim]")

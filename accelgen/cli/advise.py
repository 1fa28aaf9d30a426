"""`accelgen advise`: the weight format and method to use on this machine, as Markdown (the section "Which format and
method should I use on my machine?" of docs/weight-formats.md)."""

from __future__ import annotations

import json
from typing import Optional

import typer

from accelgen.cli.common import DEVICE_OPTION, FILE_ERRORS, MODEL_HELP, THREADS_OPTION, reported_errors


def advise(
    model: str = typer.Option("qwen2.5-coder-1.5b", "--model", "-m", help=MODEL_HELP),
    draft: Optional[str] = typer.Option(None, "--draft", "-d", help="Draft model: also choose its format."),
    threads: Optional[int] = THREADS_OPTION,
    device: Optional[str] = DEVICE_OPTION,
    as_json: bool = typer.Option(False, "--json", help="Print the advice and its measurements as JSON."),
):
    """Which weight format and method to use on this machine: each format timed once (cached), then what
    `auto` picks from the costs measured in the chosen formats. Prints Markdown (as in docs/weight-formats.md). On a GPU
    (--device) the format is bf16 without a probe and the costs are measured there."""
    from accelgen.advice import advice_markdown, advise as measure_advice

    with reported_errors(FILE_ERRORS):
        advice = measure_advice(model, draft, threads, device)
    print(json.dumps(advice, indent=1) if as_json else advice_markdown(advice))

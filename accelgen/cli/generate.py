"""`accelgen generate`: one prompt, one method; the text on stdout and the run's stats on stderr (or --json)."""

from __future__ import annotations

import json
import sys
from typing import Optional

import typer

from accelgen.cli.common import (DEVICE_OPTION, DRAFT_WEIGHTS_OPTION, DTYPE_HELP, MODEL_HELP, THREADS_OPTION,
                                 WEIGHTS_OPTION, console, format_options, load_target_and_draft, reported_errors,
                                 set_threads, target_weights_for)
from accelgen.method_options import parse_options_of


def generate(
    prompt: str = typer.Argument(..., help="The prompt text ('-' reads it from standard input)."),
    model: str = typer.Option("smollm2-135m", "--model", "-m", help=MODEL_HELP),
    draft: Optional[str] = typer.Option(None, "--draft", "-d", help="Draft model, for methods that need one."),
    method: str = typer.Option("autoregressive", "--method", help="A method from `accelgen methods`."),
    heads: Optional[str] = typer.Option(None, "--heads", "--head", help="Trained heads folder, for methods that take "
                                        "heads (medusa, blockwise, eagle, calm, consistent-ee); = -o heads=..."),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", "-n", min=0, help="Most tokens to generate."),
    temperature: float = typer.Option(0.0, help="0 = greedy."),
    top_k: int = typer.Option(0, "--top-k", help="Sample among the k likeliest tokens only (0: all)."),
    top_p: float = typer.Option(1.0, "--top-p", help="Sample among the likeliest tokens holding this much "
                                                     "probability (1: all)."),
    seed: Optional[int] = typer.Option(None, help="Sampling seed (the same seed gives the same text)."),
    stop: list[str] = typer.Option([], "--stop", help="Stop string (repeatable)."),
    chat: bool = typer.Option(False, "--chat", help="Wrap the prompt as a user message in the model's chat template."),
    dtype: Optional[str] = typer.Option(None, help=DTYPE_HELP),
    draft_dtype: Optional[str] = typer.Option(None, "--draft-dtype", help="Dtype of the draft model (as --dtype)."),
    weights: Optional[str] = WEIGHTS_OPTION,
    draft_weights: Optional[str] = DRAFT_WEIGHTS_OPTION,
    device: Optional[str] = DEVICE_OPTION,
    option: list[str] = typer.Option([], "--option", "-o", metavar="[METHOD.]NAME=VALUE",
                                     help="Method option name=value (or method.name=value; repeatable), "
                                          "e.g. -o gamma=8."),
    as_json: bool = typer.Option(False, "--json", help="Print text, token_ids, finish_reason and stats as one JSON object."),
    stream: bool = typer.Option(False, "--stream", help="Print text as it is committed."),
    threads: Optional[int] = THREADS_OPTION,
):
    """Generate text with one method and print it (with stats on stderr, or all of it as --json)."""
    import accelgen
    from accelgen.drafters.draft_tree import draft_weights_for

    set_threads(threads)
    if prompt == "-":
        prompt = sys.stdin.read()
    with reported_errors():
        spec = accelgen.get_method(method)
        options = spec.check_options({**parse_options_of(method, option), **({"heads": heads} if heads else {})})
        spec.check_needs(draft_model=draft, how="--draft")  # before loading the target, which may take a while
        draft_weights = draft_weights_for([method], draft, draft_weights, device=device, threads=threads)
        weights = target_weights_for([method], model, weights, dtype, device, threads)
        target_model, tokenizer, draft_model = load_target_and_draft(model, dtype, weights, draft, draft_dtype,
                                                                     draft_weights, device)
        request = [{"role": "user", "content": prompt}] if chat else prompt
        kwargs = dict(method=method, draft_model=draft_model, max_new_tokens=max_new_tokens, temperature=temperature,
                      top_k=top_k, top_p=top_p, seed=seed, stop=stop, **options)
        if stream and not as_json:
            result = print_stream(accelgen.generate(target_model, tokenizer, request, stream=True, **kwargs))
        else:
            result = accelgen.generate(target_model, tokenizer, request, **kwargs)
    if as_json:
        print(json.dumps(result.to_dict()))
        return
    if not stream:
        print(result.text)
    print_stats(method, result)


def print_stream(chunks):
    """Print each committed piece of text as it comes; the finished result."""
    for chunk in chunks:
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return chunks.result


def print_stats(method: str, result) -> None:
    s = result.stats
    if "choice" in s:
        choice = s["choice"]
        console.print(f"[dim]{method} → {choice['method']} {format_options(choice['options'])}: {choice['reason']}[/dim]")
    console.print(
        f"[dim]{method}: {s['new_tokens']} tokens in {s['seconds']:.2f}s ({s['tokens_per_second']:.2f} tok/s), "
        f"{s['target_forwards']} target forwards, {s['mean_accepted_tokens']:.2f} tokens/forward, "
        f"acceptance {s['acceptance_rate']:.2f}, finish: {result.finish_reason}[/dim]"
    )

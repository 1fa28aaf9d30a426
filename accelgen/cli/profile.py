"""`accelgen profile`: forward costs r(k), the draft's cost ratio c, and the draft lengths they predict pay."""

from __future__ import annotations

import json
from typing import Optional

import typer
from rich.table import Table

from accelgen.cli.common import (DEVICE_OPTION, DRAFT_WEIGHTS_OPTION, DTYPE_HELP, MODEL_HELP, THREADS_OPTION,
                                 WEIGHTS_OPTION, console, load_target_and_draft, set_threads, table_console)


def profile(
    model: str = typer.Option("smollm2-135m", "--model", "-m", help=MODEL_HELP),
    draft: Optional[str] = typer.Option(None, "--draft", "-d", help="Draft model: also measure c and predict γ."),
    dtype: Optional[str] = typer.Option(None, help=DTYPE_HELP),
    draft_dtype: Optional[str] = typer.Option(None, "--draft-dtype", help="Dtype of the draft model (as --dtype)."),
    weights: Optional[str] = WEIGHTS_OPTION,
    draft_weights: Optional[str] = DRAFT_WEIGHTS_OPTION,
    device: Optional[str] = DEVICE_OPTION,
    context_tokens: Optional[int] = typer.Option(None, "--context-tokens", help="A one-off profile (not cached): "
                                                 "the KV-cache length the forwards run after (default 256)."),
    sizes: Optional[str] = typer.Option(None, help="A one-off profile (not cached): block sizes k to time, "
                                                   "comma-separated (default 1,2,4,8,16,32)."),
    alphas: str = typer.Option("0.5,0.6,0.7,0.8,0.9", help="Acceptance rates to predict speedups for."),
    repeats: Optional[int] = typer.Option(None, help="A one-off profile (not cached): timed forwards per size "
                                                     "(median; default 5)."),
    batch_sizes: str = typer.Option("", "--batch-sizes", help="Also time batched forwards for these batch sizes "
                                                             "(the server's verification), e.g. 1,2,4,8."),
    remeasure: bool = typer.Option(False, "--remeasure", help="Measure the cached costs again (after a change "
                                                              "to the machine, its load or the libraries)."),
    threads: Optional[int] = THREADS_OPTION,
    as_json: bool = typer.Option(False, "--json", help="Print the profile as JSON."),
):
    """Forward costs: verification cost r(k), the draft's cost ratio c, and the predicted best γ.

    Without --sizes, --context-tokens or --repeats: the costs the policies use (gamma_schedule=cost, sizes
    "auto", auto, the server), measured once per model, weight format and machine and cached; --remeasure
    measures them again. With any of those: a one-off profile with those settings, not cached."""
    from accelgen.costs import cached_profile, model_format
    from accelgen.models.probe import cached_choice
    from accelgen.profile import profile as measure

    set_threads(threads)
    one_off = sizes is not None or context_tokens is not None or repeats is not None
    if one_off and remeasure:
        raise typer.BadParameter("--remeasure measures the cached costs again; --sizes, --context-tokens and "
                                 "--repeats make a one-off profile instead: give one or the other")
    context_tokens = 256 if context_tokens is None else context_tokens
    repeats = 5 if repeats is None else repeats
    block_sizes, acceptance, batches = parse_profile_lists("1,2,4,8,16,32" if sizes is None else sizes, alphas,
                                                           batch_sizes)
    if min(block_sizes + batches) < 1 or context_tokens < 1 or not all(0 <= alpha <= 1 for alpha in acceptance):
        raise typer.BadParameter("sizes and --context-tokens must be >= 1, acceptance rates within [0, 1]")
    target_model, _, draft_model = load_target_and_draft(model, dtype, weights, draft, draft_dtype, draft_weights,
                                                         device)
    if one_off:
        with console.status("profiling …") as status:
            result = measure(target_model, draft_model, context_tokens=context_tokens, sizes=block_sizes,
                             repeats=repeats, batch_sizes=batches,
                             progress=lambda message: status.update(f"profiling: {message} …"))
    else:  # progress of a measurement goes to stderr
        result = cached_profile(target_model, draft_model, batches, threads=threads, remeasure=remeasure)
    add_predictions(result, acceptance, draft_model is not None, batches)
    result["weights"] = model_format(target_model)
    result["device"] = str(target_model.device)
    if as_json:
        print(json.dumps({**result, "weights_auto": cached_choice(model, threads)}, indent=1))
        return
    print_profile(result, model, draft, threads, batches)


def parse_profile_lists(sizes: str, alphas: str, batch_sizes: str) -> tuple[list[int], list[float], list[int]]:
    """The comma-separated block sizes, acceptance rates and batch sizes."""
    try:
        return ([int(size) for size in sizes.split(",")], [float(alpha) for alpha in alphas.split(",")],
                [int(size) for size in batch_sizes.split(",") if size.strip()])
    except ValueError:
        raise typer.BadParameter("--sizes and --batch-sizes take integers, --alphas numbers, comma-separated") from None


def add_predictions(result: dict, acceptance: list[float], with_draft: bool, batches: list[int]) -> None:
    """The speedups the measured costs predict at each acceptance rate, written into the profile."""
    from accelgen.profile import batch_table, speedup_table

    result["model_free_predictions"] = speedup_table({**result, "cost_ratio": 0.0}, acceptance)
    if with_draft:
        result["predictions"] = speedup_table(result, acceptance)
    if batches:
        result["batch_predictions"] = {alpha: batch_table(result, alpha) for alpha in acceptance}


def print_profile(result: dict, model: str, draft: Optional[str], threads: Optional[int], batches: list[int]) -> None:
    from accelgen.models.probe import probe_report

    out = table_console()
    on_cpu = result["device"] == "cpu"
    if on_cpu and (report := probe_report(model, threads)) is not None:  # the probe times CPU formats
        out.print(report)
    table = Table("k (tokens per forward)", "target forward (ms)", "r(k) = t(k) / t(1)")
    for k, seconds in result["target_seconds"].items():
        table.add_row(str(k), f"{seconds * 1000:.1f}", f"{result['verify_ratio'][k]:.2f}")
    out.print(f"{model} ({result['weights']}{'' if on_cpu else ', ' + result['device']}): one forward over k tokens "
              f"after {result['context_tokens']} cached tokens"
              + (f" (cached in {result['cache']}; --remeasure to measure again)" if "cache" in result else ""))
    out.print(table)
    predictions = [("model-free drafts (c = 0)", result["model_free_predictions"])]
    if draft:  # a draft model was loaded
        out.print(f"{draft}: {result['draft_seconds'] * 1000:.1f} ms per token, c = {result['cost_ratio']:.3f}")
        predictions.append((f"{draft} drafting (c = {result['cost_ratio']:.3f})", result["predictions"]))
    for what, rows in predictions:
        table = Table("α", f"best γ, {what}", "predicted speedup E / (γc + r(γ+1))")
        for row in rows:
            table.add_row(f"{row['alpha']:.2f}", str(row["best_gamma"]), f"{row['predicted_speedup']:.2f}×")
        out.print(table)
    out.print("γ = 0: plain decoding (no draft length pays)")
    if batches:
        print_batch_profile(out, result, batches)


def print_batch_profile(out, result: dict, batches: list[int]) -> None:
    table = Table("batch b", *[f"k={k}: t (ms), r" for k in result["batch_seconds"][batches[0]]])
    for batch, seconds in result["batch_seconds"].items():
        table.add_row(str(batch), *[f"{t * 1000:.1f}, {t / seconds[1]:.2f}" for t in seconds.values()])
    out.print("batched verification: b sequences, k tokens each")
    out.print(table)
    table = Table("α (model-free drafter)", *[f"b={b}: γ, gain, budget" for b in result["batch_seconds"]])
    for alpha, rows in result["batch_predictions"].items():
        table.add_row(f"{alpha:.2f}", *[f"{r['best_gamma']}, {r['predicted_gain']:.2f}×, {r['token_budget']}" for r in rows])
    out.print(table)
    out.print("serve with --token-budget near the budgets above (drafts are capped at budget // b − 1)")

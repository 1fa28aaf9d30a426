"""`accelgen tune`: for a model on this machine, the layers self-speculative skips or the method auto picks."""

from __future__ import annotations

from typing import Optional

import typer
from rich.table import Table

from accelgen.cli.common import (DEVICE_OPTION, DRAFT_WEIGHTS_OPTION, DTYPE_HELP, THREADS_OPTION, WEIGHTS_OPTION,
                                 console, format_options, load_prompts, load_target_and_draft, reported_errors,
                                 require_modules, set_threads, table_console)


def tune(
    method: str = typer.Argument(..., help="What to tune: self-speculative (its skipped layers) or auto (its choice)."),
    model: str = typer.Option("smollm2-135m", "--model", "-m", help="Embedded name or local folder (the result is saved beside it)."),
    draft: Optional[str] = typer.Option(None, "--draft", "-d", help="auto: the draft model it may use."),
    dtype: Optional[str] = typer.Option(None, help=DTYPE_HELP),
    draft_dtype: Optional[str] = typer.Option(None, "--draft-dtype", help="Dtype of the draft model (as --dtype)."),
    weights: Optional[str] = WEIGHTS_OPTION,
    draft_weights: Optional[str] = DRAFT_WEIGHTS_OPTION,
    device: Optional[str] = DEVICE_OPTION,
    dataset: str = typer.Option("humaneval", help="Calibration prompts (spread over the second half of this dataset); "
                                                  "auto saves its choice under this workload name."),
    prompts: int = typer.Option(3, help="Number of calibration prompts."),
    trials: int = typer.Option(40, help="self-speculative: skip sets to try (the first is the default one)."),
    max_new_tokens: int = typer.Option(32, "--max-new-tokens", "-n", min=1, help="Tokens generated per calibration prompt."),
    gamma: int = typer.Option(4, help="self-speculative: draft length while tuning."),
    seed: int = typer.Option(0, help="Seed of the search (the same seed tries the same skip sets)."),
    threads: Optional[int] = THREADS_OPTION,
):
    """Tune for a model on this machine: the layers self-speculative skips, or the method auto picks."""
    from accelgen.datasets import prompt_token_ids
    from accelgen.models.loading import pytorch_weights

    if method not in ("self-speculative", "auto"):
        raise typer.BadParameter(f"only self-speculative and auto can be tuned, not {method!r}")
    if method == "self-speculative":
        require_modules("optuna")  # its search; before the model loads
    chosen = calibration_prompts(load_prompts(dataset), prompts)
    set_threads(threads)
    if method == "self-speculative":  # it walks the target's layers: a PyTorch model
        weights = pytorch_weights(model, weights, dtype)
    target_model, tokenizer, draft_model = load_target_and_draft(model, dtype, weights, draft, draft_dtype,
                                                                 draft_weights, device)
    calibration = [prompt_token_ids(tokenizer, prompt) for prompt in chosen]
    with reported_errors():
        if method == "auto":
            tune_auto_command(target_model, tokenizer, draft_model, calibration, dataset, max_new_tokens)
        else:
            tune_self_speculative_command(target_model, tokenizer, calibration, trials, max_new_tokens, gamma, seed)


def calibration_prompts(dataset: list, count: int) -> list:
    """count prompts spread evenly over the dataset's second half: away from the first ones, which benchmarks
    take, and not one stretch of it (the end of ShareGPT is mostly poems and brainstorms)."""
    second_half = dataset[len(dataset) // 2 :]
    if count >= len(second_half):
        return second_half
    step = len(second_half) / count
    return [second_half[int(i * step)] for i in range(count)]


def tune_self_speculative_command(target_model, tokenizer, calibration, trials, max_new_tokens, gamma, seed):
    from accelgen.tune import save_tuned_skip, tune_self_speculative

    best = {"speedup": 0.0}

    def show(trial: int, scores: dict) -> None:
        best["speedup"] = max(best["speedup"], scores["speedup"])
        console.print(f"trial {trial + 1}/{trials}: {scores['speedup']:.2f}× autoregressive, τ {scores['tau']:.2f} "
                      f"(best {best['speedup']:.2f}×)")

    result = tune_self_speculative(target_model, tokenizer, calibration, trials=trials, max_new_tokens=max_new_tokens,
                                   gamma=gamma, seed=seed, progress=show)
    path = save_tuned_skip(target_model, result)
    skip = result["skip"]
    table_console().print(f"best: skip attention {skip['skip_attention']}, MLP {skip['skip_mlp']}: "
                          f"{result['speedup']:.2f}× autoregressive on the calibration prompts, τ {result['tau']:.2f}")
    console.print(f"saved to {path}; `--method self-speculative` uses it from now on")


def tune_auto_command(target_model, tokenizer, draft_model, calibration, workload, max_new_tokens):
    from accelgen.drafters.auto import save_choice
    from accelgen.tune import tune_auto

    def show(done: int, total: int, row: dict) -> None:
        console.print(f"[{done + 1}/{total}] {row['method']} {format_options(row['options'])}: "
                      f"{row['seconds_per_token'] * 1000:.1f} ms/token, τ {row['tau']:.2f}")

    result = tune_auto(target_model, tokenizer, calibration, draft_model=draft_model, max_new_tokens=max_new_tokens,
                       progress=show)
    table = Table("method", "options", "ms per token", "τ", "speedup")
    for row in sorted(result["table"], key=lambda row: -row["speedup"]):
        table.add_row(row["method"], format_options(row["options"]), f"{row['seconds_per_token'] * 1000:.1f}",
                      f"{row['tau']:.2f}", f"{row['speedup']:.2f}×")
    table_console().print(table)
    path = save_choice(target_model, draft_model, workload, result)
    table_console().print(f"auto → {result['method']} {format_options(result['options'])}: {result['reason']}")
    console.print(f"saved to {path} (workload {workload!r}); `--method auto` uses it from now on")

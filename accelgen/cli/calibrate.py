"""`accelgen calibrate calm`: the exit threshold that keeps calm's tokens near the full model's, with a guarantee."""

from __future__ import annotations

from typing import Optional

import typer

from accelgen.cli.common import (DEVICE_OPTION, DTYPE_HELP, THREADS_OPTION, console, load_prompts, load_with_progress,
                                 reported_errors, set_threads, table_console)


def calibrate(
    method: str = typer.Argument(..., help="What to calibrate: calm (its exit threshold)."),
    model: str = typer.Option("smollm2-135m", "--model", "-m", help="Embedded name or local folder (the result is saved beside it)."),
    dtype: Optional[str] = typer.Option(None, help=DTYPE_HELP),
    measure: str = typer.Option("softmax", help="calm's confidence measure: softmax, saturation or classifier."),
    heads: Optional[str] = typer.Option(None, help="Trained exit heads (`accelgen train exit-heads`); needed by classifier."),
    dataset: str = typer.Option("humaneval", help="Calibration prompts (taken from the end of this dataset)."),
    prompts: int = typer.Option(30, help="Number of calibration prompts (more give a tighter guarantee)."),
    epsilon: float = typer.Option(0.1, help="Tolerated risk: mean disagreement with the full model's tokens."),
    delta: float = typer.Option(0.1, help="Allowed probability that the guarantee fails."),
    thresholds: str = typer.Option("0.99,0.95,0.9,0.8,0.7,0.6,0.5,0.4,0.3,0.2,0.1",
                                   help="Candidate thresholds, tested from the highest down."),
    max_new_tokens: int = typer.Option(32, "--max-new-tokens", "-n", min=1, help="Tokens generated per calibration prompt."),
    threads: Optional[int] = THREADS_OPTION,
    device: Optional[str] = DEVICE_OPTION,
):
    """Choose calm's threshold with Learn-then-Test: agreement with the full model within epsilon, with probability 1 − delta."""
    from accelgen.datasets import prompt_token_ids
    from accelgen.models.loading import pytorch_weights
    from accelgen.train.calibrate import calibrate_calm, save_calibration

    if method != "calm":
        raise typer.BadParameter(f"only calm can be calibrated, not {method!r}")
    try:
        candidates = [float(value) for value in thresholds.split(",")]
    except ValueError:
        raise typer.BadParameter(f"thresholds must be numbers separated by commas, not {thresholds!r}") from None
    chosen = load_prompts(dataset)[-prompts:]
    set_threads(threads)
    target_model, tokenizer = load_with_progress(model, dtype, pytorch_weights(model, None, dtype), device)
    calibration = [prompt_token_ids(tokenizer, prompt) for prompt in chosen]

    def show(row: dict) -> None:
        console.print(f"threshold {row['threshold']:g}: disagreement {row['risk']:.3f}, "
                      f"mean layers {row['mean_layers']:.1f} of {target_model.config.num_hidden_layers}")

    with reported_errors():
        result = calibrate_calm(target_model, tokenizer, calibration, measure=measure, thresholds=candidates,
                                epsilon=epsilon, delta=delta, max_new_tokens=max_new_tokens, heads=heads,
                                progress=show)
        path = save_calibration(target_model, result)
    table_console().print(f"calm ({measure}) → threshold {result['threshold']:g}: disagreement ≤ {epsilon:g} with "
                          f"probability ≥ {1 - delta:g} on prompts like these {len(calibration)}")
    console.print(f"saved to {path}; `-o threshold=calibrated` uses it")

"""What the commands share: the error console, tables on stdout, the options many commands take, loading a
model with a spinner, and ending a command on bad input with its message and exit status 2."""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import sys
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape

from accelgen.errors import InputError
from accelgen.models.loading import DEVICE_HELP, DRAFT_WEIGHTS_HELP, WEIGHTS_HELP, resolve_device
from accelgen.train.loop import is_main_process

console = Console(stderr=True, quiet=not is_main_process())  # under `accelerate launch`, the first process speaks

MODEL_HELP = "Embedded name, HF id, local folder or .gguf file."
DTYPE_HELP = ("float32, bfloat16 or float16 (default: the checkpoint's own; an embedded model given no --weights "
              "either loads in the format measured fastest here, else its GGUF file, and in bfloat16 on a GPU or "
              "where the command needs a PyTorch model).")
WEIGHTS_OPTION = typer.Option(None, "--weights", help=WEIGHTS_HELP)
DRAFT_WEIGHTS_OPTION = typer.Option(None, "--draft-weights", help=DRAFT_WEIGHTS_HELP)
THREADS_OPTION = typer.Option(None, min=1, help="torch CPU threads (default: torch's).")


def check_device(device: Optional[str]) -> Optional[str]:
    """--device, resolved as it is parsed ("auto" and "cuda" become the device they mean, "cuda:0"): a device that
    is not there ends the command at once, before any model loads (exit status 2)."""
    if device is None:
        return None
    try:
        return str(resolve_device(device))
    except ValueError as error:
        raise typer.BadParameter(str(error)) from None


DEVICE_OPTION = typer.Option(None, "--device", help=DEVICE_HELP, callback=check_device)  # a draft model goes there too

# Reported in one line (exit status 2), not a traceback: accelgen's input errors and a file that is not there;
# where the command reads and writes files of its own, also what reading them can fail with (a full disk, a
# malformed file). Anything else is a bug: its traceback, exit status 1.
INPUT_ERRORS = (InputError, FileNotFoundError)
FILE_ERRORS = (InputError, OSError, json.JSONDecodeError, UnicodeDecodeError)
DEBUG_VARIABLE = "ACCELGEN_DEBUG"  # set (not 0/empty): input errors show their traceback too


def debugging() -> bool:
    return os.environ.get(DEBUG_VARIABLE, "") not in ("", "0")


def report(message: str) -> None:
    """Print an error on one line (after its traceback under ACCELGEN_DEBUG); the caller ends the command."""
    if debugging():
        console.print_exception()
    console.print(f"[red]error:[/red] {escape(message)}", soft_wrap=True)  # one line, for grep and logs


def table_console() -> Console:
    """Where tables go: stdout, wide enough not to wrap when piped to a file."""
    return Console() if sys.stdout.isatty() else Console(width=200)


@contextlib.contextmanager
def reported_errors(errors: tuple[type[Exception], ...] = INPUT_ERRORS):
    """Ends the command with the error's message and exit status 2 on an input error (typer's Exit, and any other
    exception, a bug, pass: their traceback is the answer)."""
    try:
        yield
    except typer.Exit:
        raise
    except errors as error:
        report(str(error))
        raise typer.Exit(2) from None


def require_modules(*names: str) -> None:
    """Import a command's optional modules before its slow work (loading a model), so that a missing extra
    stops it at once (the app's ExtrasHintGroup names the extra)."""
    for name in names:
        importlib.import_module(name)


def set_threads(threads: Optional[int]) -> None:
    if threads:
        import torch

        torch.set_num_threads(threads)


def load_with_progress(name: str, dtype: Optional[str], weights: Optional[str] = None, device: Optional[str] = None):
    from accelgen.models import EMBEDDED_MODELS, load_model

    try:
        where = f" on {device}" if device else ""
        with console.status(f"loading {name}{f' ({weights})' if weights else ''}{where} …"):
            return load_model(name, dtype=dtype, weights=weights, device=device)
    except (ValueError, OSError) as error:  # no such model, a format it cannot run, a hub it cannot reach
        hint = "" if isinstance(error, ValueError) else f" (embedded models: {', '.join(EMBEDDED_MODELS)})"
        report(f"cannot load {name!r}: {error}{hint}")
        raise typer.Exit(2) from None


def load_target_and_draft(model: str, dtype: Optional[str], weights: Optional[str], draft: Optional[str],
                          draft_dtype: Optional[str], draft_weights: Optional[str], device: Optional[str] = None):
    """(target, tokenizer, draft model or None), each loaded with a spinner, both on `device` (None: the CPU)."""
    target_model, tokenizer = load_with_progress(model, dtype, weights, device)
    draft_model = load_with_progress(draft, draft_dtype, draft_weights, device)[0] if draft else None
    return target_model, tokenizer, draft_model


def load_prompts(dataset: str) -> list:
    """A dataset's prompts, read before any model loads: an unknown name or a dataset package that is not
    installed (the bench extra) ends the command at once with the reason."""
    from accelgen.datasets import load_dataset

    with reported_errors():
        return load_dataset(dataset)


def format_options(options: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in options.items()) or "-"


def target_weights_for(methods: list[str], model: str, weights: Optional[str], dtype: Optional[str],
                       device: Optional[str] = None, threads: Optional[int] = None) -> Optional[str]:
    """The weight format to load an embedded target in for these methods: weights itself, except where the load
    would give the GGUF file on llama.cpp (no --weights and no --dtype, or "auto" measuring it fastest) and a
    method reads the target's hidden states or walks its layers, which llama.cpp gives no access to: then the
    fastest PyTorch format the weights probe measured (bf16 before any probe), said on stderr."""
    from accelgen.drafters.draft_tree import runs_on_cpu
    from accelgen.models import EMBEDDED_MODELS
    from accelgen.models.probe import cached_choice, choose_weights, decide
    from accelgen.registry import get_method

    needing = [name for name in methods if get_method(name).reads_target_hidden or get_method(name).runner]
    if not needing or model not in EMBEDDED_MODELS or dtype is not None or not runs_on_cpu(device) \
            or weights not in (None, "auto"):
        return weights
    probed = choose_weights(model, threads=threads) if weights == "auto" else cached_choice(model, threads)
    if probed is not None and probed["weights"] != "gguf":
        return weights
    pytorch = {fmt: timing for fmt, timing in (probed or {}).get("timings", {}).items() if fmt != "gguf"}
    chosen = decide(pytorch)["weights"] if pytorch else "bf16"
    why = "the fastest PyTorch format measured here" if pytorch else "no PyTorch format measured here yet"
    print(f"accelgen: {model} loads as weights={chosen} ({why}): {', '.join(needing)} "
          f"{'reads' if len(needing) == 1 else 'read'} the target's hidden states, which the GGUF file on llama.cpp "
          f"does not give; pass --weights to choose", file=sys.stderr)
    return chosen

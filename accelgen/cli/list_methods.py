"""`accelgen methods`: the registered methods as a table, JSON, or the Markdown table of docs/methods.md."""

from __future__ import annotations

import json

import typer
from rich.table import Table

from accelgen.cli.common import format_options, table_console


def methods(
    as_json: bool = typer.Option(False, "--json", help="Print the methods as JSON."),
    markdown: bool = typer.Option(False, "--markdown", help="The Markdown table of docs/methods.md."),
):
    """List the registered methods: family, what they need, lossless class, options, paper."""
    import accelgen

    specs = accelgen.list_methods()
    if as_json:
        print(json.dumps([{"name": s.name, "family": s.family, "lossless": s.lossless, "can_sample": s.can_sample,
                           "needs": list(s.needs),
                           "options": s.options, "paper": s.paper, "summary": s.summary} for s in specs], indent=1))
        return
    if markdown:
        print(methods_markdown(specs))
        return
    table = Table("method", "family", "lossless", "needs", "options", "paper")
    for s in specs:
        table.add_row(s.name, s.family, lossless_label(s), ", ".join(s.needs) or "-", format_options(s.options), s.paper)
    table_console().print(table)


def lossless_label(spec) -> str:
    return spec.lossless + (" (greedy only)" if spec.greedy_only else "")


def methods_markdown(specs) -> str:
    rows = ["| method | family | lossless class | needs | options | what it does | paper |", "|---|---|---|---|---|---|---|"]
    for s in specs:
        options = format_options(s.options).replace("|", "\\|")
        rows.append(f"| `{s.name}` | {s.family} | {lossless_label(s)} | {', '.join(s.needs) or '-'} | {options} | {s.summary} | {s.paper} |")
    return "\n".join(rows)

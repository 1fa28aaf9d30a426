"""`accelgen serve` and `accelgen loadtest`, registered onto the main typer app."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from accelgen.models.loading import DRAFT_WEIGHTS_HELP, WEIGHTS_HELP

console = Console(stderr=True)


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)
    app.command("loadtest")(loadtest)


def serve(
    model: str = typer.Option("smollm2-135m", "--model", "-m", help="Embedded name, HF id, local folder or .gguf file."),
    draft: Optional[str] = typer.Option(None, "--draft", "-d", help="Draft model, for methods that need one."),
    method: str = typer.Option("autoregressive", "--method", help="Default method of requests."),
    allow_methods: str = typer.Option("", "--allow-methods",
                                      help="Other methods requests may pick with the body field `method`, comma-separated."),
    option: list[str] = typer.Option([], "--option", "-o", help="Method option method.name=value (repeatable)."),
    host: str = typer.Option("127.0.0.1", help="Interface to bind (127.0.0.1: this machine only)."),
    port: int = typer.Option(8000, min=1, max=65535),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="ACCELGEN_API_KEY",
                                          help="Require Authorization: Bearer <key> (or set ACCELGEN_API_KEY)."),
    max_batch: int = typer.Option(8, "--max-batch", help="Sequences per batched forward."),
    token_budget: Optional[int] = typer.Option(
        None, "--token-budget", help="Cap drafts at budget // batch size - 1 tokens (0: no cap) instead of choosing "
                                     "each step's draft length by measured goodput."),
    max_draft: int = typer.Option(8, "--max-draft", help="Longest draft the goodput policy may choose."),
    prefill_chunk: int = typer.Option(256, "--prefill-chunk", help="Prompt tokens fed per step (0: whole prompts)."),
    max_concurrent: int = typer.Option(64, "--max-concurrent", help="Requests waiting or running; more get 429."),
    max_prompt_tokens: int = typer.Option(4096, "--max-prompt-tokens"),
    max_tokens: int = typer.Option(1024, "--max-tokens", help="Largest max_tokens a request may ask for."),
    shutdown_grace: float = typer.Option(30.0, "--shutdown-grace", min=0,
                                         help="Seconds requests in flight may take to finish on shutdown; then "
                                              "they are aborted and answered (finish_reason \"abort\")."),
    dtype: Optional[str] = typer.Option(None, help="float32, bfloat16 or float16 (default: bfloat16 for embedded models)."),
    draft_dtype: Optional[str] = typer.Option(None, "--draft-dtype"),
    weights: Optional[str] = typer.Option(None, "--weights", help=WEIGHTS_HELP),
    draft_weights: Optional[str] = typer.Option(None, "--draft-weights", help=DRAFT_WEIGHTS_HELP),
    threads: Optional[int] = typer.Option(None, min=1, help="torch CPU threads."),
    log_level: str = typer.Option("info", "--log-level", help="uvicorn's: info logs every request, warning does not."),
):
    """Serve an OpenAI-compatible API (/v1/completions, /v1/chat/completions, /metrics) with continuous batching."""
    # a batch's shapes change every step, and oneDNN keeps a compiled kernel per shape (1024 by default): cap
    # that cache, or a long-running server's memory creeps up (set before the first matmul to take effect)
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "64")
    if api_key == "":  # before the model loads
        console.print("[red]error:[/red] an empty --api-key would turn authentication off; to serve without a key, "
                      "leave out --api-key (and ACCELGEN_API_KEY)")
        raise typer.Exit(2)
    import torch

    import accelgen
    from accelgen.bench.cli import parse_method_options, split_list
    from accelgen.cli import load_with_progress
    from accelgen.server.app import ServerConfig, create_app, run
    from accelgen.server.engine import Engine
    from accelgen.server.speculation import Goodput, TokenBudget, policy_calibration

    if threads:
        torch.set_num_threads(threads)
    methods = [method] + [name for name in split_list(allow_methods) or [] if name != method]
    try:
        options = parse_method_options(option)
        unserved = sorted(set(options) - set(methods))
        if unserved:
            raise ValueError(f"options given for {', '.join(unserved)}, which this server does not serve ({', '.join(methods)})")
        options = {name: accelgen.get_method(name).check_options(options.get(name, {})) for name in methods}
        target_model, tokenizer = load_with_progress(model, dtype, weights)
        draft_model = load_with_progress(draft, draft_dtype, draft_weights)[0] if draft else None
        config = ServerConfig(model_name=model, model=target_model, tokenizer=tokenizer, draft_model=draft_model,
                              method=method, methods=options, api_key=api_key, max_prompt_tokens=max_prompt_tokens,
                              max_tokens=max_tokens, max_concurrent=max_concurrent, shutdown_grace_seconds=shutdown_grace)
        if token_budget is not None:
            speculation = TokenBudget(token_budget)
        else:
            calibration = policy_calibration(target_model, draft_model, max_batch, max_draft)
            speculation = Goodput(max_draft=max_draft, calibration=calibration)  # runs on the engine's thread
        engine = Engine(max_batch=max_batch, prefill_chunk=prefill_chunk, speculation=speculation)
        server_app = create_app(config, engine)
    except (ValueError, TypeError, FileNotFoundError, RuntimeError) as error:
        console.print(f"[red]error:[/red] {error}")
        raise typer.Exit(2)
    console.print(f"serving {model} on http://{host}:{port}/v1 — methods: {', '.join(methods)}")
    run(server_app, host=host, port=port, log_level=log_level)  # on Ctrl-C or SIGTERM: see run()


def loadtest(
    url: Optional[str] = typer.Option(None, help="A running server (loopback only); default: start one with --model."),
    model: str = typer.Option("smollm2-135m", "--model", "-m", help="Model of the server started here."),
    draft: Optional[str] = typer.Option(None, "--draft", "-d"),
    methods: str = typer.Option("autoregressive", help="Methods to compare, comma-separated (each gets equal time)."),
    serve_option: list[str] = typer.Option([], "--serve-option", help="Extra `accelgen serve` argument (repeatable), "
                                                                         "e.g. --serve-option=--max-batch=16."),
    clients: int = typer.Option(32, help="Concurrent streaming clients."),
    duration: float = typer.Option(300.0, help="Seconds of load in all."),
    rounds: int = typer.Option(1, help="Rounds: every method runs once per round, in turn."),
    dataset: str = typer.Option("sharegpt", help="Prompts (sent as chat messages)."),
    limit: int = typer.Option(200, help="Distinct prompts to cycle through."),
    max_tokens: int = typer.Option(64, "--max-tokens"),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="ACCELGEN_API_KEY"),
    out: Path = typer.Option(Path("results/loadtest"), help="Folder for loadtest.json and report.md."),
):
    """Load-test a server with concurrent streaming clients: throughput, latency percentiles, τ, memory."""
    import asyncio

    from accelgen.datasets import load_dataset
    from accelgen.server.loadtest import run_load, save

    method_list = [name.strip() for name in methods.split(",") if name.strip()]
    if clients < 1 or duration <= 0 or rounds < 1 or not method_list:
        raise typer.BadParameter("--clients and --rounds must be >= 1, --duration > 0, --methods not empty")
    try:
        prompts = [prompt.text for prompt in load_dataset(dataset, limit=limit)]
    except (ValueError, FileNotFoundError) as error:
        raise typer.BadParameter(str(error), param_hint="--dataset") from None
    config = {"clients": clients, "duration": duration, "rounds": rounds, "methods": method_list, "dataset": dataset,
              "max_tokens": max_tokens}

    def show(round_index, method, sample, outcomes):
        errors = sum(o.error is not None for o in outcomes)
        counter = "accelgen:generation_tokens_total"
        tokens = sample["after"].get(counter, 0) - sample["before"].get(counter, 0)
        console.print(f"round {round_index + 1}/{rounds} {method}: {len(outcomes)} requests, {errors} errors, "
                      f"{tokens / sample['seconds']:.1f} tokens/s")

    with contextlib.ExitStack() as stack:
        if url is None:
            command = ["serve", "--model", model, "--method", method_list[0], "--max-concurrent", str(clients + 8),
                       "--log-level", "warning"]
            command += (["--draft", draft] if draft else []) + (["--allow-methods", methods] if len(method_list) > 1 else [])
            url, server_command, _ = stack.enter_context(started_server(command + list(serve_option)))
            config["server"] = "accelgen " + " ".join(server_command)
        else:
            config["server"] = url
        try:
            result = asyncio.run(run_load(url, prompts, method_list, clients, duration, rounds, max_tokens, api_key, show))
        except ValueError as error:
            console.print(f"[red]error:[/red] {error}")
            raise typer.Exit(2)
    save(result, out, config)
    print((out / "report.md").read_text())


@contextlib.contextmanager
def started_server(arguments: list[str]):
    """Run `accelgen serve` on a free loopback port until the block ends (then SIGTERM); yields
    (url, arguments, the server's process)."""
    import socket
    import time

    import httpx

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    arguments = arguments + ["--port", str(port)]
    process = subprocess.Popen([sys.executable, "-m", "accelgen.cli", *arguments])
    url = f"http://127.0.0.1:{port}"
    try:
        with console.status("starting the server …"):
            while True:
                if process.poll() is not None:
                    raise typer.Exit(2)
                try:
                    if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    time.sleep(0.5)
        yield url, arguments, process
    finally:
        process.terminate()  # no-op when the block already stopped it
        process.wait(timeout=60)

"""`accelgen loadtest`: concurrent streaming clients against a server (one started here, or one on this machine),
and `started_server`, which runs `accelgen serve` in a process of its own."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from pathlib import Path
from typing import Optional

import typer

from accelgen.cli.common import console, reported_errors
from accelgen.method_options import split_list


def loadtest(
    url: Optional[str] = typer.Option(None, help="A running server (loopback only); default: start one with --model."),
    model: str = typer.Option("smollm2-135m", "--model", "-m", help="Model of the server started here."),
    draft: Optional[str] = typer.Option(None, "--draft", "-d", help="Draft model of the server started here."),
    methods: str = typer.Option("autoregressive", help="Methods to compare, comma-separated (each gets equal time)."),
    serve_option: list[str] = typer.Option([], "--serve-option", help="Extra `accelgen serve` argument (repeatable), "
                                                                         "e.g. --serve-option=--max-batch=16."),
    clients: int = typer.Option(32, help="Concurrent streaming clients."),
    duration: float = typer.Option(300.0, help="Seconds of load in all."),
    rounds: int = typer.Option(1, help="Rounds: every method runs once per round, in turn."),
    dataset: str = typer.Option("sharegpt", help="Prompts (sent as chat messages)."),
    limit: int = typer.Option(200, help="Distinct prompts to cycle through."),
    max_tokens: int = typer.Option(64, "--max-tokens", help="max_tokens of every request."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="ACCELGEN_API_KEY",
                                          help="The server's key (or set ACCELGEN_API_KEY)."),
    out: Path = typer.Option(Path("results/loadtest"), help="Folder for loadtest.json and report.md."),
):
    """Load-test a server with concurrent streaming clients: throughput, latency percentiles, τ, memory."""
    import asyncio

    from accelgen.datasets import load_dataset
    from accelgen.server.loadtest import run_load, save

    method_list = split_list(methods) or []
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
        with reported_errors():
            result = asyncio.run(run_load(url, prompts, method_list, clients, duration, rounds, max_tokens, api_key, show))
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
    process = subprocess.Popen([sys.executable, "-m", "accelgen", *arguments])
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

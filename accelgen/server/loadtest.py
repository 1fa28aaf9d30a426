"""A bounded load test of a running accelgen server, over loopback only.

`clients` concurrent streaming clients send dataset prompts for `duration` seconds. With several methods,
the run is split into rounds (every method once per round, in turn), so that each method sees the same
machine state: throughputs are compared within one run, never across runs. /metrics is sampled as it goes
for the server's memory and τ.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import urlparse

import httpx
import numpy as np

from accelgen.atomic import write_json_atomically, write_text_atomically

LOOPBACK = {"127.0.0.1", "localhost", "::1"}


@dataclass
class Outcome:
    method: str
    round: int
    started: float  # seconds since the start of the run
    seconds: float
    first_token_seconds: float | None
    tokens: int
    error: str | None = None
    finish_reason: str | None = None  # None when the stream ended without one (or the client hung up first)


def check_loopback(url: str) -> None:
    host = urlparse(url).hostname
    if host not in LOOPBACK:
        raise ValueError(f"the load test only targets this machine (127.0.0.1 / localhost), not {host!r}")


async def one_request(client: httpx.AsyncClient, url: str, body: dict, method: str, round_index: int, t0: float,
                      hang_up_after: int | None = None) -> Outcome:
    """One streaming chat request; hang_up_after: disconnect after that many events (a client that leaves)."""
    started = time.perf_counter()
    first, tokens, error, finish_reason, events = None, 0, None, None, 0
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body | {"method": method}) as response:
            if response.status_code != 200:
                error = f"HTTP {response.status_code}: {(await response.aread()).decode()[:200]}"
            else:
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    payload = json.loads(line.removeprefix("data: "))
                    if "error" in payload:
                        error = payload["error"]["message"]
                    elif payload.get("usage"):
                        tokens = payload["usage"]["completion_tokens"]
                    elif payload["choices"]:
                        choice = payload["choices"][0]
                        finish_reason = choice["finish_reason"] or finish_reason
                        if first is None and choice["delta"].get("content"):
                            first = time.perf_counter() - started
                    events += 1
                    if hang_up_after is not None and events >= hang_up_after:
                        break  # leaving the block closes the connection
    except httpx.HTTPError as exception:
        error = f"{type(exception).__name__}: {exception}"
    return Outcome(method, round_index, started - t0, time.perf_counter() - started, first, tokens, error, finish_reason)


async def scrape(client: httpx.AsyncClient, url: str) -> dict[str, float]:
    text = (await client.get(f"{url}/metrics")).text
    return {line.split("{")[0]: float(line.split()[-1]) for line in text.splitlines() if line and not line.startswith("#")}


async def run_load(url: str, prompts: list[str], methods: list[str], clients: int, duration: float, rounds: int,
                   max_tokens: int, api_key: str | None = None, progress=None, memory_every: float = 5.0) -> dict:
    """Run the load; returns per-method summaries, every request's outcome and the /metrics samples."""
    check_loopback(url)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    phase_seconds = duration / (rounds * len(methods))
    outcomes: list[Outcome] = []
    samples: list[dict] = []
    memory: list[tuple[float, float]] = []  # (seconds since start, resident MiB) every few seconds
    next_prompt = itertools.cycle(prompts)
    limits = httpx.Limits(max_connections=clients + 2)
    async with httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(600.0), limits=limits) as client:
        t0 = time.perf_counter()

        async def watch_memory():
            while True:
                resident = (await scrape(client, url)).get("accelgen_process_resident_bytes")
                if resident:
                    memory.append((time.perf_counter() - t0, resident / 2**20))
                await asyncio.sleep(memory_every)

        watcher = asyncio.create_task(watch_memory())
        for round_index in range(rounds):
            for method in methods:
                phase_end = time.perf_counter() + phase_seconds
                before = await scrape(client, url)

                async def worker():
                    while time.perf_counter() < phase_end:
                        body = {"messages": [{"role": "user", "content": next(next_prompt)}], "max_tokens": max_tokens,
                                "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
                        outcomes.append(await one_request(client, url, body, method, round_index, t0))

                phase_start = time.perf_counter()
                await asyncio.gather(*(worker() for _ in range(clients)))
                after = await scrape(client, url)
                samples.append({"method": method, "round": round_index, "seconds": time.perf_counter() - phase_start,
                                "at": time.perf_counter() - t0, "before": before, "after": after})
                if progress is not None:
                    progress(round_index, method, samples[-1], [o for o in outcomes if o.round == round_index and o.method == method])
        watcher.cancel()
    summary = summarize(outcomes, samples, methods)
    if memory:
        summary["memory_mib"] = memory_summary([mib for _, mib in memory])
    return {"summary": summary, "outcomes": [asdict(o) for o in outcomes], "samples": samples, "memory": memory}


def memory_summary(mib: list[float]) -> dict:
    """Resident memory over the run; `growth` compares the last quarter's mean with the second quarter's
    (after warm-up), the figure that shows whether memory stays flat under load."""
    quarter = max(len(mib) // 4, 1)
    settled, last = mib[quarter : 2 * quarter] or mib, mib[-quarter:]
    return {"first": mib[0], "last": mib[-1], "max": max(mib), "samples": len(mib),
            "growth": float(np.mean(last)) - float(np.mean(settled))}


def summarize(outcomes: list[Outcome], samples: list[dict], methods: list[str]) -> dict:
    summary = {}
    for method in methods:
        done = [o for o in outcomes if o.method == method]
        ok = [o for o in done if o.error is None]
        phases = [s for s in samples if s["method"] == method]
        seconds = sum(s["seconds"] for s in phases)
        delta = {key: sum(s["after"].get(key, 0) - s["before"].get(key, 0) for s in phases)
                 for key in ("accelgen_generated_tokens_total", "accelgen_draft_tokens_total",
                             "accelgen_accepted_draft_tokens_total", "accelgen_engine_steps_total",
                             "accelgen_sequence_steps_total", "accelgen_draft_cap_total")}
        latencies = np.array([o.seconds for o in ok]) if ok else np.zeros(1)
        first = np.array([o.first_token_seconds for o in ok if o.first_token_seconds is not None]) if ok else np.zeros(1)
        summary[method] = {
            "requests": len(done),
            "errors": len(done) - len(ok),
            # tokens the server generated during this method's phases (a phase ends when its last request does)
            "tokens_per_second": delta["accelgen_generated_tokens_total"] / seconds if seconds else 0.0,
            "latency_p50": float(np.percentile(latencies, 50)),
            "latency_p99": float(np.percentile(latencies, 99)),
            "first_token_p50": float(np.percentile(first, 50)) if len(first) else None,
            "first_token_p99": float(np.percentile(first, 99)) if len(first) else None,
            "acceptance_rate": (delta["accelgen_accepted_draft_tokens_total"] / delta["accelgen_draft_tokens_total"]
                                if delta["accelgen_draft_tokens_total"] else 0.0),
            "tau": (delta["accelgen_generated_tokens_total"] / delta["accelgen_sequence_steps_total"]
                    if delta["accelgen_sequence_steps_total"] else 0.0),
            "mean_batch_size": (delta["accelgen_sequence_steps_total"] / delta["accelgen_engine_steps_total"]
                                if delta["accelgen_engine_steps_total"] else 0.0),
            "mean_draft_cap": (delta["accelgen_draft_cap_total"] / delta["accelgen_engine_steps_total"]
                               if delta["accelgen_engine_steps_total"] else 0.0),
        }
    return summary


def save(result: dict, out: Path, config: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomically(out / "loadtest.json", {"config": config} | result)
    write_text_atomically(out / "report.md", report_markdown(result["summary"], config) + "\n![throughput and memory](loadtest.png)\n")
    from accelgen.bench.plots import loadtest_plot  # matplotlib: the bench extra

    loadtest_plot(result, config["methods"], out / "loadtest.png")


def report_markdown(summary: dict, config: dict) -> str:
    rows = [f"# Load test: {config['clients']} streaming clients, {config['duration']:.0f} s, "
            f"{config['rounds']} rounds over {', '.join(config['methods'])}", "",
            f"Server: `{config.get('server', '?')}`; prompts: {config['dataset']}, max_tokens {config['max_tokens']}.", "",
            "| method | requests | errors | tokens/s | vs first | latency p50 / p99 (s) | first token p50 / p99 (s) | τ | acceptance | mean batch | mean draft cap |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    methods = [m for m in config["methods"] if m in summary]
    base = summary[methods[0]]["tokens_per_second"] or 1.0
    for method in methods:
        s = summary[method]
        first = (f"{s['first_token_p50']:.2f} / {s['first_token_p99']:.2f}" if s["first_token_p50"] is not None else "-")
        rows.append(f"| {method} | {s['requests']} | {s['errors']} | {s['tokens_per_second']:.1f} | "
                    f"{s['tokens_per_second'] / base:.2f}× | {s['latency_p50']:.2f} / {s['latency_p99']:.2f} | {first} | "
                    f"{s['tau']:.2f} | {s['acceptance_rate']:.2f} | {s['mean_batch_size']:.1f} | {s.get('mean_draft_cap', 0.0):.1f} |")
    if "memory_mib" in summary:
        m = summary["memory_mib"]
        rows += ["", f"Server resident memory ({m['samples']} samples): {m['first']:.0f} MiB at the start, "
                     f"{m['last']:.0f} MiB at the end, {m['max']:.0f} MiB at most; last quarter vs second quarter of "
                     f"the run: {m['growth']:+.0f} MiB."]
    return "\n".join(rows) + "\n"

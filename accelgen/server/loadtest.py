"""A bounded load test of a running accelgen server, over loopback only.

`clients` concurrent streaming clients send dataset prompts for `duration` seconds. With several methods,
the run is split into rounds (every method once per round, in turn), so that each method sees the same
machine state: throughputs are compared within one run, never across runs. /metrics is sampled as it goes
for the server's memory and τ. Each request's time to first token (TTFT) and the gaps between its streamed
chunks (inter-token latency, ITL: a chunk carries every token one step committed, so a speculating server's
gaps are per step) are summarised as percentiles and histograms, in the report and as plots.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from accelgen.atomic import save_figure_atomically, write_json_atomically, write_text_atomically
from accelgen.errors import InputError

LOOPBACK = {"127.0.0.1", "localhost", "::1"}
# histogram bucket edges, seconds (the last bucket is open)
FIRST_TOKEN_EDGES = (0.0, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
INTER_TOKEN_EDGES = (0.0, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
RESIDENT_BYTES = "process_resident_memory_bytes"


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
    inter_token_seconds: list[float] = field(default_factory=list)  # gaps between the chunks that carried text


def check_loopback(url: str) -> None:
    host = urlparse(url).hostname
    if host not in LOOPBACK:
        raise InputError(f"the load test only targets this machine (127.0.0.1 / localhost), not {host!r}")


async def one_request(client: httpx.AsyncClient, url: str, body: dict, method: str, round_index: int, t0: float,
                      hang_up_after: int | None = None) -> Outcome:
    """One streaming chat request; hang_up_after: disconnect after that many events (a client that leaves)."""
    started = time.perf_counter()
    first, tokens, error, finish_reason, events = None, 0, None, None, 0
    text_at: list[float] = []  # when each chunk with text arrived
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
                        if choice["delta"].get("content"):
                            text_at.append(time.perf_counter())
                    events += 1
                    if hang_up_after is not None and events >= hang_up_after:
                        break  # leaving the block closes the connection
    except httpx.HTTPError as exception:
        error = f"{type(exception).__name__}: {exception}"
    first = text_at[0] - started if text_at else None
    return Outcome(method, round_index, started - t0, time.perf_counter() - started, first, tokens, error, finish_reason,
                   [float(gap) for gap in np.diff(text_at)])


async def scrape(client: httpx.AsyncClient, url: str) -> dict[str, float]:
    """The server's counters and gauges by sample name (histogram buckets left out)."""
    text = (await client.get(f"{url}/metrics")).text
    return {sample.name: sample.value for family in text_string_to_metric_families(text) for sample in family.samples
            if "le" not in sample.labels}


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
                resident = (await scrape(client, url)).get(RESIDENT_BYTES)
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
        delta = {key.removeprefix("accelgen:").removesuffix("_total"): sum(s["after"].get(key, 0) - s["before"].get(key, 0)
                                                                            for s in phases)
                 for key in ("accelgen:generation_tokens_total", "accelgen:spec_decode_num_draft_tokens_total",
                             "accelgen:spec_decode_num_accepted_tokens_total", "accelgen:engine_steps_total",
                             "accelgen:spec_decode_num_verify_steps_total", "accelgen:draft_cap_total")}
        latencies = np.array([o.seconds for o in ok]) if ok else np.zeros(1)
        first = np.array([o.first_token_seconds for o in ok if o.first_token_seconds is not None]) if ok else np.zeros(1)
        gaps = np.array([gap for o in ok for gap in o.inter_token_seconds])
        summary[method] = {
            "requests": len(done),
            "errors": len(done) - len(ok),
            # tokens the server generated during this method's phases (a phase ends when its last request does)
            "tokens_per_second": delta["generation_tokens"] / seconds if seconds else 0.0,
            "latency_p50": float(np.percentile(latencies, 50)),
            "latency_p99": float(np.percentile(latencies, 99)),
            "first_token_p50": float(np.percentile(first, 50)) if len(first) else None,
            "first_token_p99": float(np.percentile(first, 99)) if len(first) else None,
            "inter_token_p50": float(np.percentile(gaps, 50)) if len(gaps) else None,
            "inter_token_p99": float(np.percentile(gaps, 99)) if len(gaps) else None,
            "first_token_histogram": histogram(first if ok else [], FIRST_TOKEN_EDGES),
            "inter_token_histogram": histogram(gaps, INTER_TOKEN_EDGES),
            "acceptance_rate": (delta["spec_decode_num_accepted_tokens"] / delta["spec_decode_num_draft_tokens"]
                                if delta["spec_decode_num_draft_tokens"] else 0.0),
            "tau": (delta["generation_tokens"] / delta["spec_decode_num_verify_steps"]
                    if delta["spec_decode_num_verify_steps"] else 0.0),
            "mean_batch_size": (delta["spec_decode_num_verify_steps"] / delta["engine_steps"]
                                if delta["engine_steps"] else 0.0),
            "mean_draft_cap": delta["draft_cap"] / delta["engine_steps"] if delta["engine_steps"] else 0.0,
        }
    return summary


def histogram(values, edges) -> dict:
    """Counts of values per bucket [edges[i], edges[i+1]), the last bucket open: {"edges", "counts"}."""
    bins = np.searchsorted(np.asarray(edges[1:]), np.asarray(values, dtype=float), side="right")
    return {"edges": list(edges), "counts": np.bincount(bins, minlength=len(edges)).astype(int).tolist()}


def save(result: dict, out: Path, config: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomically(out / "loadtest.json", {"config": config} | result)
    write_text_atomically(out / "report.md", report_markdown(result["summary"], config)
                          + "\n![throughput and memory](loadtest.png)\n"
                          + "\n![time to first token and inter-token latency](latency-histograms.png)\n")
    from accelgen.bench.plots import loadtest_plot  # matplotlib: the bench extra

    loadtest_plot(result, config["methods"], out / "loadtest.png")
    latency_plot(result["summary"], [m for m in config["methods"] if m in result["summary"]],
                 out / "latency-histograms.png")


def latency_plot(summary: dict, methods: list[str], path: Path) -> Path:
    """Two panels, TTFT and inter-token latency: each method's share of requests (gaps) per bucket, side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / max(len(methods), 1)
    colours = plt.get_cmap("tab10" if len(methods) <= 10 else "tab20")
    for axis, key, title in ((axes[0], "first_token_histogram", "Time to first token"),
                             (axes[1], "inter_token_histogram", "Inter-token latency (gap between chunks)")):
        edges = summary[methods[0]][key]["edges"] if methods else []
        for i, method in enumerate(methods):
            counts = np.array(summary[method][key]["counts"], dtype=float)
            shares = counts / counts.sum() if counts.sum() else counts
            axis.bar(np.arange(len(counts)) + (i - (len(methods) - 1) / 2) * width, shares, width, label=method,
                     color=colours(i))
        axis.set_xticks(range(len(edges)), bucket_labels(edges), rotation=45, ha="right", fontsize=8)
        axis.set_xlabel("seconds")
        axis.set_ylabel("share")
        axis.set_title(title)
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    save_figure_atomically(fig, path)
    plt.close(fig)
    return path


def bucket_labels(edges) -> list[str]:
    return [f"{low:g}–{high:g}" for low, high in zip(edges, edges[1:])] + [f"≥ {edges[-1]:g}"]


def histogram_table(summary: dict, methods: list[str], key: str, title: str) -> list[str]:
    edges = summary[methods[0]][key]["edges"]
    rows = ["", f"{title} (s): count per bucket", "", "| method | " + " | ".join(bucket_labels(edges)) + " |",
            "|---|" + "---|" * len(edges)]
    return rows + [f"| {m} | " + " | ".join(str(c) for c in summary[m][key]["counts"]) + " |" for m in methods]


def p50_p99(p50: float | None, p99: float | None, digits: int) -> str:
    return "-" if p50 is None else f"{p50:.{digits}f} / {p99:.{digits}f}"


def report_markdown(summary: dict, config: dict) -> str:
    rows = [f"# Load test: {config['clients']} streaming clients, {config['duration']:.0f} s, "
            f"{config['rounds']} rounds over {', '.join(config['methods'])}", "",
            f"Server: `{config.get('server', '?')}`; prompts: {config['dataset']}, max_tokens {config['max_tokens']}.", "",
            "| method | requests | errors | tokens/s | vs first | latency p50 / p99 (s) | first token p50 / p99 (s) | "
            "inter-token p50 / p99 (s) | τ | acceptance | mean batch | mean draft cap |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    methods = [m for m in config["methods"] if m in summary]
    base = summary[methods[0]]["tokens_per_second"] or 1.0
    for method in methods:
        s = summary[method]
        first = p50_p99(s["first_token_p50"], s["first_token_p99"], 2)
        inter = p50_p99(s.get("inter_token_p50"), s.get("inter_token_p99"), 3)
        rows.append(f"| {method} | {s['requests']} | {s['errors']} | {s['tokens_per_second']:.1f} | "
                    f"{s['tokens_per_second'] / base:.2f}× | {s['latency_p50']:.2f} / {s['latency_p99']:.2f} | {first} | "
                    f"{inter} | {s['tau']:.2f} | {s['acceptance_rate']:.2f} | {s['mean_batch_size']:.1f} | "
                    f"{s.get('mean_draft_cap', 0.0):.1f} |")
    for key, title in (("first_token_histogram", "Time to first token"), ("inter_token_histogram", "Inter-token latency")):
        if all(key in summary[m] for m in methods):
            rows += histogram_table(summary, methods, key, title)
    if "memory_mib" in summary:
        m = summary["memory_mib"]
        rows += ["", f"Server resident memory ({m['samples']} samples): {m['first']:.0f} MiB at the start, "
                     f"{m['last']:.0f} MiB at the end, {m['max']:.0f} MiB at most; last quarter vs second quarter of "
                     f"the run: {m['growth']:+.0f} MiB."]
    return "\n".join(rows) + "\n"

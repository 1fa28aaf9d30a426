"""Soak test of `accelgen serve`, over loopback and bounded in time.

`--clients` streaming chat clients send requests for `--duration` seconds, in a fixed rotation of methods,
stop strings, greedy and seeded sampling, and clients that hang up after a few events; then the server gets
one SIGTERM while every client has a request in flight. Recorded: errors, p50/p99 latency, the server's
resident memory every `--memory-every` seconds, and whether every request that was not hung up got a
finish_reason (stop or length, or abort for those the SIGTERM cut short). Writes report.md and soak.json.

    python scripts/soak.py --clients 32 --duration 600 --out benchmarks/soak-smollm2
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import signal
import time
from dataclasses import asdict
from pathlib import Path

import httpx
import numpy as np

from accelgen.atomic import write_json_atomically, write_text_atomically
from accelgen.datasets import load_dataset
from accelgen.cli.loadtest import started_server
from accelgen.server.loadtest import memory_summary, one_request, scrape

STOPS = [["\n\n"], [".", "!"], ["```", "def "], ["the "]]
FINISHED = {"stop", "length", "abort"}
CLEAN_EXIT = (0, -signal.SIGTERM)  # uvicorn raises the signal again once it has shut down cleanly


def planned(index: int, prompts: list[str], methods: list[str], max_tokens: int) -> tuple[dict, str, int | None]:
    """The index-th request: (body, method, events after which the client hangs up or None)."""
    body = {"messages": [{"role": "user", "content": prompts[index % len(prompts)]}], "max_tokens": max_tokens,
            "stream": True, "stream_options": {"include_usage": True}, "temperature": 0}
    if index % 3 == 1:
        body["stop"] = STOPS[index % len(STOPS)]
    if index % 4 == 2:
        body |= {"temperature": 0.7, "seed": index}
    # methods by index // 3, so that every method gets its share of stop strings (index % 3)
    return body, methods[index // 3 % len(methods)], 3 if index % 5 == 4 else None


async def soak(url: str, process, prompts: list[str], methods: list[str], clients: int, duration: float,
               max_tokens: int, memory_every: float) -> dict:
    t0 = time.perf_counter()
    records, memory, indices = [], [], itertools.count()
    closing = False  # set at the SIGTERM: the clients send nothing more

    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=httpx.Limits(max_connections=clients + 4)) as client:
        async def sample_memory():
            resident = (await scrape(client, url)).get("process_resident_memory_bytes")
            if resident:
                memory.append((round(time.perf_counter() - t0, 1), resident / 2**20))

        async def watch_memory():
            while True:
                await sample_memory()
                await asyncio.sleep(memory_every)

        async def client_loop():
            while not closing:
                index = next(indices)
                body, method, hang_up_after = planned(index, prompts, methods, max_tokens)
                outcome = await one_request(client, url, body, method, 0, t0, hang_up_after)
                records.append(asdict(outcome) | {"index": index, "stop": body.get("stop"),
                                                  "sampled": body["temperature"] > 0, "hung_up": hang_up_after is not None})

        watcher = asyncio.create_task(watch_memory())
        loops = [asyncio.create_task(client_loop()) for _ in range(clients)]
        await asyncio.sleep(duration)
        watcher.cancel()
        await sample_memory()
        counters = await scrape(client, url)
        closing = True
        sigterm_at = time.perf_counter() - t0
        process.send_signal(signal.SIGTERM)
        await asyncio.gather(*loops)
        exit_code = await asyncio.to_thread(process.wait, 120)
        exit_seconds = time.perf_counter() - t0 - sigterm_at
    return {"records": records, "memory": memory, "sigterm_at": sigterm_at, "server_exit_code": exit_code,
            "server_exit_seconds": exit_seconds, "server_counters": counters}


def percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def p50_p99(p50: float | None, p99: float | None) -> str:
    return "-" if p50 is None else f"{p50:.2f} / {p99:.2f}"


def summarize(result: dict, methods: list[str]) -> dict:
    records, sigterm_at = result["records"], result["sigterm_at"]
    for r in records:
        r["in_flight_at_sigterm"] = r["started"] + r["seconds"] > sigterm_at
    errors = [r for r in records if r["error"] is not None]
    answered = [r for r in records if r["error"] is None and not r["hung_up"]]
    unfinished = [r for r in answered if r["finish_reason"] not in FINISHED]
    early_aborts = [r for r in answered if r["finish_reason"] == "abort" and not r["in_flight_at_sigterm"]]
    before = [r for r in answered if not r["in_flight_at_sigterm"]]

    def latencies(rows: list[dict]) -> dict:
        seconds = [r["seconds"] for r in rows]
        first = [r["first_token_seconds"] for r in rows if r["first_token_seconds"] is not None]
        return {"requests": len(rows), "latency_p50": percentile(seconds, 50), "latency_p99": percentile(seconds, 99),
                "first_token_p50": percentile(first, 50), "first_token_p99": percentile(first, 99)}

    finish_reasons = {}
    for r in answered:
        finish_reasons[str(r["finish_reason"])] = finish_reasons.get(str(r["finish_reason"]), 0) + 1
    return {
        "requests": len(records), "errors": len(errors), "error_samples": sorted({r["error"] for r in errors})[:5],
        "hung_up": sum(r["hung_up"] for r in records), "answered": len(answered),
        "without_finish_reason": len(unfinished), "aborted_before_sigterm": len(early_aborts),
        "in_flight_at_sigterm": sum(r["in_flight_at_sigterm"] and not r["hung_up"] for r in records),
        "finish_reasons": finish_reasons, "with_stop_strings": sum(r["stop"] is not None for r in records),
        "sampled": sum(r["sampled"] for r in records),
        "latency": latencies(before), "by_method": {m: latencies([r for r in before if r["method"] == m]) for m in methods},
        "memory_mib": memory_summary([mib for _, mib in result["memory"]]) if result["memory"] else None,
        "server_exit_code": result["server_exit_code"], "server_exit_seconds": result["server_exit_seconds"],
    }


def report_markdown(summary: dict, memory: list, config: dict) -> str:
    s, lat = summary, summary["latency"]
    ok = (s["errors"] == 0 and s["without_finish_reason"] == 0 and s["aborted_before_sigterm"] == 0
          and s["server_exit_code"] in CLEAN_EXIT)
    resignalled = (" (uvicorn raises the SIGTERM again after a clean shutdown)"
                   if s["server_exit_code"] == -signal.SIGTERM else "")
    rows = [f"# Soak: {config['clients']} streaming clients, {config['duration']:.0f} s, then SIGTERM", "",
            f"Server: `{config['server']}`; methods {', '.join(config['methods'])}; prompts: {config['dataset']}, "
            f"max_tokens {config['max_tokens']}. Every 3rd request has stop strings, every 4th samples "
            "(temperature 0.7, seeded), every 5th hangs up after 3 events.", "",
            f"**{'PASS' if ok else 'FAIL'}**: {s['requests']} requests, {s['errors']} errors, "
            f"{s['without_finish_reason']} answered without a finish_reason, {s['aborted_before_sigterm']} aborted "
            f"before the SIGTERM; the server exited {s['server_exit_seconds']:.1f} s after the SIGTERM with status "
            f"{s['server_exit_code']}{resignalled}.", "",
            f"- finish reasons: {', '.join(f'{k} {v}' for k, v in sorted(s['finish_reasons'].items()))}; "
            f"{s['hung_up']} hung up by the client; {s['in_flight_at_sigterm']} in flight at the SIGTERM",
            f"- {s['with_stop_strings']} requests with stop strings, {s['sampled']} sampled",
            f"- latency p50 / p99 {p50_p99(lat['latency_p50'], lat['latency_p99'])} s, first token "
            f"{p50_p99(lat['first_token_p50'], lat['first_token_p99'])} s ({lat['requests']} requests answered "
            "before the SIGTERM)", ""]
    if s["error_samples"]:
        rows += ["Errors (samples):", ""] + [f"- `{e}`" for e in s["error_samples"]] + [""]
    rows += ["| method | requests | latency p50 / p99 (s) | first token p50 / p99 (s) |", "|---|---|---|---|"]
    for method, m in s["by_method"].items():
        rows.append(f"| {method} | {m['requests']} | {p50_p99(m['latency_p50'], m['latency_p99'])} | "
                    f"{p50_p99(m['first_token_p50'], m['first_token_p99'])} |")
    if memory:
        m = s["memory_mib"]
        rows += ["", f"Resident memory of the server: {m['first']:.0f} MiB at the start, {m['last']:.0f} MiB at the "
                     f"end, {m['max']:.0f} MiB at most; last quarter vs second quarter: {m['growth']:+.0f} MiB.", "",
                 "| seconds | resident MiB |", "|---|---|"] + [f"| {t:.0f} | {mib:.0f} |" for t, mib in memory]
    return "\n".join(rows) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--methods", default="autoregressive,pld,trie-lookahead")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load before the SIGTERM")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--dataset", default="sharegpt")
    parser.add_argument("--limit", type=int, default=200, help="distinct prompts to cycle through")
    parser.add_argument("--shutdown-grace", type=float, default=5.0, help="the server's --shutdown-grace")
    parser.add_argument("--memory-every", type=float, default=60.0, help="seconds between memory samples")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/soak-smollm2"))
    args = parser.parse_args()
    if args.clients < 1 or args.duration <= 0 or args.memory_every <= 0:
        parser.error("--clients must be >= 1, --duration and --memory-every > 0")
    methods = [name.strip() for name in args.methods.split(",") if name.strip()]
    prompts = [prompt.text for prompt in load_dataset(args.dataset, limit=args.limit)]
    command = ["serve", "--model", args.model, "--method", methods[0], "--allow-methods", ",".join(methods),
               "--max-concurrent", str(args.clients + 8), "--shutdown-grace", str(args.shutdown_grace),
               "--log-level", "warning"]
    config = {"clients": args.clients, "duration": args.duration, "methods": methods, "dataset": args.dataset,
              "max_tokens": args.max_tokens, "server": "accelgen " + " ".join(command)}
    with started_server(command) as (url, _, process):
        result = asyncio.run(soak(url, process, prompts, methods, args.clients, args.duration, args.max_tokens,
                                  args.memory_every))
    summary = summarize(result, methods)
    args.out.mkdir(parents=True, exist_ok=True)
    write_json_atomically(args.out / "soak.json", {"config": config, "summary": summary} | result)
    report = report_markdown(summary, result["memory"], config)
    write_text_atomically(args.out / "report.md", report)
    print(report)


if __name__ == "__main__":
    main()

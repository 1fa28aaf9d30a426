"""Is a seeded request reproducible on a real server? The same seeded chat request sent N times alone, then N times
while other clients keep the server busy, per method; counts the distinct answers.

    python scripts/seeded_repro.py --weights fp32 --out benchmarks/seeded-repro-smollm2/fp32
    python scripts/seeded_repro.py --weights bf16 --out benchmarks/seeded-repro-smollm2/bf16

It starts `accelgen serve` (SmolLM2-135M by default; `speculative` drafts with the model's own GGUF file), sends
the request (temperature 0.9, seed 7) `--n` times one after the other, then `--n` times beside `--clients` threads
that each send unseeded requests of other prompts and methods without pause. A seeded request is run by the server
as if alone (accelgen/server/engine.py), so every answer should be the same, alone and under load, in any dtype.
Writes results.json (every answer) and README.md (the command, the machine, the counts) to --out.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

from accelgen.atomic import write_json_atomically, write_text_atomically

QUESTION = [{"role": "user", "content": "Write a short story about a lighthouse keeper who finds a message in a bottle."}]
BACKGROUND_PROMPTS = ["List five uses of a paperclip.", "Explain recursion to a child.",
                      "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
                      "Translate 'good morning, how are you?' into French and Spanish.",
                      "1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3,", "What is the capital of Australia? Answer briefly."]


def seeded_answer(client: httpx.Client, url: str, model: str, method: str, max_tokens: int, seed: int) -> str:
    body = {"model": model, "messages": QUESTION, "temperature": 0.9, "seed": seed, "max_tokens": max_tokens,
            "method": method}
    reply = client.post(f"{url}/v1/chat/completions", json=body, timeout=600)
    reply.raise_for_status()
    return reply.json()["choices"][0]["message"]["content"]


def background_client(url: str, model: str, methods: list[str], max_tokens: int, index: int,
                      stop: threading.Event, sent: list[int]) -> None:
    """Unseeded requests of other prompts and methods, one after the other, until stop is set."""
    with httpx.Client() as client:
        turn = index
        while not stop.is_set():
            body = {"model": model, "prompt": BACKGROUND_PROMPTS[turn % len(BACKGROUND_PROMPTS)],
                    "temperature": 0.8 if turn % 2 else 0.0, "max_tokens": max_tokens,
                    "method": methods[turn % len(methods)]}
            with contextlib.suppress(httpx.HTTPError):
                client.post(f"{url}/v1/completions", json=body, timeout=600)
                sent[index] += 1
            turn += 1


def answers_beside_load(url: str, model: str, method: str, methods: list[str], args) -> tuple[list[str], int]:
    """args.n seeded answers while args.clients background clients run; and how many requests those sent."""
    stop, sent = threading.Event(), [0] * args.clients
    threads = [threading.Thread(target=background_client, args=(url, model, methods, args.max_tokens, i, stop, sent),
                                daemon=True) for i in range(args.clients)]
    for thread in threads:
        thread.start()
    time.sleep(2.0)  # the batch fills before the first seeded request
    try:
        with httpx.Client() as client:
            answers = [seeded_answer(client, url, model, method, args.max_tokens, args.seed) for _ in range(args.n)]
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=600)
    return answers, sum(sent)


def summary(answers: list[str]) -> dict:
    counts = Counter(answers)
    return {"requests": len(answers), "distinct": len(counts), "most_common_share": counts.most_common(1)[0][1] / len(answers)}


def machine() -> dict:
    import torch

    from accelgen.hardware import describe

    return {**describe(), "torch": torch.__version__}


def readme(record: dict) -> str:
    """The folder's README.md from its results.json record, with the run record benchmarks/ asks for."""
    machine = record["machine"]
    flags = " ".join(machine["flags"]) if isinstance(machine.get("flags"), list) else machine.get("flags", "")
    lines = [f"# Seeded requests on `accelgen serve` ({record['model']}, weights={record['weights']})", "",
             f"The same chat request (temperature 0.9, seed {record['seed']}, {record['max_tokens']} tokens) sent "
             f"{record['n']} times alone, then {record['n']} times beside {record['clients']} clients sending unseeded "
             "requests without pause.", "",
             "| method | alone: requests | alone: distinct answers | under load: requests | under load: distinct "
             "answers | same answer alone and under load | background requests served |",
             "|---|---|---|---|---|---|---|"]
    for method, row in record["methods"].items():
        same = row["alone"]["distinct"] == 1 and row["loaded"]["distinct"] == 1 and \
            row["alone_answers"][0] == row["loaded_answers"][0]
        lines.append(f"| {method} | {row['alone']['requests']} | {row['alone']['distinct']} | "
                     f"{row['loaded']['requests']} | {row['loaded']['distinct']} | {'yes' if same else 'no'} | "
                     f"{row['background_requests']} |")
    lines += ["", "## Run record", "",
              f"- command: `{record['command']}` (it started `{record['server']}`)",
              f"- machine: {machine.get('cpu')}; flags: {flags}; native bf16: {machine.get('native_bf16')}; "
              f"{machine.get('logical_cores')} logical cores; {machine.get('system')}",
              f"- threads: {machine.get('torch_threads')} torch threads",
              f"- torch: {machine.get('torch')} (Python {machine.get('python')})",
              "- shared: yes (other work ran on this machine during the run)",
              "- raw output: `results.json` (every answer, alone and under load, per method)"]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--weights", default="fp32", help="the target's format: fp32 or bf16 (any --weights value)")
    parser.add_argument("--draft-weights", default="gguf", help="the format of the draft (the same model) for speculative")
    parser.add_argument("--methods", default="pld,speculative,auto")
    parser.add_argument("--n", type=int, default=50, help="seeded requests alone, and again under load")
    parser.add_argument("--clients", type=int, default=8, help="background clients during the loaded phase")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--out", type=Path, required=True, help="folder for results.json and README.md")
    args = parser.parse_args()
    methods = [name.strip() for name in args.methods.split(",") if name.strip()]
    from accelgen.cli.loadtest import started_server

    serve = ["serve", "--model", args.model, "--weights", args.weights, "--draft", args.model, "--draft-weights",
             args.draft_weights, "--method", "autoregressive", "--allow-methods", ",".join(methods),
             "--max-batch", str(args.clients + 1), "--log-level", "warning"]
    results = {}
    with started_server(serve) as (url, arguments, _):
        server = "accelgen " + " ".join(arguments[:-2])  # without the port, which changes every run
        for method in methods:
            print(f"{method}: {args.n} seeded requests alone …", file=sys.stderr, flush=True)
            with httpx.Client() as client:
                alone = [seeded_answer(client, url, args.model, method, args.max_tokens, args.seed)
                         for _ in range(args.n)]
            print(f"{method}: {args.n} beside {args.clients} clients …", file=sys.stderr, flush=True)
            loaded, background = answers_beside_load(url, args.model, method, methods, args)
            results[method] = {"alone": summary(alone), "loaded": summary(loaded), "background_requests": background,
                               "alone_answers": alone, "loaded_answers": loaded}
            print(f"{method}: alone {results[method]['alone']}, under load {results[method]['loaded']}",
                  file=sys.stderr, flush=True)
    command = "python scripts/seeded_repro.py " + " ".join(sys.argv[1:])
    described = machine()
    args.out.mkdir(parents=True, exist_ok=True)
    record = {"command": command, "server": server, "machine": described, "shared": True, "model": args.model,
              "weights": args.weights, "n": args.n, "clients": args.clients, "question": QUESTION, "seed": args.seed,
              "max_tokens": args.max_tokens, "methods": results}
    write_json_atomically(args.out / "results.json", record)
    text = readme(record)
    write_text_atomically(args.out / "README.md", text)
    print(text)
    reproducible = all(row["alone"]["distinct"] == 1 and row["loaded"]["distinct"] == 1 for row in results.values())
    return 0 if reproducible else 1


if __name__ == "__main__":
    sys.exit(main())

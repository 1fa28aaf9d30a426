"""Drive an accelgen server through the `openai` client and LangChain, as users do, and check that speculation
changes nothing (accelgen/server/client_checks.py): chat, completions, streaming, n=2 with a seed, logprobs,
response_format json_schema (LangChain's with_structured_output), tools (LangChain's bind_tools), each with the
methods given and with autoregressive. Every call must succeed, JSON must validate against its schema, and every
output must equal autoregressive's.

    pip install -e '.[server,test]' langchain-openai
    python scripts/openai_clients.py                      # starts `accelgen serve` on SmolLM2-135M (fp32)
    python scripts/openai_clients.py --url http://127.0.0.1:8000   # a running server serving all the methods
    python scripts/openai_clients.py --out benchmarks/openai-clients-smollm2

Exits 1 when any check fails.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

from accelgen.atomic import write_json_atomically, write_text_atomically
from accelgen.server.client_checks import BASELINE, report_markdown, run_checks


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a running server (it must allow autoregressive and the methods); default: start one")
    parser.add_argument("--model", default="smollm2-135m", help="the model of the server started here")
    parser.add_argument("--draft", default="smollm2-135m", help="its draft model (speculative needs one)")
    parser.add_argument("--dtype", default="float32", help="float32 keeps greedy ties from flipping between methods")
    parser.add_argument("--methods", default="speculative,pld", help="methods compared with autoregressive")
    parser.add_argument("--serve-option", action="append", default=[], help="extra `accelgen serve` argument")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--api-key", default="unused")
    parser.add_argument("--out", type=Path, help="folder for results.json and report.md")
    args = parser.parse_args()
    methods = [name.strip() for name in args.methods.split(",") if name.strip()]

    with contextlib.ExitStack() as stack:
        if args.url is None:
            from accelgen.cli.loadtest import started_server

            command = ["serve", "--model", args.model, "--draft", args.draft, "--dtype", args.dtype,
                       "--draft-dtype", args.dtype, "--method", BASELINE, "--allow-methods", ",".join(methods),
                       "--log-level", "warning", *args.serve_option]
            url, arguments, _ = stack.enter_context(started_server(command))
            server = "accelgen " + " ".join(arguments[:-2])  # without the port, which changes every run
        else:
            url, server = args.url.rstrip("/"), args.url
        served = args.model if args.url is None else None
        rows = run_checks(f"{url}/v1", served or first_model(url, args.api_key), methods, args.max_tokens, args.api_key,
                          progress=show)
    report = report_markdown(rows, server)
    print(report)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        write_json_atomically(args.out / "results.json", {"server": server, "methods": methods,
                                                         "max_tokens": args.max_tokens, "rows": rows})
        write_text_atomically(args.out / "report.md", report)
    return 0 if all(row["ok"] for row in rows) else 1


def first_model(url: str, api_key: str) -> str:
    import httpx

    return httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {api_key}"}).json()["data"][0]["id"]


def show(row: dict) -> None:
    print(f"{'ok  ' if row['ok'] else 'FAIL'} {row['check']} ({row['method']})"
          + ("" if row["ok"] else f": {row['error']}"), file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())

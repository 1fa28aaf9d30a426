"""Audit a GPU benchmark's token differences afterwards, on the CPU: is each one a bf16 near-tie?

    python scripts/gpu_audit.py RESULTS_FOLDER [--model smollm2-135m] [--dtype bfloat16] [--out audit.json]

A bf16 run on a GPU may part from another at a position where the model's two best next tokens have nearly equal
logits: a forward over several tokens (a padded bucket, a tree) rounds differently from a one-token forward, and
HF's eager kernels differently from a captured graph. For every row of RESULTS_FOLDER/records.jsonl whose tokens
differ from a reference row's on the same prompt (accelgen `autoregressive` for accelgen's methods, and
`hf-greedy` for every row), this finds the first differing position and scores the reference's context there with
the same weights in fp32 on the CPU. It is a near-tie by the benchmark's own definition (accelgen/bench/near_tie.py):
both tokens within TIE_ULPS ulps of the best logit, in the dtype the run decoded in (--dtype); anything further is
reported as a divergence to explain. The prompts are rebuilt exactly as `accelgen bench` built them (run.json).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import accelgen
from accelgen.atomic import write_json_atomically
from accelgen.bench.near_tie import TIE_ULPS, is_near_tie, tie_gap, tie_tolerance
from accelgen.bench.runner import prompt_token_ids
from accelgen.datasets import load_dataset


def first_difference(expected: list[int], got: list[int]) -> int | None:
    return next((i for i, (a, b) in enumerate(zip(expected, got)) if a != b), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16",
                        help="the dtype the GPU run decoded in, whose rounding makes a near-tie")
    parser.add_argument("--out", type=Path, default=None)
    arguments = parser.parse_args()
    dtype = getattr(torch, arguments.dtype)
    run = json.loads((arguments.results / "run.json").read_text())
    config = run["config"]
    records = [json.loads(line) for line in (arguments.results / "records.jsonl").read_text().splitlines()]
    prompts = {prompt.id: prompt for prompt in load_dataset(config["dataset"], limit=config["limit"],
                                                          categories=config.get("categories"))}
    model, tokenizer = accelgen.load_model(arguments.model, dtype="float32")
    by_prompt: dict[str, dict[str, dict]] = {}
    for record in records:
        by_prompt.setdefault(record["prompt_id"], {})[record["method"]] = record
    audits = []
    for prompt_id, rows in sorted(by_prompt.items()):
        prompt_ids = prompt_token_ids(tokenizer, prompts[prompt_id], config["prompt_format"])
        for method, record in sorted(rows.items()):
            references = ["hf-greedy"] + (["autoregressive"] if not method.startswith("hf-") else [])
            for reference in references:
                if reference == method or reference not in rows:
                    continue
                expected = rows[reference]["token_ids"]
                position = first_difference(expected, record["token_ids"])
                if position is None:
                    continue
                with torch.no_grad():
                    logits = model(torch.tensor([prompt_ids + expected[:position]])).logits[0, -1]
                wanted, got = expected[position], record["token_ids"][position]
                audits.append({"prompt_id": prompt_id, "method": method, "reference": reference,
                               "position": position, "reference_token": wanted, "method_token": got,
                               "fp32_gap": tie_gap(logits, wanted, got), "fp32_top1": int(logits.argmax()),
                               "tolerance": tie_tolerance(dtype, float(logits.max())),
                               "near_tie": is_near_tie(logits, wanted, got, dtype)})
    summary = {}
    for audit in audits:
        entry = summary.setdefault(f"{audit['method']} vs {audit['reference']}", {"differ": 0, "near_ties": 0})
        entry["differ"] += 1
        entry["near_ties"] += audit["near_tie"]
    result = {"near_tie": f"both tokens within {TIE_ULPS} ulps of the best logit in {arguments.dtype}",
              "model": arguments.model, "summary": summary, "audits": audits}
    if arguments.out:
        write_json_atomically(arguments.out, result)
    for name, entry in summary.items():
        print(f"{name}: {entry['differ']} differ, {entry['near_ties']} near-ties "
              f"(within {TIE_ULPS} {arguments.dtype} ulps of the best fp32 logit)")
    largest = max((a["fp32_gap"] for a in audits), default=0.0)
    print(f"largest fp32 gap below the best logit at a first difference: {largest:.4f}")


if __name__ == "__main__":
    main()

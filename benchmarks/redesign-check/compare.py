"""Compare two `accelgen bench` runs of the same command, before and after a change: are the tokens identical,
and is each method as fast relative to HF's own greedy decoding (measured in its own run, methods interleaved)?

    python benchmarks/redesign-check/compare.py benchmarks/redesign-check/before benchmarks/redesign-check/after
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

REFERENCE = "hf-greedy"


def records(folder: Path) -> dict[tuple[str, str], dict]:
    """(method, prompt id) -> its record."""
    rows = (json.loads(line) for line in (folder / "records.jsonl").read_text().splitlines() if line.strip())
    return {(row["method"], row["prompt_id"]): row for row in rows}


def speedups(run: dict[tuple[str, str], dict]) -> dict[str, float]:
    """method -> the reference's total seconds over the method's, on the prompts both ran."""
    seconds: dict[str, dict[str, float]] = defaultdict(dict)
    for (method, prompt), row in run.items():
        seconds[method][prompt] = row["seconds"]
    reference = seconds[REFERENCE]
    return {method: sum(reference[p] for p in times) / sum(times.values()) for method, times in seconds.items()}


def main(before_folder: str, after_folder: str) -> str:
    before, after = records(Path(before_folder)), records(Path(after_folder))
    before_speed, after_speed = speedups(before), speedups(after)
    lines = ["| method | identical tokens | speedup vs hf-greedy before | after | after / before |",
             "|---|---|---|---|---|"]
    for method in sorted(before_speed, key=lambda name: (name != REFERENCE, name)):
        prompts = [prompt for m, prompt in before if m == method]
        same = sum(before[method, p]["token_ids"] == after[method, p]["token_ids"] for p in prompts if (method, p) in after)
        lines.append(f"| {method} | {same}/{len(prompts)} | {before_speed[method]:.2f}x | {after_speed[method]:.2f}x | "
                     f"{after_speed[method] / before_speed[method]:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(main(*sys.argv[1:3]))

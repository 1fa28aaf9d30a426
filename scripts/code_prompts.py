"""Code prompts in HumanEval's style that are not HumanEval's: a request to write each of the standard library's
documented functions, from its signature and the first line of its docstring (accelgen/nar/data.py mines them).
Drafters trained on the target's answers to these (`accelgen data regenerate --dataset jsonl:OUT`) never see the
benchmark's own prompts.

    python scripts/code_prompts.py --count 400 --out code_prompts.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
import sysconfig
from pathlib import Path

from accelgen.atomic import write_text_atomically
from accelgen.nar.data import mine_functions


def signature(source: str) -> str:
    """The `def` line(s) of a function's source, up to the colon that ends the signature."""
    lines = [line for line in source.splitlines() if not line.lstrip().startswith("@")]
    header = []
    for line in lines:
        header.append(line.strip())
        if line.rstrip().endswith(":"):
            break
    return " ".join(header).removesuffix(":")


def code_prompt(example) -> dict:
    summary = example.summary[0].lower() + example.summary[1:]
    return {"id": f"{example.path}:{example.name}", "category": "code",
            "turns": [f"Write a Python function `{signature(example.source)}` that does this: {summary}"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    functions = [example for example in mine_functions([Path(sysconfig.get_paths()["stdlib"])])
                 if example.source.lstrip().startswith("def ") and "." not in example.name]  # top-level functions
    random.Random(args.seed).shuffle(functions)
    lines = [json.dumps(code_prompt(example)) for example in functions[:args.count]]
    write_text_atomically(args.out, "\n".join(lines) + "\n")
    print(f"{len(lines)} code prompts (of {len(functions)} documented standard-library functions) → {args.out}")


if __name__ == "__main__":
    main()

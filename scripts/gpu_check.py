"""A quick check of accelgen on a GPU, part of the GPU benchmark (scripts/gpu_bench.sh).

    python scripts/gpu_check.py --tokenizer TOKENIZER_FOLDER [--model MODEL] [--device cuda] [--out FOLDER]
                                [--parts identity,speed,reads]

With --model (a folder or .gguf file accelgen loads) its real weights, else SmolLM2-135M's architecture
(benchmarks/gpu-h200-smollm2/configs) with weights drawn at random on the device:
1. fp32: every method checked is token-identical to `autoregressive` on the dynamic cache, with the static cache
   (CUDA graphs on a GPU);
2. bf16: milliseconds per token of HF `generate` greedy, accelgen `autoregressive` on the dynamic cache (eager)
   and on the static cache (graphs), and `pld`;
3. host reads per target forward, counted (accelgen.host_reads).
(t(k), eager against graphed: scripts/gpu_costs.py.) Prints a table per part and writes check.json. Runs on the CPU too (--device cpu: no graphs), to check the check.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

import accelgen
from accelgen.atomic import write_json_atomically
from accelgen.hardware import timed
from accelgen.host_reads import count_host_reads

CONFIGS = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu-h200-smollm2" / "configs"
PROMPTS = [[1, 504, 3458, 282, 260, 2272, 30, 378, 1112] * 4, [1, 7000, 25, 1640, 8000, 12, 5, 17, 923] * 6]
IDENTITY = [("autoregressive", {}), ("pld", {"draft_budget": "method"}), ("lookahead-decoding", {}),
            ("trie-lookahead", {}), ("jacobi", {}), ("speculative", {"gamma": 4, "self_draft": True}),
            ("specinfer", {"self_draft": True})]


def checked_model(model: str | None, dtype: torch.dtype, device: str):
    if model is not None:
        return accelgen.load_model(model, dtype=dtype, device=device)[0]
    return random_model("smollm2-135m", dtype, device)


def random_model(config_name: str, dtype: torch.dtype, device: str, seed: int = 0):
    config = AutoConfig.for_model(**json.loads((CONFIGS / f"{config_name}.json").read_text()))
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def timed_median(call, device: str, repeats: int = 3) -> float:
    """Median seconds of call() over repeats, after one untimed warm-up."""
    call()
    return statistics.median(timed(device, call)[1] for _ in range(repeats))


def options_for(model, options: dict) -> dict:
    options = dict(options)
    if options.pop("self_draft", False):
        options["draft_model"] = model
    return options


def check_identity(model, tokenizer, new_tokens: int) -> list[dict]:
    rows = []
    for method, options in IDENTITY:
        for index, prompt in enumerate(PROMPTS):
            expected = accelgen.generate(model, tokenizer, prompt, max_new_tokens=new_tokens, cache="dynamic").token_ids
            result = accelgen.generate(model, tokenizer, prompt, method=method, max_new_tokens=new_tokens,
                                       cache="static", **options_for(model, options))
            rows.append({"method": method, "prompt": index, "identical": result.token_ids == expected,
                         "tau": result.stats["mean_accepted_tokens"], "cache": result.stats.get("cache", "dynamic")})
    return rows


def speeds(model, tokenizer, device: str, new_tokens: int) -> dict:
    prompt = PROMPTS[1]
    ids = torch.tensor([prompt], device=device)
    hf = timed_median(lambda: model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                      max_new_tokens=new_tokens, min_new_tokens=new_tokens), device)
    rows = {"hf-greedy": hf}
    for name, method, cache in [("autoregressive (dynamic cache)", "autoregressive", "dynamic"),
                                ("autoregressive (static cache)", "autoregressive", "static"),
                                ("pld (static cache)", "pld", "static")]:
        rows[name] = timed_median(lambda: accelgen.generate(model, tokenizer, prompt, method=method, cache=cache,
                                                     max_new_tokens=new_tokens, eos_ids=set()), device)
    return {name: 1000 * seconds / new_tokens for name, seconds in rows.items()}  # ms per token


def host_reads(model, tokenizer, device: str, new_tokens: int) -> list[dict]:
    rows = []
    for method, options in IDENTITY + [("speculative", {"gamma": 4, "self_draft": True, "temperature": 1.0})]:
        options = options_for(model, options)
        # no EOS: every run decodes all its tokens (a real model may end a token-id prompt at once)
        accelgen.generate(model, tokenizer, PROMPTS[0], method=method, max_new_tokens=8, eos_ids=set(), **options)
        with count_host_reads(device) as reads:
            result = accelgen.generate(model, tokenizer, PROMPTS[0], method=method, max_new_tokens=new_tokens,
                                       eos_ids=set(), **options)
        forwards = result.stats["target_forwards"]
        rows.append({"method": method, "temperature": options.get("temperature", 0.0), "reads": reads.count,
                     "target_forwards": forwards, "reads_per_forward": reads.count / forwards})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, default=Path("results/gpu-check"))
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--model", default=None, help="real weights (default: random weights)")
    parser.add_argument("--parts", default="identity,speed,reads")
    arguments = parser.parse_args()
    device, new_tokens = arguments.device, arguments.new_tokens
    arguments.out.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(arguments.tokenizer)
    report = {"command": " ".join(sys.argv), "torch": torch.__version__, "python": platform.python_version(),
              "transformers": __import__("transformers").__version__, "device": device}
    if device.startswith("cuda"):
        report["gpu"] = torch.cuda.get_device_name()
    print(json.dumps(report), flush=True)
    model = arguments.model

    def fp32():
        return checked_model(model, torch.float32, device)

    def bf16():
        return checked_model(model, torch.bfloat16, device)

    parts = {"identity": ("identity_fp32", lambda: check_identity(fp32(), tokenizer, 48)),
             "speed": ("ms_per_token_bf16", lambda: speeds(bf16(), tokenizer, device, new_tokens)),
             "reads": ("host_reads_bf16", lambda: host_reads(bf16(), tokenizer, device, 48))}
    report["weights"] = "random" if model is None else model
    for name, part in (parts[key] for key in arguments.parts.split(",")):
        started = time.perf_counter()
        try:
            report[name] = part()
        except Exception:
            report[name] = {"error": traceback.format_exc()}
        print(f"== {name} ({time.perf_counter() - started:.1f} s)\n{json.dumps(report[name], indent=1)}", flush=True)
        write_json_atomically(arguments.out / "check.json", report)


if __name__ == "__main__":
    main()

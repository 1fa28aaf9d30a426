"""Forward-cost curves t(k) on a GPU for architectures too large to carry, and the speedups they predict.

    python scripts/gpu_costs.py [--device cuda] [--out FOLDER] [--sizes 1,2,...]

For each committed configuration (benchmarks/gpu-h200-smollm2/configs: Qwen2.5-0.5B, -1.5B and -7B, SmolLM2-135M)
a model is built with weights drawn at random on the device, in bf16 (a forward's cost does not depend on the
weights' values), and one forward over k new tokens after 256 cached positions is timed for each k: eagerly
(HF's forward over a growing cache, `ModelRunner`), as a CUDA graph over the static cache (`StaticRunner`,
compile=False) and compiled by inductor inside that graph (compile=True). Each curve's wall time is recorded too:
the compiled curve's, less the graphed one's, is its compile warm-up. (On the CPU there are no graphs: "graphed" is
the static cache's eager forward.)

Then the speedups these costs PREDICT for the real Qwen2.5-Coder pair, with the τ (tokens per target forward) and
the draft tokens per step that benchmarks/humaneval-qwen1.5b and benchmarks/sharegpt-qwen1.5b measured on the CPU:
    predicted speedup = τ · t_target(1) / (t_target(1 + draft tokens per step) + draft time per step)
where a draft model's time per step is γ · t_draft(1) and a model-free draft's is left out. They are predictions,
not measurements: acceptance is the CPU's (same weights, bf16 vs the CPU's formats), and the loop's own time is
not in them. Writes costs.json (after each model, so a run cut short keeps what it measured), predictions.json
and costs.png.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from accelgen.atomic import save_figure_atomically, write_json_atomically
from accelgen.models.runner import ModelRunner
from accelgen.models.static import StaticRunner
from accelgen.models.timing import batch_forward_seconds, timing_prompt

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "benchmarks" / "gpu-h200-smollm2" / "configs"
MODELS = ("smollm2-135m", "qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b")
MEASURED_TAU = {"humaneval": ROOT / "benchmarks" / "humaneval-qwen1.5b" / "results.json",
                "sharegpt": ROOT / "benchmarks" / "sharegpt-qwen1.5b" / "results.json"}
PREDICTED = ("speculative", "pld", "lookahead-decoding", "trie-lookahead", "specinfer", "jacobi")
CONTEXT = 256


def random_model(name: str, device: str):
    config = AutoConfig.for_model(**json.loads((CONFIGS / f"{name}.json").read_text()))
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()


RUNNERS = {"eager": ModelRunner, "graphed": functools.partial(StaticRunner, compile=False),
           "compiled": functools.partial(StaticRunner, compile=True)}


def cost_curve(model, make_runner, sizes: list[int], repeats: int) -> tuple[dict[int, float], float]:
    """Milliseconds of one forward over k new tokens (all rows' logits) after CONTEXT cached, per k; and the
    curve's wall seconds, warm-up (graph capture, compilation) included."""
    started = time.perf_counter()
    seconds = batch_forward_seconds(model, timing_prompt(model, CONTEXT), 1, sizes, repeats, make_runner=make_runner)
    return {k: 1000 * value for k, value in seconds.items()}, time.perf_counter() - started


def measured_tau(path: Path) -> dict[str, dict]:
    """Per method of PREDICTED in a committed benchmark: τ and draft tokens per target forward, over its records."""
    results = json.loads(path.read_text())
    gamma = results["config"]["options"].get("speculative", {}).get("gamma")
    rows = {}
    for method in PREDICTED:
        records = [record for record in results["records"] if record["method"] == method and record["target_forwards"]]
        if not records:
            continue
        forwards = sum(record["target_forwards"] for record in records)
        rows[method] = {"tau": sum(record["new_tokens"] for record in records) / forwards,
                        "draft_tokens_per_step": sum(record["draft_tokens"] for record in records) / forwards,
                        "gamma": gamma if method == "speculative" else None, "prompts": len(records)}
    return rows


def interpolated(curve: dict[int, float], k: float) -> float:
    sizes = sorted(curve)
    if k <= sizes[0]:
        return curve[sizes[0]]
    for low, high in zip(sizes, sizes[1:]):
        if k <= high:
            return curve[low] + (curve[high] - curve[low]) * (k - low) / (high - low)
    return curve[sizes[-1]] * k / sizes[-1]  # past the widest measured: proportional (pessimistic)


def predictions(costs: dict) -> dict:
    """Predicted speedups of the Qwen2.5-Coder-1.5B target (0.5B draft) over its own plain decoding, per runner."""
    table = {}
    for workload, path in MEASURED_TAU.items():
        for method, measured in measured_tau(path).items():
            for runner in RUNNERS:
                target, draft = costs["qwen2.5-1.5b"][runner], costs["qwen2.5-0.5b"][runner]
                draft_ms = (measured["gamma"] or 0) * draft[1] if method == "speculative" else 0.0
                step_ms = interpolated(target, 1 + measured["draft_tokens_per_step"]) + draft_ms
                table.setdefault(workload, {}).setdefault(method, {"measured_on_cpu": measured})[runner] = {
                    "predicted_speedup": measured["tau"] * target[1] / step_ms, "step_ms": step_ms}
    return table


def plot(costs: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(costs), figsize=(4 * len(costs), 3.6), squeeze=False)
    for axis, (name, curves) in zip(axes[0], costs.items()):
        for runner, curve in curves.items():
            sizes = sorted(curve)
            axis.plot(sizes, [curve[k] / curve[1] for k in sizes], marker="o",
                      label=f"{runner} (t(1) {curve[1]:.2f} ms)")
        axis.set_xscale("log", base=2)
        axis.set_title(name)
        axis.set_xlabel("new tokens k")
        axis.set_ylabel("t(k) / t(1)")
        axis.legend(fontsize=8)
    figure.tight_layout()
    save_figure_atomically(figure, path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, default=Path("results/gpu-costs"))
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--sizes", default="1,2,3,4,6,8,12,16,24,32,48,64")
    parser.add_argument("--repeats", type=int, default=20)
    arguments = parser.parse_args()
    arguments.out.mkdir(parents=True, exist_ok=True)
    sizes = [int(size) for size in arguments.sizes.split(",")]
    costs, wall = {}, {}
    for name in arguments.models.split(","):
        model = random_model(name, arguments.device)
        costs[name], wall[name] = {}, {}
        for runner, make_runner in RUNNERS.items():
            costs[name][runner], wall[name][runner] = cost_curve(model, make_runner, sizes, arguments.repeats)
        print(name, {runner: {k: round(ms, 3) for k, ms in curve.items()} for runner, curve in costs[name].items()},
              "wall s", {runner: round(seconds, 1) for runner, seconds in wall[name].items()}, file=sys.stderr, flush=True)
        write_json_atomically(arguments.out / "costs.json", {"command": " ".join(sys.argv), "context": CONTEXT,
                                                            "device": arguments.device, "ms": costs, "wall_seconds": wall})
        del model
        torch.cuda.empty_cache() if arguments.device.startswith("cuda") else None
    if {"qwen2.5-1.5b", "qwen2.5-0.5b"} <= set(costs):
        write_json_atomically(arguments.out / "predictions.json", predictions(costs))
    plot(costs, arguments.out / "costs.png")


if __name__ == "__main__":
    main()

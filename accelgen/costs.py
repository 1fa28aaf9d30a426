"""Measured costs, and the draft budget that keeps speculation from ever losing to plain decoding.

A draft of γ tokens pays only if the tokens it is expected to add outweigh what it costs: drafting (γ·c, c =
drafting one token over one decoding step) plus verifying γ + 1 tokens instead of 1 (r(γ+1), r(k) = t(k) / t(1)
with t(k) the time of one target forward over k tokens). r(k) decides everything and differs by machine: ≈1.15
at k = 8 where the CPU multiplies bf16 natively, ≈6 on an AVX2-only CPU, and differs again on a GPU. So forward
times are measured once per model, weight format, machine and device (`forward_seconds`, cached as JSON under the
cache folder's `costs/`; a GPU's apart, by the GPU's name, so that a GPU run never reads CPU timings or the
reverse), and `DraftBudget` turns them into each step's draft length: the γ with the best predicted speedup from
r(k), c and the running acceptance α, and 0 — plain decoding — when no length pays. The drafter that a budget
caps is accelgen/drafters/budget.py's.
"""

from __future__ import annotations

import json
import math
import sys
from functools import partial
from pathlib import Path
from typing import Callable

from accelgen import hardware
from accelgen.atomic import write_json_atomically
from accelgen.profile import interpolate
from accelgen.theory import AcceptanceEstimate, best_gamma

SIZES = (1, 2, 3, 4, 6, 8, 12, 16)  # tokens per forward timed; r(k) between and beyond them is interpolated
CONTEXT_TOKENS = 64  # the KV cache the timed forwards run after (short: its prefill is part of the wait)
REPEATS = 2  # timed forwards per size (median), after one warm-up
PRIOR_ALPHA = 0.6  # the acceptance a budget assumes before any draft is verified (worth two verified steps)
MIN_GAIN = 1.02  # a draft must be predicted this much faster than plain decoding (timings are noisy)
PROBE_COST = 0.02  # while no draft pays, probing drafts may cost at most this share of the decoding time
COST_DECAY = 0.8  # how fast the drafting cost c follows each step's timing
MAX_DRAFT = 16  # the longest draft (tokens or tree nodes) of a drafter sized "auto"
SELF_DRAFT_COST = 0.5  # c before it is measured, for drafts by the target's own layers (no model of its own to time)

# (model, batch, sizes) -> {k: seconds of one forward of `batch` sequences of k new tokens each}
Timer = Callable[[object, int, list[int]], dict[int, float]]


# --- measuring and caching -------------------------------------------------------------------------------


def model_format(model) -> str:
    from accelgen.models.formats import weight_format
    from accelgen.models.llamacpp import LlamaCppModel

    return "gguf" if isinstance(model, LlamaCppModel) else weight_format(model)


def model_key(model) -> str:
    """Which model the costs belong to: its name or folder, else its type, and its shape (tiny test models)."""
    config = model.config
    name = Path(str(getattr(model, "name_or_path", "") or getattr(config, "_name_or_path", "") or "")).name
    shape = [getattr(config, key, None) for key in ("vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size")]
    return f"{name or getattr(config, 'model_type', 'model')}-{'x'.join(str(value) for value in shape)}"


def costs_folder() -> Path:
    from accelgen.models.loading import cache_dir

    return cache_dir() / "costs"


def costs_path(model, threads: int | None = None) -> Path:
    """The cache file of this model in its weight format on this machine (CPU, speed flags, threads, torch) and the
    device it runs on: costs/MACHINE/MODEL-FORMAT.json on the CPU, costs/MACHINE/GPU/MODEL-FORMAT.json on a GPU
    (GPU: its name, e.g. cuda-nvidia-h200)."""
    folder = costs_folder() / hardware.machine_key(threads)
    device = hardware.device_key(model_device(model))
    return (folder if device is None else folder / device) / f"{model_key(model)}-{model_format(model)}.json"


def model_device(model):
    """The device the model runs on (a model without one, as some test doubles: the CPU)."""
    return getattr(model, "device", None)


def time_forwards(model, batch: int, sizes: list[int]) -> dict[int, float]:
    """The real Timer: median seconds of one forward of `batch` sequences, k new tokens each after CONTEXT_TOKENS
    cached, per k in sizes; progress on stderr."""
    from accelgen.models.timing import batch_forward_seconds, timing_prompt

    def progress(k: int) -> None:
        print(f" {k}", end="", file=sys.stderr, flush=True)

    device = model_device(model)
    where = "this machine" if hardware.device_key(device) is None else f"{device} ({hardware.device_name(device)})"
    print(f"accelgen: timing forwards of {model_key(model)} ({model_format(model)}) once on {where}, "
          f"{batch} sequence(s) of k tokens, k =", end="", file=sys.stderr, flush=True)
    try:
        return batch_forward_seconds(model, timing_prompt(model, CONTEXT_TOKENS), batch, sizes, REPEATS, progress)
    finally:
        print(file=sys.stderr, flush=True)


def cached_costs(model, threads: int | None = None) -> dict | None:
    """What the cache holds for this model on this machine, or None: {"model", "format", "machine",
    "context_tokens", "seconds": {batch: {k: seconds}}}."""
    path = costs_path(model, threads)
    if not path.is_file():
        return None
    saved = json.loads(path.read_text())
    saved["seconds"] = {int(batch): {int(k): seconds for k, seconds in row.items()}
                        for batch, row in saved.get("seconds", {}).items()}
    return saved


def forward_seconds(model, batch: int = 1, sizes=SIZES, *, threads: int | None = None, remeasure: bool = False,
                    timer: Timer | None = None) -> dict[int, float]:
    """{k: seconds} of one forward of `batch` sequences of k tokens each, for k in sizes (and 1), plus any other
    size cached: measured once per model, weight format and machine, then read from the cache. Sizes not cached
    yet are measured (with k = 1 again, so that ratios come from one measurement) and added.
    remeasure: forget this model's cached timings first. timer: the measurement (default: time_forwards; tests
    pass fake ones)."""
    cached = None if remeasure else cached_costs(model, threads)
    table = {} if cached is None else cached["seconds"]
    known = table.get(batch, {})
    missing = sorted(set(sizes) - set(known))
    if missing or 1 not in known:
        known = {**known, **(timer or time_forwards)(model, batch, sorted(set(missing) | {1}))}
        table[batch] = known
        save_costs(costs_path(model, threads), {"model": model_key(model), "format": model_format(model),
                                                "machine": hardware.describe(threads),
                                                "device": hardware.describe_device(model_device(model)),
                                                "context_tokens": CONTEXT_TOKENS, "seconds": table})
    return dict(sorted(known.items()))


def save_costs(path: Path, costs: dict) -> None:
    """Write atomically (a temporary file renamed over the old one): a reader never sees half a file."""
    write_json_atomically(path, costs)


def verify_ratios(model, **measuring) -> dict[int, float]:
    """The model's r(k) = t(k) / t(1), measured once per model, weight format and machine (see forward_seconds)."""
    seconds = forward_seconds(model, **measuring)
    return {k: t / seconds[1] for k, t in seconds.items()}


def draft_cost_ratio(target_model, draft_model, **measuring) -> float:
    """c: one forward of the draft model over one token, over one of the target (both measured once, cached)."""
    return forward_seconds(draft_model, sizes=(1,), **measuring)[1] / forward_seconds(target_model, **measuring)[1]


# --- the policy ------------------------------------------------------------------------------------------


def probe_interval(extra_cost: float) -> int:
    """Steps between probing drafts of one token while no draft pays: a rejected probe costs extra_cost decoding
    steps more than a plain step (c + r(2) − 1), so probing every this many steps costs at most PROBE_COST."""
    return max(1, math.ceil(extra_cost / PROBE_COST))


class DraftBudget:
    """Each step's longest worthwhile draft, from measured costs; 0 (plain decoding) when no length pays.

    The length is the γ ≤ max_length with the best predicted speedup E(α, γ) / (γc + r(γ+1)) (theory.best_gamma,
    at least MIN_GAIN), from
    - r(k): the target's, measured once per machine (verify_ratios);
    - c: drafting time per drafted token over one decoding step: for a draft model, measured once, then faded
      towards each typical step's timing (`observe`); model-free drafts are taken to cost nothing (c = 0);
    - α: AcceptanceEstimate from PRIOR_ALPHA, then each verified draft.
    While no length pays, every probe_interval-th step drafts one token anyway (costing at most PROBE_COST of
    the decoding time), so α keeps being measured and drafting resumes where the text becomes easy to draft;
    unless no length would pay even with every token accepted (`could_pay`): then it never drafts.

    fixed_nodes: nodes every draft carries besides its γ tokens, that are verified but not drafted to be
    accepted (lookahead decoding's window): a step verifies γ + fixed_nodes + 1 tokens, and its limit includes
    them.
    """

    def __init__(self, verify_ratio: dict[int, float], cost_ratio: float = 0.0, max_length: int = MAX_DRAFT, *,
                 learn_cost: bool = True, fixed_nodes: int = 0, prior_alpha: float = PRIOR_ALPHA, device=None):
        self.device = device  # where the drafts and the target run: their timings wait for it (hardware.synchronize)
        self.verify_ratio = partial(interpolate, verify_ratio)  # tokens per forward -> r
        self.longest_measured = max(verify_ratio)  # tokens per forward; r(k) beyond it is extrapolated
        self.cost_ratio = cost_ratio
        self.learn_cost = learn_cost
        self.max_length = max_length
        self.fixed_nodes = fixed_nodes
        self.acceptance = AcceptanceEstimate.starting_at(prior_alpha)
        self.plain_steps = 0  # consecutive steps without a draft

    def step_ratio(self, length: int) -> float:
        """r of the forward that verifies a draft of `length` tokens (and the fixed nodes)."""
        return self.verify_ratio(length + self.fixed_nodes)

    def limit(self) -> int:
        """This step's draft length, fixed nodes included (call once per step)."""
        length = best_gamma(self.acceptance.alpha, self.cost_ratio, self.max_length, self.step_ratio, MIN_GAIN)
        if length == 0 and self.max_length > 0:
            self.plain_steps += 1
            if self.plain_steps < probe_interval(self.cost_ratio + self.step_ratio(2) - 1) or not self.could_pay():
                return 0
            length = 1
        self.plain_steps = 0
        return length + self.fixed_nodes if length else 0

    def could_pay(self) -> bool:
        """Whether some draft length would pay were every drafted token accepted, judged only where r(k) was
        measured (an extrapolated r of a 32-token forward is no evidence). If none would (verifying costs about a
        forward per token, or drafting is dear), no probe is made: α cannot change the answer, and a draft model
        would first have to read every token it missed."""
        measured_length = min(self.max_length, self.longest_measured - 1 - self.fixed_nodes)
        return best_gamma(1.0, self.cost_ratio, measured_length, self.step_ratio, MIN_GAIN) > 0

    def observe(self, drafted: int, accepted: int, draft_seconds: float | None = None,
                step_seconds: float | None = None) -> None:
        """A verified step: `drafted` nodes proposed in draft_seconds, `accepted` of them, after a target forward
        over drafted + 1 tokens and verification taking step_seconds (timings None: an untypical step, whose
        drafting also read a prompt or tokens missed while not drafting). A step without a draft is ignored."""
        tokens = max(drafted - self.fixed_nodes, accepted)  # the nodes drafted to be accepted
        if tokens == 0:
            return
        self.acceptance.observe(tokens, accepted)
        if self.learn_cost and draft_seconds is not None and step_seconds:
            decoding_step = step_seconds / self.verify_ratio(drafted + 1)
            observed = draft_seconds / tokens / decoding_step
            self.cost_ratio = COST_DECAY * self.cost_ratio + (1 - COST_DECAY) * observed


def measured_budget(target_model, draft_model=None, max_length: int = MAX_DRAFT, cost_ratio: float | None = None,
                    fixed_nodes: int = 0) -> DraftBudget:
    """A DraftBudget over the target's measured r(k), with c from cost_ratio if given, else measured from the draft
    model (both then following the steps' timings), else 0: model-free drafts, taken to cost nothing."""
    drafts_with_model = cost_ratio is not None or draft_model is not None
    if cost_ratio is None:
        cost_ratio = 0.0 if draft_model is None else draft_cost_ratio(target_model, draft_model)
    return DraftBudget(verify_ratios(target_model), cost_ratio, max_length, learn_cost=drafts_with_model,
                       fixed_nodes=fixed_nodes, device=model_device(target_model))


def cached_profile(target_model, draft_model=None, batch_sizes=(), *, threads: int | None = None,
                   remeasure: bool = False, timer: Timer | None = None) -> dict:
    """The costs the policies use, as `accelgen.profile.profile` reports them (target_seconds, verify_ratio;
    with a draft model draft_seconds and cost_ratio; batch_seconds per batch size): from the cache, measured
    once where absent (remeasure: again)."""
    target_seconds = forward_seconds(target_model, threads=threads, remeasure=remeasure, timer=timer)
    result = {"context_tokens": CONTEXT_TOKENS, "target_seconds": target_seconds,
              "verify_ratio": {k: t / target_seconds[1] for k, t in target_seconds.items()},
              "cache": str(costs_path(target_model, threads))}
    if batch_sizes:
        result["batch_seconds"] = {batch: forward_seconds(target_model, batch, sorted(target_seconds), threads=threads,
                                                          timer=timer)
                                   for batch in sorted(set(batch_sizes))}
    if draft_model is not None:
        result["draft_seconds"] = forward_seconds(draft_model, sizes=(1,), threads=threads, remeasure=remeasure,
                                                  timer=timer)[1]
        result["cost_ratio"] = result["draft_seconds"] / target_seconds[1]
    return result

"""`auto`: the method, and its γ or tree options, that a short calibration on this machine found fastest for
this target, draft model and workload (Decoding Speculative Decoding, Yan et al. 2024: what pays depends on
the measured α, c and r(k), so measure rather than guess).

`accelgen tune auto --model M [--draft D] --dataset humaneval` times every candidate (`candidates`, plain
decoding among them) on a few prompts of the workload and saves the fastest beside the target's weights,
keyed by draft model and workload. `auto` then delegates to that method, its drafts capped each step by the
measured budget (accelgen/costs.py), so that they never cost more than they are predicted to return.

Before any calibration it chooses from the costs measured once per model, weight format and machine: at a
prior acceptance α = PRIOR_ALPHA, draft-model speculation (γ then chosen each step, gamma_schedule="cost") if
some γ is predicted to pay with the measured draft cost c and verification cost r(k); without a draft model, for a
target with an EAGLE head shipped for it (heads/shipping.py), drafting with that head (at its recorded held-out
top-1 as the acceptance, and its draft step's c timed here); without one, for a bf16/fp32 target, drafting with
its own quantized copy (`qspec`, at a prior acceptance SELF_DRAFT_PRIOR_ALPHA and the copy's measured c); else
prompt lookup, whose drafts cost nothing, if some length pays with r(k) alone; else
plain decoding (`autoregressive`). Every
candidate is lossless with the default verifier, so `auto` is too. The choice and its reason are reported in
the result's stats.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from accelgen.atomic import write_json_atomically
from accelgen.costs import MIN_GAIN, PRIOR_ALPHA, draft_cost_ratio, forward_seconds, verify_ratios
from accelgen.hardware import timed
from accelgen.heads.eagle import EagleHead
from accelgen.heads.shipping import read_json, shipped_head
from accelgen.models.loading import beside_weights
from accelgen.profile import interpolate
from accelgen.drafters.base import BuildContext
from accelgen.drafters.budget import budgeted
from accelgen.errors import InputError
from accelgen.registry import MethodOptions, MethodSpec, Part, get_method, register
from accelgen.theory import best_gamma, predicted_speedup

PREDICTION_MAX_GAMMA = 16  # the longest draft the uncalibrated choice considers
# the acceptance the uncalibrated choice assumes of the target's own quantized copy (qspec): a 4-bit copy of
# Qwen2.5-Coder-1.5B had 0.93-0.98 of its drafts accepted; the running acceptance then sizes each draft
SELF_DRAFT_PRIOR_ALPHA = 0.9

AUTO_FILE = "auto.json"


def candidates(has_draft: bool, has_head: bool = False) -> list[tuple[str, dict]]:
    """(method, options) pairs a calibration compares; all use the default (lossless) verifier. has_head: an
    EAGLE head ships for the target (the `eagle` candidates use it)."""
    with_draft = [("speculative", {"gamma": gamma}) for gamma in (3, 5, 8)]
    with_draft += [("speculative", {"gamma_schedule": "cost"}), ("specinfer", {}), ("cascade", {})]
    with_head = [("eagle", {}), ("eagle", {"width": 4, "depth": 4, "max_nodes": 16})]
    model_free = [("pld", {}), ("trie-lookahead", {}), ("lookahead-decoding", {}), ("self-speculative", {})]
    return ([("autoregressive", {})] + (with_draft if has_draft else []) + (with_head if has_head else [])
            + model_free)


def draft_key(draft_model) -> str:
    if draft_model is None:
        return "no-draft"
    return Path(getattr(draft_model, "name_or_path", "") or draft_model.config._name_or_path or "draft").name


def load_choice(model, draft_model, workload: str) -> dict | None:
    """The saved choice for this draft model and workload ("" = the latest calibrated one), or None."""
    path = beside_weights(model, AUTO_FILE)
    if path is None or not path.exists():
        return None
    entries = json.loads(path.read_text()).get(draft_key(draft_model), {})
    return entries.get(workload or entries.get("latest", ""))


def save_choice(model, draft_model, workload: str, result: dict) -> Path:
    path = beside_weights(model, AUTO_FILE, saving="the choice")
    saved = json.loads(path.read_text()) if path.exists() else {}
    entries = saved.setdefault(draft_key(draft_model), {})
    entries[workload] = result
    entries["latest"] = workload
    write_json_atomically(path, saved)
    return path


def uncalibrated_choice(target_model, draft_model, tokenizer=None) -> dict:
    """The method the measured costs predict fastest at a prior acceptance: speculation with the draft model, else
    (a bf16/fp32 target) drafting with its own quantized copy (qspec), then prompt lookup, or plain decoding (see
    the module's docstring); with the reason, in numbers. tokenizer: the target's, for writing its GGUF copy."""
    ratio = partial(interpolate, verify_ratios(target_model))  # tokens per forward -> r
    measured = f"verifying 2 tokens costs r(2) = {ratio(2):.2f} decoding steps"
    candidates = [("pld", 0.0, PRIOR_ALPHA, "prompt lookup, whose drafts cost nothing,")]
    if draft_model is not None:
        cost_ratio = draft_cost_ratio(target_model, draft_model)
        measured += f", drafting a token c = {cost_ratio:.2f}"
        candidates.insert(0, ("speculative", cost_ratio, PRIOR_ALPHA, "draft-model speculation"))
    elif (head_folder := shipped_eagle(target_model)) is not None:
        cost_ratio = head_cost_ratio(target_model, EagleHead.load(head_folder, target_model))
        alpha = round(shipped_top1(head_folder), 2)
        measured += f", the shipped EAGLE head's draft step c = {cost_ratio:.2f}"
        candidates.insert(0, ("eagle", cost_ratio, alpha, "drafting with the EAGLE head shipped for this model"))
    elif (quantized_copy := self_draft(target_model, tokenizer)) is not None:
        cost_ratio = draft_cost_ratio(target_model, quantized_copy)
        measured += f", its quantized copy drafting a token c = {cost_ratio:.2f}"
        candidates.insert(0, ("qspec", cost_ratio, SELF_DRAFT_PRIOR_ALPHA, "drafting with its own quantized copy"))
    for method, cost_ratio, alpha, what in candidates:  # the first that pays
        gamma = best_gamma(alpha, cost_ratio, PREDICTION_MAX_GAMMA, ratio, MIN_GAIN)
        if gamma:
            speedup = predicted_speedup(alpha, gamma, cost_ratio, ratio(gamma + 1))
            return {"method": method, "options": {"gamma_schedule": "cost"} if method == "speculative" else {},
                    "reason": f"not calibrated (run `accelgen tune auto`): at a prior acceptance α = {alpha} and "
                              f"the costs measured on this machine ({measured}, r({gamma + 1}) = "
                              f"{ratio(gamma + 1):.2f}), {what} is predicted {speedup:.2f}× plain decoding with "
                              f"γ = {gamma}; its draft length then follows the measured costs each step"}
    return {"method": "autoregressive", "options": {},
            "reason": f"not calibrated (run `accelgen tune auto`): at a prior acceptance α = {PRIOR_ALPHA}, no draft "
                      f"length pays on this machine ({measured}): plain decoding"}


def shipped_eagle(target_model) -> Path | None:
    """The folder of the EAGLE head shipped for this target (heads/shipping.py), or None: none ships for it, or the
    target runs on llama.cpp (which keeps none of the features the head reads)."""
    if not isinstance(target_model, torch.nn.Module):
        return None
    return shipped_head(target_model, "eagle")


@torch.inference_mode()
def head_cost_ratio(target_model, head) -> float:
    """c of an EAGLE head: one draft step (the head's layer over one token and its draft logits), timed here,
    over one forward of the target (measured once, cached)."""
    d = head.config.hidden_size
    device, dtype = head.fc.weight.device, head.fc.weight.dtype
    embeds, hidden = torch.zeros(1, 1, d, device=device, dtype=dtype), torch.zeros(1, 1, d, device=device, dtype=dtype)
    positions = torch.zeros(1, 1, dtype=torch.long, device=device)
    readout = head.vocab_logits if head.target_layers is not None else target_model.get_output_embeddings()

    def step():
        return readout(head(embeds, hidden, positions))

    step()  # the first call pays for one-time set-up
    seconds = min(timed(device, step)[1] for _ in range(5))
    return seconds / forward_seconds(target_model)[1]


def shipped_top1(folder: Path) -> float:
    """The acceptance `auto` assumes of a shipped head: its held-out top-1 at draft depth 1 (its evaluation.json;
    a tree accepts more, so this errs low), PRIOR_ALPHA where it recorded none."""
    return float(read_json(folder / "evaluation.json").get("top1", PRIOR_ALPHA))


def self_draft(target_model, tokenizer=None):
    """The target's own quantized copy (drafters/qspec.py, in the format its quantized="auto" picks), or None where
    qspec does not apply: a target already quantized or on llama.cpp."""
    from accelgen.drafters.qspec import check_target, quantized_copy, resolve_format

    try:
        check_target(target_model)
    except ValueError:
        return None
    return quantized_copy(target_model, tokenizer, resolve_format(target_model, "auto", "auto"), "auto")


class AutoDrafter:
    """The chosen method's drafter (everything delegated, its capabilities included: hence no Drafter base class,
    whose defaults would hide the chosen drafter's own), plus `describe` for the result's stats."""

    def __init__(self, inner, choice: dict):
        self.inner = inner
        self.choice = choice

    def __getattr__(self, name):  # propose, update, draft_steps, close, capabilities: the chosen drafter's own
        return getattr(self.inner, name)

    def describe(self) -> dict:
        return self.choice


@dataclass(frozen=True)
class AutoOptions(MethodOptions):
    workload: str = ""  # the calibrated workload whose choice to use ("": the latest calibrated)


def _make(build: BuildContext, options: AutoOptions) -> AutoDrafter:
    target_model, draft_model, workload = build.target_model, build.draft_model, options.workload
    choice = load_choice(target_model, draft_model, workload)
    if choice is None:
        if workload:
            raise InputError(f"auto: no calibration saved for workload {workload!r} with this draft model; "
                             f"run `accelgen tune auto --dataset {workload}` first")
        choice = uncalibrated_choice(target_model, draft_model, build.tokenizer)
    spec = get_method(choice["method"])
    inner = spec.drafter.make(build, spec.drafter.options.take(spec.check_options(choice["options"])))
    if spec.family != "baseline" and inner.draft_budget is None:  # not yet capped by the costs
        inner = budgeted(inner, target_model, draft_model if spec.needs_draft_model else None)
    return AutoDrafter(inner, {"method": spec.name, "options": choice["options"], "reason": choice["reason"]})


register(
    MethodSpec(
        name="auto",
        family="policy",
        lossless="distribution-exact",
        paper="Yan et al. 2024, arXiv:2402.01528 (the analytical model behind the choice)",
        summary="the method and γ/tree options a short calibration (`accelgen tune auto`) found fastest for this "
                "model pair and workload; uncalibrated: what the costs measured on this machine predict fastest "
                "(cost-adaptive speculation, prompt lookup or plain decoding)",
        drafter=Part(_make, AutoOptions),
    )
)

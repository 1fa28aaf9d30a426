"""`auto`: the method, and its γ or tree options, that a short calibration on this machine found fastest for
this target, draft model and workload (Decoding Speculative Decoding, Yan et al. 2024: what pays depends on
the measured α, c and r(k), so measure rather than guess).

`accelgen tune auto --model M [--draft D] --dataset humaneval` times every candidate (`candidates`) on a few
prompts of the workload and saves the fastest beside the target's weights, keyed by draft model and
workload. `auto` then delegates to that method. Before any calibration it falls back on what needs no
measurement: draft-model speculation with γ chosen per step from running estimates of α and c
(gamma_schedule="cost"), or prompt lookup without a draft model. Every candidate is lossless with the
default verifier, so `auto` is too. The choice and its reason are reported in the result's stats.
"""

from __future__ import annotations

import json
from pathlib import Path

from accelgen.models.loading import beside_weights
from accelgen.registry import MethodSpec, get_method, register

AUTO_FILE = "auto.json"


def candidates(has_draft: bool) -> list[tuple[str, dict]]:
    """(method, options) pairs a calibration compares; all use the default (lossless) verifier."""
    with_draft = [("speculative", {"gamma": gamma}) for gamma in (3, 5, 8)]
    with_draft += [("speculative", {"gamma_schedule": "cost"}), ("specinfer", {}), ("cascade", {})]
    model_free = [("pld", {}), ("trie-lookahead", {}), ("lookahead-decoding", {}), ("self-speculative", {})]
    return [("autoregressive", {})] + (with_draft if has_draft else []) + model_free


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
    path.write_text(json.dumps(saved, indent=1) + "\n")
    return path


def default_choice(draft_model) -> dict:
    if draft_model is not None:
        return {"method": "speculative", "options": {"gamma_schedule": "cost"},
                "reason": "not calibrated (run `accelgen tune auto`): draft-model speculation, γ chosen each step from "
                          "the measured acceptance and cost ratio"}
    return {"method": "pld", "options": {},
            "reason": "not calibrated and no draft model: prompt lookup, whose drafts cost nothing"}


class AutoDrafter:
    """The chosen method's drafter (everything delegated), plus `describe` for the result's stats."""

    def __init__(self, inner, choice: dict):
        self.inner = inner
        self.choice = choice

    def __getattr__(self, name):  # propose, update, draft_steps, close: the chosen drafter's own
        return getattr(self.inner, name)

    def describe(self) -> dict:
        return self.choice


def _make(target_model, *, draft_model=None, tokenizer=None, sampling, generator, workload):
    choice = load_choice(target_model, draft_model, workload)
    if choice is None:
        if workload:
            raise ValueError(f"auto: no calibration saved for workload {workload!r} with this draft model; "
                             f"run `accelgen tune auto --dataset {workload}` first")
        choice = default_choice(draft_model)
    spec = get_method(choice["method"])
    options = spec.check_options(choice["options"])
    inner = spec.make_drafter(target_model, draft_model=draft_model, tokenizer=tokenizer, sampling=sampling,
                              generator=generator, **options)
    return AutoDrafter(inner, {"method": spec.name, "options": choice["options"], "reason": choice["reason"]})


register(
    MethodSpec(
        name="auto",
        family="policy",
        lossless="distribution-exact",
        paper="Yan et al. 2024, arXiv:2402.01528 (the analytical model behind the choice)",
        summary="the method and γ/tree options a short calibration (`accelgen tune auto`) found fastest for this "
                "model pair and workload; uncalibrated: cost-adaptive speculation, or prompt lookup without a draft",
        make_drafter=_make,
        options={"workload": ""},
    )
)

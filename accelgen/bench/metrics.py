"""Metrics over benchmark records: speedup against the baseline, τ, acceptance, draft share, identical output,
and the Leviathan et al. prediction for draft-model speculation. Pure functions of plain dicts.

A record is one (prompt, method) run: prompt_id, category, method, new_tokens, seconds, token_ids,
target_forwards, committed_per_step, draft_tokens, accepted_draft_tokens, draft_seconds (None when unknown),
and where known mean_layers (early exit), hit_rate and compute (ppd) and passed (HumanEval tests, with --execute).
"""

from __future__ import annotations

import math
from statistics import fmean

from accelgen.bench.rows import BASELINE
from accelgen.quality import rouge_l, token_agreement
from accelgen.theory import expected_tokens_per_forward, predicted_speedup

OVERALL = "overall"


def compare_with_baseline(records: list[dict], greedy: bool) -> list[dict]:
    """Records with `speedup` (baseline seconds / own seconds, same prompt), `format_speedup` (the same against
    the autoregressive row of the record's weight format, `speed_reference`), `identical` (token-exact with
    its `reference` row: hf-greedy, or in another weight format that format's autoregressive row), and
    `agreement` and `rouge_l` (accelgen.quality, against the reference) added; the last three are None for
    sampling runs or without a reference record. Records from before formats were recorded compare with hf-greedy."""
    by_prompt: dict = {}
    for record in records:
        by_prompt.setdefault(record["prompt_id"], {})[record["method"]] = record
    compared = []
    for record in records:
        rows = by_prompt[record["prompt_id"]]
        base = rows.get(BASELINE)
        reference = rows.get(record.get("reference", BASELINE)) if record.get("reference", BASELINE) else None
        speed_reference = rows.get(record.get("speed_reference") or "")
        speedup = base["seconds"] / record["seconds"] if base and record["seconds"] > 0 else None
        format_speedup = (speed_reference["seconds"] / record["seconds"]
                          if speed_reference and record["seconds"] > 0 else None)
        baseline_tokens = base["new_tokens"] if base else None
        checked = reference is not None and greedy  # sampled outputs are not expected to match
        identical = record["token_ids"] == reference["token_ids"] if checked else None
        agreement = token_agreement(reference["token_ids"], record["token_ids"]) if checked else None
        overlap = rouge_l(reference["token_ids"], record["token_ids"]) if checked else None
        compared.append({**record, "speedup": speedup, "format_speedup": format_speedup,
                         "baseline_tokens": baseline_tokens, "identical": identical, "agreement": agreement,
                         "rouge_l": overlap})
    return compared


def summarize(records: list[dict]) -> dict:
    """Aggregates of one method's compared records (one scope: a category or overall)."""
    seconds = sum(r["seconds"] for r in records)
    new_tokens = sum(r["new_tokens"] for r in records)
    with_speedup = [r for r in records if r["speedup"] is not None]
    baseline_seconds = sum(r["seconds"] * r["speedup"] for r in with_speedup)
    own_seconds = sum(r["seconds"] for r in with_speedup)
    compared = [r for r in records if r["identical"] is not None]
    return {
        "prompts": len(records),
        "new_tokens": new_tokens,
        "seconds": seconds,
        "tokens_per_second": new_tokens / seconds if seconds > 0 else None,
        "speedup_total": baseline_seconds / own_seconds if own_seconds > 0 else None,
        "speedup_geomean": geometric_mean([r["speedup"] for r in with_speedup]),
        "format_speedup_total": format_speedup_total(records),
        "weights": next((r["weights"] for r in records if r.get("weights")), None),
        "draft_weights": next((r["draft_weights"] for r in records if r.get("draft_weights")), None),
        "reference": next((r["reference"] for r in records if r.get("reference")), None),
        # tokens/s against the baseline's on the same prompts: a lossy method's output may be longer or shorter
        "speedup_per_token": per_token_speedup(with_speedup, baseline_seconds),
        "tau": ratio(records, "new_tokens", "target_forwards"),
        "acceptance_rate": ratio(records, "accepted_draft_tokens", "draft_tokens"),
        "draft_share": ratio(records, "draft_seconds", "seconds"),
        "compared": len(compared),
        "identical": sum(1 for r in compared if r["identical"]),
        "mismatched_prompts": [r["prompt_id"] for r in compared if not r["identical"] and not r.get("quality_only")],
        "agreement": fmean(r["agreement"] for r in compared) if compared else None,
        "rouge_l": fmean(r["rouge_l"] for r in compared) if compared else None,
        "mean_layers": mean_of(records, "mean_layers"),
        "hit_rate": mean_of(records, "hit_rate"),
        "compute": mean_of(records, "compute"),
        "pass_at_1": mean_of(records, "passed"),
        "alpha_per_token": None,  # filled in by aggregate() where a constant draft length is known
    }


def aggregate(records: list[dict], method_order: list[str], gammas: dict[str, int] | None = None) -> dict:
    """{scope: {method: summary}} for OVERALL and every category, methods in method_order.

    gammas: method -> constant draft length, for the per-token acceptance estimate."""
    gammas = gammas or {}
    categories = list(dict.fromkeys(r["category"] for r in records))
    scopes = {OVERALL: records, **{c: [r for r in records if r["category"] == c] for c in categories}}
    result = {}
    for scope, scoped in scopes.items():
        result[scope] = {}
        for method in method_order:
            own = [r for r in scoped if r["method"] == method]
            if not own:
                continue
            summary = summarize(own)
            if method in gammas:
                summary["alpha_per_token"] = per_token_acceptance(own, gammas[method])
            result[scope][method] = summary
    return result


def format_speedup_total(records: list[dict]) -> float | None:
    """Total time of the same-format autoregressive row over the record's own, on the prompts both ran."""
    paired = [r for r in records if r.get("format_speedup") is not None]
    own = sum(r["seconds"] for r in paired)
    return sum(r["seconds"] * r["format_speedup"] for r in paired) / own if own > 0 else None


def per_token_speedup(records: list[dict], baseline_seconds: float) -> float | None:
    """(own tokens / own seconds) / (baseline tokens / baseline seconds) over records with a baseline."""
    own_tokens, own_seconds = sum(r["new_tokens"] for r in records), sum(r["seconds"] for r in records)
    baseline_tokens = sum(r["baseline_tokens"] for r in records)
    if not own_tokens or not own_seconds or not baseline_tokens or not baseline_seconds:
        return None
    return (own_tokens / own_seconds) / (baseline_tokens / baseline_seconds)


def mean_of(records: list[dict], key: str) -> float | None:
    """Mean of a field that only some records carry (early exit's layers, HumanEval's test outcome)."""
    values = [r[key] for r in records if r.get(key) is not None]
    return fmean(values) if values else None


def ratio(records: list[dict], numerator: str, denominator: str) -> float | None:
    """sum(numerator) / sum(denominator), or None if any record lacks either."""
    if any(r.get(numerator) is None or r.get(denominator) is None for r in records):
        return None
    total = sum(r[denominator] for r in records)
    return sum(r[numerator] for r in records) / total if total else None


def geometric_mean(values: list[float]) -> float | None:
    positive = [v for v in values if v and v > 0]
    return math.exp(fmean(math.log(v) for v in positive)) if positive else None


def per_token_acceptance(records: list[dict], gamma: int) -> float | None:
    """Estimate of α, the chance that one drafted token is accepted, from accepted counts per step.

    Each step drafts gamma tokens and accepts them until the first rejection, so a step contributes its
    accepted tokens as successes and one failure unless all gamma were accepted: α ≈ A / (A + R). (The plain
    acceptance rate, accepted / drafted, counts the tokens after a rejection as failures too and so
    underestimates α.) A record's last step is left out: max_new_tokens or an EOS may have cut it short.
    """
    accepted = rejections = 0
    for record in records:
        for committed in (record.get("committed_per_step") or [])[:-1]:
            accepted += committed - 1
            rejections += committed - 1 < gamma
    return accepted / (accepted + rejections) if accepted + rejections else None


def theory_check(overall: dict, method: str, gamma: int, cost_ratio: float | None) -> list[dict]:
    """Predicted τ and speedup from each α estimate, beside what was measured for `method`."""
    summary = overall.get(method)
    if summary is None or cost_ratio is None:
        return []
    reference = overall.get("autoregressive")
    measured_vs_autoregressive = None
    if reference and summary["tokens_per_second"] and reference["tokens_per_second"]:
        measured_vs_autoregressive = summary["tokens_per_second"] / reference["tokens_per_second"]
    rows = []
    for source, alpha in (("acceptance rate", summary["acceptance_rate"]), ("per-token estimate", summary["alpha_per_token"])):
        if alpha is None:
            continue
        rows.append({
            "method": method,
            "alpha_source": source,
            "alpha": alpha,
            "gamma": gamma,
            "cost_ratio": cost_ratio,
            "predicted_tau": expected_tokens_per_forward(alpha, gamma),
            "measured_tau": summary["tau"],
            "predicted_speedup": predicted_speedup(alpha, gamma, cost_ratio),
            "measured_speedup_vs_baseline": summary["speedup_total"],
            "measured_speedup_vs_autoregressive": measured_vs_autoregressive,
        })
    return rows

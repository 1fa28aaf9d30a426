"""Render a benchmark folder: results.json, report.md and the plots, from run.json + records.jsonl + audits.jsonl.

Rendering needs no model, so `accelgen bench-report` can redo it at any time, also for an interrupted run.
"""

from __future__ import annotations

import json
from pathlib import Path

from accelgen.atomic import write_json_atomically, write_text_atomically
from accelgen import hardware
from accelgen.bench import metrics, plots
from accelgen.bench.near_tie import LLAMACPP_TIE, TIE_ULPS
from accelgen.bench.rows import BASELINE, LOSSLESS
from accelgen.bench.runner import AUDITS_FILE, EXECUTIONS_FILE, RECORDS_FILE, RUN_FILE, read_jsonl

RESULTS_FILE, REPORT_FILE = "results.json", "report.md"
SPEEDUP_PLOT, TOKENS_PLOT, TAU_PLOT, TRADEOFF_PLOT = "speedup.png", "tokens.png", "tau.png", "tradeoff.png"


def render(out_dir: Path) -> dict:
    """Write results.json, report.md and the plots (speedup.png, tokens.png, tau.png, tradeoff.png) into out_dir;
    returns the results."""
    out_dir = Path(out_dir)
    run_file = out_dir / RUN_FILE
    if not run_file.exists():
        raise FileNotFoundError(f"{out_dir} is not a benchmark folder: it has no {RUN_FILE}")
    run_info = json.loads(run_file.read_text())
    results = build_results(run_info, read_jsonl(out_dir / RECORDS_FILE), read_jsonl(out_dir / AUDITS_FILE),
                            read_jsonl(out_dir / EXECUTIONS_FILE))
    write_json_atomically(out_dir / RESULTS_FILE, results)
    methods = results["config"]["methods"]
    plots.speedup_plot(results["aggregates"], results["records"], methods, out_dir / SPEEDUP_PLOT)
    plots.tokens_plot(results["aggregates"].get(metrics.OVERALL, {}), out_dir / TOKENS_PLOT)
    drafting = [m for m in methods if results["methods"][m]["family"] != "baseline"]
    plots.tau_plot(results["records"], drafting, out_dir / TAU_PLOT)
    if lossy_methods(results):
        plots.tradeoff_plot(results["aggregates"][metrics.OVERALL], lossy_methods(results), out_dir / TRADEOFF_PLOT)
    write_text_atomically(out_dir / REPORT_FILE, markdown(results))
    return results


def build_results(run_info: dict, records: list[dict], audits: list[dict], executions: list[dict] = ()) -> dict:
    config = run_info["config"]
    greedy = config["temperature"] == 0
    passed = {(row["prompt_id"], row["method"]): row["passed"] for row in executions}
    records = [{**r, "passed": passed.get((r["prompt_id"], r["method"]))} for r in records]
    compared = metrics.compare_with_baseline(records, greedy)
    gammas = theory_gammas(run_info)
    aggregates = metrics.aggregate(compared, config["methods"], gammas)
    cost_ratio = run_info["cost"]["cost_ratio"]
    theory = [row for method, gamma in gammas.items()
              for row in metrics.theory_check(aggregates.get(metrics.OVERALL, {}), method, gamma, cost_ratio)]
    return {
        "metadata": run_info["metadata"],
        "resumed": run_info.get("resumed", []),
        "config": config,
        "methods": run_info["methods"],
        "cost": run_info["cost"],
        "aggregates": aggregates,
        "theory": theory,
        "audits": audits,
        "warnings": lossless_warnings(aggregates, run_info["methods"], audits) if greedy else [],
        "records": compared,
    }


def lossy_methods(results: dict) -> list[str]:
    """Methods that trade agreement for speed, in a greedy run (where agreement is measured)."""
    if results["config"]["temperature"] != 0:
        return []
    return [m for m in results["config"]["methods"] if results["methods"][m]["lossless"] not in LOSSLESS]


def theory_gammas(run_info: dict) -> dict[str, int]:
    """Draft-model methods with a constant draft length: the ones Leviathan et al.'s formula describes."""
    gammas = {}
    for name, info in run_info["methods"].items():
        options = run_info["config"]["options"].get(name, {})
        # gamma "auto" follows the measured budget, so its steps draft different lengths
        if (info["source"] == "accelgen" and "draft_model" in info.get("needs", [])
                and isinstance(options.get("gamma"), int) and options.get("gamma_schedule", "constant") == "constant"):
            gammas[name] = options["gamma"]
    return gammas


def lossless_warnings(aggregates: dict, methods: dict, audits: list[dict]) -> list[dict]:
    """One warning per method that claims lossless greedy output but differs from the baseline somewhere."""
    warnings = []
    for name, summary in aggregates.get(metrics.OVERALL, {}).items():
        info = methods[name]
        if name == BASELINE or info["lossless"] not in LOSSLESS or not summary["mismatched_prompts"]:
            continue
        verdicts = {a["prompt_id"]: a["classification"] for a in audits if a["method"] == name}
        errors = [p for p in summary["mismatched_prompts"] if verdicts.get(p) == "error"]
        ties = [p for p in summary["mismatched_prompts"] if verdicts.get(p) == "near-tie"]
        unaudited = [p for p in summary["mismatched_prompts"] if p not in verdicts]
        warnings.append({
            "method": name,
            "reference": summary.get("reference") or BASELINE,
            "source": info["source"],
            "mismatched": len(summary["mismatched_prompts"]),
            "compared": summary["compared"],
            "errors": errors,
            "near_ties": ties,
            "unaudited": unaudited,
            "severity": "error" if errors or unaudited else "near-tie",
        })
    return warnings


# --- markdown -----------------------------------------------------------------------------------------------

SUMMARY_COLUMNS = ("method", "weights", "lossless", "prompts", "new tokens", "time (s)", "tokens/s",
                   f"speedup vs {BASELINE} (total)", "speedup (geomean)", "vs autoregressive, same weights", "τ",
                   "acceptance", "draft share", "identical", "compared with", "agreement", "ROUGE-L")
# shown only where they say something: the speedup per generated token where lossy methods change the output's
# length, early exit's mean depth, PPD's candidate hits and compute (layer-rows relative to plain decoding),
# HumanEval's pass@1 (--execute)
OPTIONAL_COLUMNS = {"speedup_per_token": "speedup (per token)", "mean_layers": "layers", "hit_rate": "hits",
                    "compute": "compute", "pass_at_1": "pass@1"}


def markdown(results: dict) -> str:
    config = results["config"]
    greedy = config["temperature"] == 0
    lines = [f"# Benchmark: {config['dataset']} on {config['model']}" + (f" (draft {config['draft']})" if config["draft"] else ""), ""]
    lines += run_description(results)
    if results["warnings"]:
        lines += ["## ⚠ Lossless check", ""] + [warning_line(w) for w in results["warnings"]] + [""]
    scopes = list(results["aggregates"])
    for scope in scopes:
        if scope != metrics.OVERALL and len(scopes) == 2:
            continue  # one category: its table would repeat the overall one
        lines += [f"## {'Overall' if scope == metrics.OVERALL else 'Category: ' + scope}", ""]
        lines += summary_table(results["aggregates"][scope], results["methods"], greedy) + [""]
    if greedy:
        lines += audit_section(results["audits"])
    lines += theory_section(results)
    cost = results["cost"]
    lines += ["## Forward costs", "", f"One single-token forward with the first prompt cached, median of a few: target "
              f"{ms(cost['target_forward_seconds'])}" + (f", draft {ms(cost['draft_forward_seconds'])}, c = {cost['cost_ratio']:.3f}"
                                                         if cost["cost_ratio"] is not None else ""), ""]
    lines += ["## Plots", "", f"![speedup per category]({SPEEDUP_PLOT})", "", f"![tokens/s per row]({TOKENS_PLOT})", "",
              f"![tokens per target forward]({TAU_PLOT})", ""]
    if lossy_methods(results):
        lines += [f"![speedup against agreement with {BASELINE}, lossy methods]({TRADEOFF_PLOT})", ""]
    lines += legend(greedy)
    return "\n".join(lines)


def run_description(results: dict) -> list[str]:
    config, meta = results["config"], results["metadata"]
    machine, versions = meta["machine"], meta["versions"]
    lines = [
        f"- command: `{meta['command']}`" if meta.get("command") else "- command: (called from Python)",
        f"- date: {meta['date']}" + (f" (resumed {len(results['resumed'])}×)" if results["resumed"] else ""),
        f"- machine: {hardware.flags_text(machine) if 'flags' in machine else machine['cpu'] + '; flags: n/a (not recorded by this older run)'}; "
        f"{machine['logical_cores']} logical cores, {machine['torch_threads']} torch threads, {machine['system']}",
        *device_line(meta.get("device")),
        f"- weights: target {meta.get('weights', meta['dtype'])}" + (f", draft {meta['draft_weights']}" if meta.get("draft_weights") else "")
        + "; rows with a format of their own say so in the weights column",
        *gguf_line(meta.get("gguf_files")),
        f"- versions: accelgen {versions['accelgen']}, torch {versions['torch']}, transformers {versions['transformers']}, python {machine['python']}",
        f"- dtype: {meta['dtype']}" + (f" (draft {meta['draft_dtype']})" if meta.get("draft_dtype") else ""),
        f"- max_new_tokens {config['max_new_tokens']}, temperature {config['temperature']}, seed {config['seed']}, "
        f"prompt format {config['prompt_format']}, prompts done: {prompt_count(results)}",
        "- methods: " + ", ".join(f"{m}" + option_text(config["options"].get(m, {})) for m in config["methods"]),
        *compiled_line(results["records"], config["methods"]),
        *[f"- note: {note}" for note in meta.get("notes", [])],  # (older runs recorded none)
        "",
    ]
    return lines


def compiled_line(records: list[dict], methods: list[str]) -> list[str]:
    """Per HF static row, on how many prompts generate() took transformers' compiled forward."""
    counts: dict[str, list[bool]] = {name: [] for name in methods}
    for record in records:
        if record.get("compiled") is not None:
            counts[record["method"]].append(record["compiled"])
    counts = {name: flags for name, flags in counts.items() if flags}
    if not counts:
        return []
    return ["- transformers' compiled forward: " + ", ".join(f"{name} on {sum(flags)} of {len(flags)} prompts"
                                                            for name, flags in counts.items())]


def device_line(device: dict | None) -> list[str]:
    """The GPU a run ran on, with its CUDA and driver versions (a CPU run, or an older one, has no such line)."""
    if not device or device.get("type") == "cpu":
        return []
    return [f"- device: {hardware.device_text(device)}"]


def gguf_line(files: dict | None) -> list[str]:
    """The GGUF files llama.cpp ran (their names say the quantization), where the run had rows on it."""
    if not files:
        return []
    named = [f"{role} {files[role]}" for role in ("target", "draft") if files.get(role)]
    return ["- GGUF files (llama.cpp rows, weights=gguf): " + ", ".join(named)]


def prompt_count(results: dict) -> int:
    return len({r["prompt_id"] for r in results["records"]})


def option_text(options: dict) -> str:
    return f" ({', '.join(f'{k}={v}' for k, v in options.items())})" if options else ""


def warning_line(warning: dict) -> str:
    name, counts = warning["method"], f"{warning['mismatched']} of {warning['compared']} prompts"
    reference = warning.get("reference", BASELINE)
    if warning["severity"] == "near-tie":
        return f"- {name}: differs from {reference} on {counts}, every one a numerical near-tie (see the audit)."
    who = "**LOSSLESS VIOLATION**" if warning["source"] == "accelgen" else f"**peer mismatch** ({warning['source']})"
    parts = [f"errors on {', '.join(warning['errors'])}" if warning["errors"] else "",
             f"near-ties on {', '.join(warning['near_ties'])}" if warning["near_ties"] else "",
             f"not audited: {', '.join(warning['unaudited'])}" if warning["unaudited"] else ""]
    return f"- {who} {name}: differs from {reference} on {counts}; " + "; ".join(p for p in parts if p) + "."


def summary_table(summaries: dict, methods: dict, greedy: bool) -> list[str]:
    lossy = any(methods[name]["lossless"] not in LOSSLESS for name in summaries)
    optional = [key for key in OPTIONAL_COLUMNS if (lossy if key == "speedup_per_token"
                                                    else any(s[key] is not None for s in summaries.values()))]
    shown = {"speedup_per_token": times, "mean_layers": lambda value: num(value, 1)}
    rows = []
    for name, s in summaries.items():
        identical = f"{s['identical']}/{s['compared']}" if greedy and s["compared"] else "n/a"
        if greedy and s["mismatched_prompts"] and methods[name]["lossless"] in LOSSLESS:
            identical = f"**{identical}** ⚠"
        rows.append([name, weights_cell(s), methods[name]["lossless"], s["prompts"], s["new_tokens"],
                     num(s["seconds"], 2), num(s["tokens_per_second"], 2), times(s["speedup_total"]),
                     times(s["speedup_geomean"]), times(s.get("format_speedup_total")), num(s["tau"], 2),
                     num(s["acceptance_rate"], 3), percent(s["draft_share"]), identical,
                     reference_name(s), percent(s["agreement"]), num(s["rouge_l"], 3)]
                    + [shown.get(key, percent)(s[key]) for key in optional])
    return table(SUMMARY_COLUMNS + tuple(OPTIONAL_COLUMNS[key] for key in optional), rows)


def weights_cell(summary: dict) -> str:
    """The row's weight format, and its draft's where it has one (n/a: a run from before formats were recorded)."""
    weights = summary.get("weights") or "n/a"
    return f"{weights} (draft {summary['draft_weights']})" if summary.get("draft_weights") else weights


def reference_name(summary: dict) -> str:
    """The row a method's output was compared with (older runs, which recorded none: hf-greedy)."""
    if summary.get("weights") is None:
        return BASELINE
    return summary.get("reference") or "n/a"


def audit_section(audits: list[dict]) -> list[str]:
    lines = ["## Divergence audit", ""]
    if not audits:
        return lines + [f"No method that claims lossless greedy output differs from {BASELINE}.", ""]
    rows = [[a["method"], a["prompt_id"], a["position"], token_cell(a["baseline_token"], a.get("baseline_text")),
             token_cell(a["method_token"], a.get("method_text")), num(a["top1_logit"], 4), num(a["top2_logit"], 4),
             num(a["margin"], 4), num(a["tolerance"], 4), a["classification"], a["reason"]] for a in audits]
    headers = ("method", "prompt", "position", f"{BASELINE} token", "method token", "top-1 logit", "top-2 logit",
               "margin", "tolerance", "verdict", "why")
    return lines + table(headers, rows) + [""]


def theory_section(results: dict) -> list[str]:
    rows = results["theory"]
    if not rows:
        return []
    lines = ["## Theory check (Leviathan et al. 2023)", "",
             "E = (1 − α^(γ+1)) / (1 − α) tokens per target forward; S = E / (γc + 1).", ""]
    headers = ("method", "α from", "α", "γ", "c", "predicted τ (E)", "measured τ", "predicted S",
               f"measured vs {BASELINE}", "measured vs autoregressive")
    body = [[r["method"], r["alpha_source"], num(r["alpha"], 3), r["gamma"], num(r["cost_ratio"], 3),
             num(r["predicted_tau"], 2), num(r["measured_tau"], 2), times(r["predicted_speedup"]),
             times(r["measured_speedup_vs_baseline"]), times(r["measured_speedup_vs_autoregressive"])] for r in rows]
    return lines + table(headers, body) + [""]


def legend(greedy: bool) -> list[str]:
    lines = [
        "## How to read this", "",
        f"- speedup: {BASELINE} time / method time on the same prompt; *total* = sum of {BASELINE} times / sum of "
        "method times, *geomean* = geometric mean of the per-prompt ratios. Methods ran interleaved per prompt. "
        "*vs autoregressive, same weights*: the same against accelgen's `autoregressive` row in the row's weight "
        "format, where the run has one. weights: bf16/fp32 dense, int8/int4 weight-only quantized, gguf = the GGUF "
        "file on llama.cpp's kernels (accelgen's rows through its llama.cpp runner, `llamacpp*` rows llama.cpp's own loop).",
        "- τ: new tokens per target forward (HF methods: forwards counted on the target model). "
        "acceptance: accepted / drafted tokens (n/a where the method does not report its drafts). "
        "draft share: time in the drafter / total time.",
    ]
    if greedy:
        lines.append(f"- identical: prompts whose tokens equal those of the row named in *compared with* exactly: "
                     f"{BASELINE} for rows in its weight format, else the `autoregressive` row of the row's format "
                     "(llama.cpp's own rows: `llamacpp`), since another format is another model; that plain-decoding "
                     f"row itself is compared with {BASELINE} for quality only (what the format costs, no lossless "
                     "check). Each divergence of "
                     "a lossless method is audited: a *near-tie* is a rounding difference between nearly equal "
                     f"logits (both tokens within {TIE_ULPS} ulps of the best logit in the model's dtype, "
                     f"{LLAMACPP_TIE:g} logit on llama.cpp; never in float32), an *error* is not.")
        lines.append(f"- agreement: share of positions holding {BASELINE}'s token (a missing token counts as a "
                     "difference), averaged over prompts; what a lossy method gives up for its speed. ROUGE-L: "
                     f"F1 of the longest common token subsequence with {BASELINE}'s output (forgives shifts).")
        lines.append("- layers (early exit): mean number of decoder layers a decoded token went through. "
                     "pass@1 (HumanEval, `--execute`): share of completions that pass the task's unit tests.")
    else:
        lines.append("- sampling run: outputs are not expected to match, so only speed and τ are reported.")
    return lines + [""]


def table(headers, rows) -> list[str]:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(cell).replace("|", "\\|").replace("\n", "\\n") for cell in row) + " |" for row in rows]
    return lines


def token_cell(token: int | None, text: str | None) -> str:
    if token is None:
        return "(ended)"
    return f"{token} `{text!r}`" if text is not None else str(token)


def num(value, digits: int) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def times(value) -> str:
    return "n/a" if value is None else f"{value:.2f}×"


def percent(value) -> str:
    return "n/a" if value is None else f"{100 * value:.0f}%"


def ms(seconds) -> str:
    return "n/a" if seconds is None else f"{1000 * seconds:.1f} ms"

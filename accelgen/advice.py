"""`accelgen advise`: which weight format and which method to use on this machine, decided by measuring it.

Nothing here is a rule of thumb: the format table is the probe behind `weights="auto"` (accelgen/models/probe.py,
t(1) and t(8) per format), and the method is what `auto` picks uncalibrated from the costs measured in the
chosen formats (accelgen/costs.py, accelgen/drafters/auto.py); beside them, what the target's own quantized copy
drafting for it (`qspec`) is predicted to give, from the same probe. Both are measured once per machine and cached,
so a second call prints at once. `advice_markdown` renders it as Markdown (as in docs/weight-formats.md). On a GPU the
format is bf16 without a probe (accelgen/models/probe.py: the probe times CPU formats), and the method is chosen
from the costs measured on that GPU.
"""

from __future__ import annotations

from accelgen import hardware

ASSUMED_TOKENS_PER_VERIFY = 3.0  # what an 8-token verification yields with a useful draft (τ of the benchmarks)


def advise(model: str, draft: str | None = None, threads: int | None = None, device=None) -> dict:
    """{"machine", "device", "model", "draft", "target", "draft_choice", "method"}: what weights="auto" picks for
    the target (and draft) on `device` (None: the CPU), with the timings, and the method `auto` picks uncalibrated
    in those formats there, with its reason."""
    from accelgen.drafters.auto import uncalibrated_choice
    from accelgen.models.loading import check_source, load_model, resolve_device
    from accelgen.models.probe import choose_weights, device_choice

    target_device = resolve_device(device)
    for name in (model, draft):
        if name:
            check_source(name)  # before any format is probed
    if target_device.type == "cpu":
        target = choose_weights(model, threads)
        draft_choice = choose_weights(draft, threads) if draft else None
    else:
        target = device_choice(target_device)
        draft_choice = device_choice(target_device) if draft else None
    target_model, _ = load_model(model, weights=target["weights"], threads=threads, device=target_device)
    draft_model = (load_model(draft, weights=draft_choice["weights"], threads=threads, device=target_device)[0]
                   if draft else None)
    return {"machine": hardware.describe(threads), "device": hardware.describe_device(target_device), "model": model,
            "draft": draft, "target": target, "draft_choice": draft_choice,
            "method": uncalibrated_choice(target_model, draft_model),
            "self_draft": self_draft_estimate(target["timings"])}


SELF_DRAFT_GAMMA = 7  # the draft length of the qspec estimate: t(8) is measured, so a draft of 7 is verified by it


def self_draft_estimate(timings: dict[str, dict]) -> dict | None:
    """qspec from the format probe's timings: the bf16 (else fp32) target verifying SELF_DRAFT_GAMMA tokens drafted
    by its fastest quantized copy (gguf, int4 or int8), at the acceptance auto assumes of such a copy:
    tokens/s = E(α, γ) / (γ · t1(copy) + t8(target)), beside the target's plain decoding. None without both."""
    from accelgen.drafters.auto import SELF_DRAFT_PRIOR_ALPHA
    from accelgen.theory import expected_tokens_per_forward

    verifier = next((fmt for fmt in ("bf16", "fp32") if fmt in timings), None)
    copies = [fmt for fmt in ("gguf", "int4", "int8") if fmt in timings]
    if verifier is None or not copies:
        return None
    copy = min(copies, key=lambda fmt: timings[fmt]["t1"])
    tokens = expected_tokens_per_forward(SELF_DRAFT_PRIOR_ALPHA, SELF_DRAFT_GAMMA)
    drafted_tps = tokens / (SELF_DRAFT_GAMMA * timings[copy]["t1"] + timings[verifier]["t8"])
    plain_tps = 1 / timings[verifier]["t1"]
    return {"target": verifier, "copy": copy, "gamma": SELF_DRAFT_GAMMA, "alpha": SELF_DRAFT_PRIOR_ALPHA,
            "drafted_tps": drafted_tps, "plain_tps": plain_tps, "speedup": drafted_tps / plain_tps}


def format_rows(timings: dict[str, dict]) -> list[dict]:
    """Per format, fastest plain decoding first: t(1), t(8) in ms, r(8) and tokens/s, plain and with a draft whose
    8-token verification yields ASSUMED_TOKENS_PER_VERIFY tokens (the better of the two, as the budget falls back)."""
    rows = [{"weights": fmt, "t1_ms": t["t1"] * 1000, "t8_ms": t["t8"] * 1000, "r8": t["t8"] / t["t1"],
             "plain_tps": 1 / t["t1"], "drafted_tps": max(1 / t["t1"], ASSUMED_TOKENS_PER_VERIFY / t["t8"])}
            for fmt, t in timings.items()]
    return sorted(rows, key=lambda row: -row["plain_tps"])


def advice_markdown(advice: dict) -> str:
    """As Markdown: the machine, the measured format table, the choices and the command to run."""
    model, draft, method = advice["model"], advice["draft"], advice["method"]
    target_weights = advice["target"]["weights"]
    device = advice.get("device", {"type": "cpu"})  # older advice was for the CPU
    on_gpu = device["type"] != "cpu"
    device_flag = f" --device {device['device']}" if on_gpu else ""
    lines = [
        f"Measured by `accelgen advise --model {model}" + (f" --draft {draft}" if draft else "") + device_flag + "` on "
        f"{hardware.flags_text(advice['machine'])}, {advice['machine']['torch_threads']} threads"
        + (f", on {hardware.device_text(device)}." if on_gpu else "."),
        "",
    ]
    if advice["target"]["timings"]:
        lines += [f"| weights | t(1) ms | t(8) ms | r(8) = t(8)/t(1) | tokens/s, plain | tokens/s, drafts yielding "
                  f"{ASSUMED_TOKENS_PER_VERIFY:g} per verification |",
                  "|---|---|---|---|---|---|"]
        for row in format_rows(advice["target"]["timings"]):
            lines.append(f"| {row['weights']} | {row['t1_ms']:.0f} | {row['t8_ms']:.0f} | {row['r8']:.2f} | "
                         f"{row['plain_tps']:.1f} | {row['drafted_tps']:.1f} |")
        lines.append("")
    lines.append(f"- **Target format**: `weights=auto` picks `{target_weights}` for {model}"
                 + (f": {advice['target']['reason']}." if not advice["target"]["timings"] else "."))
    if draft:
        draft_choice = advice["draft_choice"]
        speeds = ", ".join(f"{row['weights']} {row['plain_tps']:.1f}" for row in format_rows(draft_choice["timings"]))
        lines.append(f"- **Draft format**: `{draft_choice['weights']}` for {draft}"
                     + (f" (tokens/s: {speeds})." if speeds else "."))
    lines.append(f"- **Method**: uncalibrated, `auto` picks `{method['method']}`: {method['reason']}.")
    if (self_draft := advice.get("self_draft")) is not None:
        option = "" if self_draft["copy"] == "gguf" else f" -o quantized={self_draft['copy']}"
        lines.append(f"- **Quantized self-draft** (`qspec`, output exactly the {self_draft['target']} model's): its "
                     f"{self_draft['copy']} copy drafting γ = {self_draft['gamma']} tokens, at an assumed acceptance "
                     f"α = {self_draft['alpha']}, is predicted {self_draft['drafted_tps']:.1f} tokens/s, "
                     f"{self_draft['speedup']:.2f}× {self_draft['target']} plain decoding "
                     f"({self_draft['plain_tps']:.1f}): `accelgen generate -m {model} --weights {self_draft['target']} "
                     f"--method qspec{option} \"...\"`.")
    command = f"accelgen generate -m {model}{device_flag} --weights {target_weights}"
    if draft:
        command += f" -d {draft} --draft-weights {advice['draft_choice']['weights']}"
    lines += ["", "```bash", f"{command} --method auto \"...\"", "```"]
    return "\n".join(lines) + "\n"

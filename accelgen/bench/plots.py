"""PNG plots of a benchmark run (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)
import numpy as np  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from accelgen.atomic import save_figure_atomically
from accelgen.bench.methods import BASELINE, VARIANT  # noqa: E402
from accelgen.bench.metrics import OVERALL  # noqa: E402


def speedup_plot(aggregates: dict, methods: list[str], path: Path) -> Path:
    """Grouped bars: total-time speedup vs the baseline, one group per category (and overall), one bar per method."""
    scopes = [s for s in aggregates if s != OVERALL]
    scopes = ([OVERALL] + scopes) if len(scopes) > 1 else [OVERALL]
    shown = [m for m in methods if m != BASELINE]
    width = 0.8 / max(len(shown), 1)
    x = np.arange(len(scopes))
    fig, ax = plt.subplots(figsize=(max(6.0, 0.4 * len(scopes) * max(len(shown), 1) + 2), 4.5))
    for i, method in enumerate(shown):
        values = [(aggregates[s].get(method) or {}).get("speedup_total") or 0.0 for s in scopes]
        bars = ax.bar(x + (i - (len(shown) - 1) / 2) * width, values, width, label=method)
        ax.bar_label(bars, labels=[f"{v:.2f}" if v else "" for v in values], fontsize=7, padding=1)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(x, scopes, rotation=30 if len(scopes) > 4 else 0, ha="right" if len(scopes) > 4 else "center")
    ax.set_ylabel(f"speedup vs {BASELINE} (total time ratio)")
    ax.set_title("Speedup per category")
    if shown:
        ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure_atomically(fig, path)
    plt.close(fig)
    return path


def tokens_plot(summaries: dict, path: Path) -> Path:
    """Horizontal bars: overall tokens/s of every row, the baseline included, coloured by weight format (rows in
    different formats run different models, so their tokens/s is what compares them side by side)."""
    names = [name for name, s in summaries.items() if s.get("tokens_per_second")]
    formats = list(dict.fromkeys(summaries[name].get("weights") or "n/a" for name in names))
    colours = dict(zip(formats, plt.rcParams["axes.prop_cycle"].by_key()["color"] * len(formats)))
    fig, ax = plt.subplots(figsize=(7.5, max(2.5, 0.35 * len(names) + 1.2)))
    values = [summaries[name]["tokens_per_second"] for name in names]
    bars = ax.barh(names, values, color=[colours[summaries[name].get("weights") or "n/a"] for name in names])
    ax.bar_label(bars, labels=[f"{value:.2f}" for value in values], fontsize=7, padding=2)
    ax.invert_yaxis()  # first row on top, as in the report's tables
    ax.margins(x=0.15)  # room for the labels
    ax.set_xlabel("tokens/s (all prompts)")
    ax.set_title("Tokens per second per row")
    ax.tick_params(axis="y", labelsize=7)
    handles = [plt.Rectangle((0, 0), 1, 1, color=colours[fmt]) for fmt in formats]
    if handles:
        ax.legend(handles, formats, title="weights", fontsize=7, title_fontsize=7, loc="lower right")
    fig.tight_layout()
    save_figure_atomically(fig, path)
    plt.close(fig)
    return path


def tau_plot(records: list[dict], methods: list[str], path: Path) -> Path:
    """One histogram per method given: how many tokens each target forward committed (accepted + 1).
    Methods without per-forward data are left out."""
    steps = {m: [s for r in records if r["method"] == m for s in (r.get("committed_per_step") or [])] for m in methods}
    shown = [m for m in methods if steps[m]]
    columns = min(3, max(len(shown), 1))
    rows = max(1, -(-len(shown) // columns))
    fig, axes = plt.subplots(rows, columns, figsize=(4 * columns, 3 * rows), squeeze=False)
    for ax, method in zip(axes.flat, shown):
        values = steps[method]
        bins = np.arange(0.5, max(values) + 1.5)
        ax.hist(values, bins=bins, color="tab:blue", edgecolor="white")
        ax.set_title(f"{method} (τ = {np.mean(values):.2f})", fontsize=9)
        ax.set_xlabel("tokens per target forward")
        ax.set_ylabel("forwards")
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    for ax in list(axes.flat)[len(shown):]:
        ax.axis("off")
    if not shown:
        axes.flat[0].text(0.5, 0.5, "no drafting method with per-forward data", ha="center", va="center")
    fig.tight_layout()
    save_figure_atomically(fig, path)
    plt.close(fig)
    return path


def tradeoff_plot(summaries: dict, methods: list[str], path: Path) -> Path:
    """Speedup per generated token against agreement with the baseline, one point per method (a lossy method's
    output may be longer or shorter than the baseline's, so tokens/s is what compares); variants of one method
    (name@option=value) are joined by a line, in order of agreement."""
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    families: dict[str, list[str]] = {}
    for method in methods:
        families.setdefault(method.partition(VARIANT)[0], []).append(method)
    for family, members in families.items():
        points = sorted((summaries[m]["agreement"], summaries[m]["speedup_per_token"], m) for m in members
                        if m in summaries and summaries[m]["agreement"] is not None and summaries[m]["speedup_per_token"])
        if not points:
            continue
        agreement, speedup, names = zip(*points)
        ax.plot([100 * a for a in agreement], speedup, marker="o", label=family)
        for a, v, name in points:
            ax.annotate(name.partition(VARIANT)[2] or name, (100 * a, v), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xlabel(f"agreement with {BASELINE} (% of positions)")
    ax.set_ylabel(f"speedup vs {BASELINE} (tokens/s ratio)")
    ax.set_title("Lossy methods: speed against agreement")
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure_atomically(fig, path)
    plt.close(fig)
    return path


def loadtest_plot(result: dict, methods: list[str], path: Path) -> Path:
    """Left: tokens/s per method under load; right: the server's resident memory over the run."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    summary = result["summary"]
    values = [summary[m]["tokens_per_second"] for m in methods]
    bars = left.bar(methods, values, color="tab:blue")
    left.bar_label(bars, labels=[f"{v:.1f}" for v in values], fontsize=8)
    left.set_ylabel("tokens/s (all clients)")
    left.set_title("Throughput under load")
    if result["memory"]:
        seconds, mib = zip(*result["memory"])
        right.plot(seconds, mib, color="tab:red")
        right.set_ylim(0, max(mib) * 1.1)
    right.set_xlabel("seconds into the run")
    right.set_ylabel("server resident memory (MiB)")
    right.set_title("Memory")
    fig.tight_layout()
    save_figure_atomically(fig, path)
    plt.close(fig)
    return path

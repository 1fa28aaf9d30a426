"""PNG plots of a benchmark run (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)
import numpy as np  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402
from scipy.stats import bootstrap  # noqa: E402

from accelgen.atomic import save_figure_atomically
from accelgen.bench.rows import BASELINE  # noqa: E402
from accelgen.bench.metrics import OVERALL  # noqa: E402
from accelgen.method_options import VARIANT  # noqa: E402


CONFIDENCE = 0.95  # the speedup plot's whiskers: a bootstrap interval over prompts at this level


def speedup_plot(aggregates: dict, records: list[dict], methods: list[str], path: Path) -> Path:
    """Total-time speedup vs the baseline, readable for any number of methods: one horizontal bar per method,
    fastest on top, named on the axis (no legend over the bars), coloured by base method (variants name@... share
    one colour), with a 95% bootstrap confidence interval over prompts; beside it, with categories, a heatmap of
    each method's speedup per category in the same row order."""
    overall = aggregates.get(OVERALL, {})
    shown = fastest_first(overall, methods)
    categories = [scope for scope in aggregates if scope != OVERALL]
    with_heatmap = len(categories) > 1
    height = max(2.5, 0.32 * len(shown) + 1.6)
    widths = [5.0] + ([max(2.0, 0.55 * len(categories))] if with_heatmap else [])
    longest_name = max((len(m) for m in shown), default=0)
    fig, axes = plt.subplots(1, len(widths), figsize=(sum(widths) + 0.07 * longest_name + 0.5, height), sharey=True,
                             width_ratios=widths, layout="constrained", squeeze=False)
    bars_axis = axes[0, 0]
    values = [overall[m].get("speedup_total") or 0.0 for m in shown]
    intervals = [speedup_interval(records, m) for m in shown]
    whiskers = np.array([[v - low, high - v] if low is not None else [0.0, 0.0]
                         for v, (low, high) in zip(values, intervals)]).T.reshape(2, -1)
    rows = np.arange(len(shown))
    bars_axis.barh(rows, values, xerr=whiskers, color=method_colours(shown),
                   error_kw={"elinewidth": 0.8, "capsize": 2, "ecolor": "black"})
    for row, value, (_, high) in zip(rows, values, intervals):  # past the whisker, which a bar label would cross
        bars_axis.text(max(value, high or 0.0), row, f"  {value:.2f}×" if value else "  n/a", va="center", fontsize=7)
    bars_axis.axvline(1.0, color="black", linewidth=0.8, linestyle="--")
    bars_axis.set_yticks(rows, shown, fontsize=8)
    bars_axis.set_ylim(max(len(shown), 1) - 0.5, -0.5)  # fastest on top
    bars_axis.margins(x=0.12)  # room for the value labels
    bars_axis.set_xlabel(f"speedup vs {BASELINE} (total time ratio)\nwhiskers: {CONFIDENCE:.0%} bootstrap CI over prompts",
                         fontsize=8)
    bars_axis.set_title(f"Speedup, all {prompt_total(records)} prompts", fontsize=10)
    if with_heatmap:
        category_heatmap(axes[0, 1], aggregates, categories, shown)
    save_figure_atomically(fig, path)
    plt.close(fig)
    return path


def fastest_first(overall: dict, methods: list[str]) -> list[str]:
    """The methods with an overall summary, the baseline left out, by total-time speedup, highest first (ties and
    methods without a speedup keep their order, the latter last)."""
    shown = [m for m in methods if m != BASELINE and m in overall]
    return sorted(shown, key=lambda m: -(overall[m].get("speedup_total") or 0.0))


def speedup_interval(records: list[dict], method: str) -> tuple[float | None, float | None]:
    """The CONFIDENCE bootstrap interval (percentile method, prompts resampled with replacement, seeded) of a
    method's total-time speedup: sum of the baseline's seconds over sum of its own on the same prompts.
    (None, None) with fewer than two prompts, where no spread can be estimated."""
    paired = [(r["seconds"] * r["speedup"], r["seconds"]) for r in records
              if r["method"] == method and r.get("speedup") is not None and r["seconds"] > 0]
    if len(paired) < 2:
        return None, None
    baseline, own = np.array(paired).T
    result = bootstrap((baseline, own), lambda b, o, axis: b.sum(axis=axis) / o.sum(axis=axis), paired=True,
                       vectorized=True, confidence_level=CONFIDENCE, n_resamples=2000, method="percentile",
                       random_state=np.random.default_rng(0))
    return float(result.confidence_interval.low), float(result.confidence_interval.high)


def method_colours(methods: list[str]) -> list:
    """One qualitative colour per base method (variants name@option=value share their method's colour)."""
    palette = plt.get_cmap("tab20").colors
    bases = list(dict.fromkeys(m.partition(VARIANT)[0] for m in methods))
    colour_of = {base: palette[i % len(palette)] for i, base in enumerate(bases)}
    return [colour_of[m.partition(VARIANT)[0]] for m in methods]


def category_heatmap(ax, aggregates: dict, categories: list[str], methods: list[str]) -> None:
    """Speedup per (method, category), rows in the order of `methods`, written in each cell; colour on a log
    scale centred on 1 (blue faster, red slower), grey where a method has no prompt of that category."""
    speedups = np.array([[(aggregates[c].get(m) or {}).get("speedup_total") or np.nan for c in categories]
                         for m in methods], dtype=float).reshape(len(methods), len(categories))
    logs = np.log2(speedups)
    limit = max(np.nanmax(np.abs(logs), initial=0.0), np.log2(1.25))
    cmap = plt.get_cmap("RdBu").with_extremes(bad="lightgrey")
    ax.imshow(np.ma.masked_invalid(logs), cmap=cmap, vmin=-limit, vmax=limit, aspect="auto")
    for (row, column), value in np.ndenumerate(speedups):
        if not np.isnan(value):
            dark = abs(logs[row, column]) > 0.6 * limit
            ax.text(column, row, f"{value:.2f}", ha="center", va="center", fontsize=6.5,
                    color="white" if dark else "black")
    ax.set_xticks(np.arange(len(categories)), categories, rotation=45, ha="right", fontsize=7)
    ax.tick_params(axis="y", left=False)
    ax.set_title("Per category", fontsize=10)
    ax.set_xlabel("speedup (blue: faster, red: slower)", fontsize=8)


def prompt_total(records: list[dict]) -> int:
    return len({r["prompt_id"] for r in records})


def tokens_plot(summaries: dict, path: Path) -> Path:
    """Horizontal bars: overall tokens/s of every row, the baseline included, coloured by weight format (rows in
    different formats run different models, so their tokens/s is what compares them side by side)."""
    names = [name for name, s in summaries.items() if s.get("tokens_per_second")]
    formats = list(dict.fromkeys(summaries[name].get("weights") or "n/a" for name in names))
    colours = dict(zip(formats, plt.rcParams["axes.prop_cycle"].by_key()["color"] * len(formats)))
    fig, ax = plt.subplots(figsize=(7.5, max(2.5, 0.35 * len(names) + 1.2)), layout="constrained")
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
        fig.legend(handles, formats, title="weights", fontsize=7, title_fontsize=7, loc="outside right upper")
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
    fig, ax = plt.subplots(figsize=(7.5, 4.5), layout="constrained")
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
    fig.legend(fontsize=8, loc="outside right upper")  # beside the axes: never over a point
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

"""The Skeleton-of-Thought benchmark's plot (matplotlib, Agg backend): per question, how much sooner SoT gave the
full answer than normal decoding, and how close its answer stayed (ROUGE-L) with the judge's verdict."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)

from accelgen.atomic import save_figure_atomically  # noqa: E402

COLOURS = {"sharegpt": "tab:blue", "humaneval": "tab:orange"}
MARKERS = {"win": "^", "tie": "o", "loss": "v"}


def sot_plot(rows: list[dict], path: Path) -> Path:
    """Left: the latency ratio per question (bars by dataset, hatched where the router rejects the question);
    right: ROUGE-L against the latency ratio, marked by the judge's verdict for SoT."""
    fig, (bars, scatter) = plt.subplots(1, 2, figsize=(12, 4.5), width_ratios=[1.6, 1], layout="constrained")
    for x, row in enumerate(rows):
        bars.bar(x, row["latency_ratio"], color=COLOURS.get(row["dataset"], "tab:gray"),
                 hatch="//" if row.get("router_accepted") is False else None, edgecolor="white")
    bars.axhline(1.0, color="black", linewidth=0.8)
    bars.set_xticks(range(len(rows)), [row["id"].replace("HumanEval/", "HE/")[:10] for row in rows], rotation=70,
                    fontsize=7)
    bars.set_ylabel("normal latency / SoT latency")
    bars.set_title("latency to the full answer (hatched: router says normal decoding)")
    for row in rows:
        scatter.scatter(row["latency_ratio"], row["rouge_l"], color=COLOURS.get(row["dataset"], "tab:gray"),
                        marker=MARKERS[row["judge"]], s=45)
    for name, colour in COLOURS.items():
        scatter.scatter([], [], color=colour, label=name)
    for verdict, marker in MARKERS.items():
        scatter.scatter([], [], color="gray", marker=marker, label=f"judge: SoT {verdict}")
    scatter.axvline(1.0, color="black", linewidth=0.8)
    scatter.set_xlabel("latency ratio")
    scatter.set_ylabel("ROUGE-L of SoT's answer vs normal decoding's")
    scatter.legend(fontsize=7)
    scatter.set_title("quality")
    save_figure_atomically(fig, path)
    plt.close(fig)
    return path

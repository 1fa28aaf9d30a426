"""The benchmark's plots: readable with any number of methods (sorted bars named on the axis, one colour per
base method, bootstrap intervals over prompts)."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from accelgen.bench import plots
from accelgen.bench.metrics import OVERALL, aggregate, compare_with_baseline

LONG_NAME = "speculative@weights=gguf+draft_weights=gguf+gamma_schedule=cost"


def records_of(speeds: dict[str, list[float]], categories=("coding", "math")) -> list[dict]:
    """Records where method m runs prompt i speeds[m][i] times as fast as hf-greedy (8 s per prompt)."""
    prompts = len(next(iter(speeds.values())))
    records = []
    for i in range(prompts):
        for method, factors in {"hf-greedy": [1.0] * prompts, **speeds}.items():
            records.append({"prompt_id": str(i), "category": categories[i % len(categories)], "method": method,
                            "seconds": 8.0 / factors[i], "token_ids": [1, 2], "new_tokens": 2, "target_forwards": 1,
                            "committed_per_step": None, "draft_tokens": None, "accepted_draft_tokens": None,
                            "draft_seconds": None})
    return compare_with_baseline(records, greedy=True)


def test_methods_are_ranked_fastest_first_without_the_baseline():
    overall = {"hf-greedy": {"speedup_total": 1.0}, "pld": {"speedup_total": 1.5}, "eagle": {"speedup_total": 2.5},
               "calm": {"speedup_total": None}, "rest": {"speedup_total": 0.9}}
    assert plots.fastest_first(overall, ["hf-greedy", "pld", "calm", "eagle", "rest", "missing"]) == [
        "eagle", "pld", "rest", "calm"]


def test_the_interval_is_a_bootstrap_over_prompts_of_the_total_time_speedup():
    records = records_of({"pld": [1.0, 2.0, 4.0, 1.5, 3.0, 2.5, 1.2, 3.5]})
    low, high = plots.speedup_interval(records, "pld")
    total = aggregate(records, ["pld"])[OVERALL]["pld"]["speedup_total"]
    assert 1.0 < low < total < high < 4.0  # inside the per-prompt extremes, around the plotted value
    assert plots.speedup_interval(records, "pld") == (low, high)  # seeded: the same plot every time
    same = records_of({"pld": [2.0] * 5})
    assert plots.speedup_interval(same, "pld") == pytest.approx((2.0, 2.0))  # no spread, no width
    assert plots.speedup_interval(records_of({"pld": [2.0]}), "pld") == (None, None)  # one prompt: no spread


def test_variants_share_their_methods_colour_and_methods_differ():
    colours = plots.method_colours(["pld", "pld@max_ngram=4", "eagle", LONG_NAME, "speculative"])
    assert colours[0] == colours[1] and colours[3] == colours[4]
    assert len({colours[0], colours[2], colours[4]}) == 3


def test_the_speedup_plot_grows_with_the_methods_and_widens_for_long_names(tmp_path):
    rng = np.random.default_rng(0)
    names = [f"method-{i}" for i in range(24)] + [LONG_NAME]
    records = records_of({name: list(rng.uniform(0.5, 3.0, size=6)) for name in names},
                         categories=("coding", "math", "writing"))
    aggregates = aggregate(records, ["hf-greedy", *names])
    few = plots.speedup_plot(aggregate(records, ["hf-greedy", "method-0"]), records, ["hf-greedy", "method-0"],
                             tmp_path / "few.png")
    many = plots.speedup_plot(aggregates, records, ["hf-greedy", *names], tmp_path / "many.png")
    few_size, many_size = Image.open(few).size, Image.open(many).size
    assert many_size[1] > 3 * few_size[1]  # a row per method: 25 rows stay apart
    assert many_size[0] > few_size[0]  # room for the long name on the axis

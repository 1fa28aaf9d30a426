import json

import pytest
from typer.testing import CliRunner

from accelgen.cli import app
from accelgen.profile import batch_table, profile, speedup_table, interpolate
from accelgen.theory import best_gamma


def test_interpolate_between_measured_sizes():
    measured = {1: 1.0, 4: 1.3, 8: 2.1}
    assert interpolate(measured, 4) == 1.3
    assert interpolate(measured, 2) == pytest.approx(1.1)
    assert interpolate(measured, 6) == pytest.approx(1.7)
    assert interpolate(measured, 12) == pytest.approx(2.9)  # the last slope continued


def test_flat_verification_gives_leviathans_gamma_and_costly_verification_a_short_one():
    flat = {"cost_ratio": 0.05, "verify_ratio": {1: 1.0, 32: 1.0}}
    assert speedup_table(flat, [0.8])[0]["best_gamma"] == best_gamma(0.8, 0.05, 16)
    linear = {"cost_ratio": 0.05, "verify_ratio": {1: 1.0, 2: 2.0}}  # k tokens cost k forwards: no free lunch
    row = speedup_table(linear, [0.8])[0]
    assert row["best_gamma"] == 0 and row["predicted_speedup"] == 1.0  # no draft pays: plain decoding


def test_profile_times_every_block_size(tiny_target, tiny_draft):
    result = profile(tiny_target, tiny_draft, context_tokens=8, sizes=(2, 4), repeats=1)
    assert sorted(result["target_seconds"]) == [1, 2, 4] and min(result["target_seconds"].values()) > 0
    assert result["verify_ratio"][1] == 1.0 and result["cost_ratio"] > 0


def test_profile_command(smollm):
    output = CliRunner().invoke(app, ["profile", "--model", "smollm2-135m", "--dtype", "float32", "--draft", "smollm2-135m",
                                      "--sizes", "1,2", "--repeats", "1", "--context-tokens", "16", "--alphas", "0.8",
                                      "--json"])
    assert output.exit_code == 0, output.output
    result = json.loads(output.stdout)
    assert set(result["target_seconds"]) == {"1", "2"} and result["predictions"][0]["alpha"] == 0.8
    bad = CliRunner().invoke(app, ["profile", "--sizes", "0,x"])
    assert bad.exit_code != 0 and "--sizes" in bad.output


def test_batch_table_drafts_less_as_batched_verification_gets_costly():
    result = {"batch_seconds": {
        1: {1: 1.0, 2: 1.0, 4: 1.05, 8: 1.1, 16: 1.3},  # alone: verification nearly free
        8: {1: 2.0, 2: 3.6, 4: 7.0, 8: 14.0, 16: 28.0},  # a full batch: every extra token costs its share
    }}
    rows = {row["batch"]: row for row in batch_table(result, alpha=0.8)}
    assert rows[1]["best_gamma"] >= 4 and rows[1]["predicted_gain"] > 2
    assert rows[8]["best_gamma"] == 0 and rows[8]["predicted_gain"] == 1.0 and rows[8]["token_budget"] == 8


def test_profile_times_batched_forwards(tiny_target):
    result = profile(tiny_target, context_tokens=8, sizes=(2,), repeats=1, batch_sizes=(1, 3))
    assert sorted(result["batch_seconds"]) == [1, 3] and sorted(result["batch_seconds"][3]) == [1, 2]
    assert min(result["batch_seconds"][3].values()) > 0

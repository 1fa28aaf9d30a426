"""The load test: bounded, loopback only, per-method summaries from one interleaved run."""

import asyncio

import pytest

from accelgen.server.loadtest import check_loopback, histogram, memory_summary, report_markdown, run_load, save


def test_load_against_a_live_server(live_server, tmp_path):
    url, _ = live_server
    prompts = ["Write a haiku about caches.", "Name three prime numbers."]
    seen = []
    result = asyncio.run(run_load(url, prompts, ["autoregressive", "pld"], clients=3, duration=2.0, rounds=1,
                                  max_tokens=8, progress=lambda *args: seen.append(args[1]), memory_every=0.2))
    assert seen == ["autoregressive", "pld"]
    for method in ("autoregressive", "pld"):
        summary = result["summary"][method]
        assert summary["requests"] >= 3 and summary["errors"] == 0
        assert summary["tokens_per_second"] > 0 and summary["tau"] >= 1 and summary["latency_p99"] >= summary["latency_p50"]
        assert sum(summary["first_token_histogram"]["counts"]) == summary["requests"]
        gaps = sum(len(o["inter_token_seconds"]) for o in result["outcomes"] if o["method"] == method)
        assert gaps > 0 and sum(summary["inter_token_histogram"]["counts"]) == gaps
        assert 0 < summary["inter_token_p50"] <= summary["inter_token_p99"]
    assert {o["method"] for o in result["outcomes"]} == {"autoregressive", "pld"}
    assert result["memory"] and result["summary"]["memory_mib"]["max"] > 0
    config = {"clients": 3, "duration": 2.0, "rounds": 1, "methods": ["autoregressive", "pld"], "dataset": "test",
              "max_tokens": 8, "server": url}
    save(result, tmp_path, config)
    assert (tmp_path / "loadtest.json").exists() and (tmp_path / "loadtest.png").stat().st_size > 0
    assert (tmp_path / "latency-histograms.png").stat().st_size > 0
    report = (tmp_path / "report.md").read_text()
    assert "| pld |" in report and "Inter-token latency (s): count per bucket" in report
    assert "latency-histograms.png" in report


def test_only_loopback_and_memory_growth():
    check_loopback("http://127.0.0.1:8000")
    check_loopback("http://localhost:9")
    with pytest.raises(ValueError, match="only targets this machine"):
        check_loopback("http://10.0.0.5:8000")
    assert memory_summary([100, 200, 200, 200, 200, 200, 200, 200])["growth"] == 0
    assert memory_summary([100, 100, 100, 100, 150, 150, 200, 200])["growth"] == 100


def test_histogram_buckets():
    assert histogram([0.0, 0.04, 0.05, 0.3, 99.0], (0.0, 0.05, 0.1, 1.0)) == {"edges": [0.0, 0.05, 0.1, 1.0],
                                                                             "counts": [2, 1, 1, 1]}
    assert histogram([], (0.0, 1.0))["counts"] == [0, 0]


def test_report_compares_methods_to_the_first():
    row = {"requests": 4, "errors": 0, "tokens_per_second": 10.0, "latency_p50": 1.0, "latency_p99": 2.0,
           "first_token_p50": 0.1, "first_token_p99": 0.2, "tau": 1.0, "acceptance_rate": 0.0, "mean_batch_size": 3.0}
    summary = {"autoregressive": row, "pld": row | {"tokens_per_second": 15.0, "tau": 1.6}}
    text = report_markdown(summary, {"clients": 8, "duration": 60, "rounds": 2, "methods": ["autoregressive", "pld"],
                                     "dataset": "humaneval", "max_tokens": 64})
    assert "| pld | 4 | 0 | 15.0 | 1.50× |" in text and "| - |" in text  # no inter-token figures: "-"

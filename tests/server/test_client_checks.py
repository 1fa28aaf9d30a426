"""The openai client and LangChain against a live server on the tiny model: every call succeeds, JSON validates,
and speculative and pld give what autoregressive gives (what scripts/openai_clients.py checks on SmolLM2)."""

import pytest

from accelgen.server.client_checks import CHECKS, report_markdown, run_checks, same

pytest.importorskip("openai")
pytest.importorskip("langchain_openai")


def test_every_client_call_succeeds_and_speculation_changes_nothing(live_server):
    url, _ = live_server
    rows = run_checks(f"{url}/v1", "tiny", ["speculative", "pld"], max_tokens=12)
    assert len(rows) == 2 * len(CHECKS)
    failures = [(row["check"], row["method"], row["error"]) for row in rows if not row["ok"]]
    assert failures == []
    by_check = {row["check"]: row["output"] for row in rows if row["method"] == "speculative"}
    assert by_check["openai chat"] == by_check["openai chat stream"] == by_check["langchain chat"]
    assert by_check["openai tools"][0] == by_check["langchain bind_tools"][0] == "get_weather"
    assert len(by_check["openai n=2 seeded sampling"]) == 2
    table = [line for line in report_markdown(rows, url).splitlines() if line.startswith(("| openai", "| langchain"))]
    assert len(table) == len(CHECKS) and all(line.endswith("| identical | identical |") for line in table)


def test_a_difference_is_reported(live_server):
    url, _ = live_server
    calls = iter(["baseline", "different"])
    rows = run_checks(f"{url}/v1", "tiny", ["pld"], checks={"fake": lambda clients, max_tokens: next(calls)})
    assert rows[0]["error"] == "output differs from method autoregressive" and not rows[0]["ok"]
    assert "**failed**: output differs" in report_markdown(rows, url)


def test_same_compares_floats_within_the_tolerance():
    assert same([["a", -1.0, [["b", -2.0]]]], [["a", -1.0004, [["b", -2.0]]]])
    assert not same([["a", -1.0]], [["a", -1.1]]) and not same({"x": 1}, {"y": 1}) and not same([1], [1, 2])

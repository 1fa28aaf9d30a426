"""`accelgen train`: every trainer's flags, generated from its dataclasses, are the flags the commands had when
each wrote them out by hand (train_flags.json, recorded from those commands): names, defaults, types, limits and
help. A flag may be added; none may change or go."""

import json
from pathlib import Path

import pytest
import typer.main
from typer.testing import CliRunner

from accelgen.cli import app

RECORDED = json.loads((Path(__file__).parent / "train_flags.json").read_text())
# what a flag is when the record leaves it out
PLAIN = {"required": False, "min": "None", "max": "None", "is_flag": False, "secondary_opts": [], "help": None}


def flags_of(trainer: str) -> dict[str, dict]:
    command = typer.main.get_command(app).commands["train"].commands[trainer]
    described = {}
    for parameter in command.params:
        flag = {"opts": parameter.opts, "default": repr(parameter.default), "type": str(parameter.bare_type()),
                "help": parameter.help, "required": parameter.required, "min": repr(getattr(parameter, "min", None)),
                "max": repr(getattr(parameter, "max", None)), "is_flag": parameter.is_flag,
                "secondary_opts": parameter.secondary_opts}
        described[parameter.name] = {key: value for key, value in flag.items() if PLAIN.get(key, object()) != value}
    return described


def test_every_trainer_is_there():
    assert set(typer.main.get_command(app).commands["train"].commands) == set(RECORDED)


@pytest.mark.parametrize("trainer", sorted(RECORDED))
def test_a_trainers_flags_are_kept(trainer):
    flags = flags_of(trainer)
    for name, recorded in RECORDED[trainer].items():
        assert flags.get(name) == recorded, f"train {trainer}: flag {name}"


@pytest.mark.parametrize("trainer", sorted(RECORDED))
def test_each_trainer_has_help(trainer):
    result = CliRunner().invoke(app, ["train", trainer, "--help"])
    assert result.exit_code == 0 and "--out" in result.output


def test_a_value_the_config_refuses_ends_the_command_before_any_model_loads(monkeypatch):
    import accelgen.models

    monkeypatch.setattr(accelgen.models, "load_model", lambda *args, **kwargs: pytest.fail("loaded a model"))
    result = CliRunner().invoke(app, ["train", "layerskip", "--out", "unused", "--curriculum", "sideways"])
    assert result.exit_code == 2 and "curriculum must be one of" in result.output and "Traceback" not in result.output


@pytest.mark.parametrize("trainer", sorted(set(RECORDED) - {"online"}))  # online learns while serving requests
def test_every_trainer_scales_out_through_the_shared_loop(trainer):
    flags = flags_of(trainer)
    assert {"mixed_precision", "grad_accum"} <= set(flags), f"train {trainer} lacks the ScaleOut flags"

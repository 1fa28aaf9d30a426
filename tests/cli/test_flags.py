"""Flags generated from dataclasses: names, defaults, types, limits and help from the fields; one instance of
each dataclass for the command."""

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import pytest
import typer
from typer.testing import CliRunner

from accelgen.cli.flags import REQUIRED, Flags, command, flag
from accelgen.errors import InputError


@dataclass
class Run:
    out: Path = flag(REQUIRED, "Where it goes.", "-o")
    threads: Optional[int] = flag(None, "CPU threads.", min=1)
    verbose: bool = flag(False, "Say more.")


@dataclass
class Config:
    steps: int = 200
    learning_rate: float = field(default=1e-3, metadata={"help": "Step size."})

    def __post_init__(self):
        if self.steps < 1:
            raise InputError("steps must be positive")


def invoke(*arguments: str, defaults: Optional[dict] = None):
    seen = []
    app = typer.Typer()
    app.command("run")(command(lambda run, config: seen.append((run, config)), Flags(Run), Flags(Config, defaults or {})))
    app.command("other")(lambda: None)  # two commands: `run` is named on the command line
    return CliRunner().invoke(app, ["run", *arguments]), seen


def test_flags_reach_the_instances_with_their_types():
    result, seen = invoke("-o", "folder", "--threads", "2", "--verbose", "--steps", "5", "--learning-rate", "0.5")
    assert result.exit_code == 0, result.output
    assert seen == [(Run(Path("folder"), 2, True), Config(5, 0.5))]


def test_defaults_are_the_fields_unless_the_command_sets_its_own():
    assert invoke("-o", "x")[1] == [(Run(Path("x"), None, False), Config(200, 1e-3))]
    assert invoke("-o", "x", defaults={"steps": 7})[1][0][1] == Config(7, 1e-3)


def test_help_required_flags_and_limits_come_from_the_fields():
    help_text = invoke("--help")[0].output
    assert all(text in help_text for text in ("--out", "-o", "Where it goes.", "--learning-rate", "Step size."))
    missing = invoke()[0]
    assert missing.exit_code == 2 and "--out" in missing.output
    assert invoke("-o", "x", "--threads", "0")[0].exit_code == 2


def test_a_value_the_dataclass_refuses_ends_the_command_with_its_message():
    result, seen = invoke("-o", "x", "--steps", "0")
    assert result.exit_code == 2 and "steps must be positive" in result.output and not seen


def test_a_flag_declared_twice_is_refused():
    @dataclass
    class Again:
        steps: int = 1

    with pytest.raises(ValueError, match="declared twice"):
        command(lambda *parts: None, Flags(Config), Flags(Again))


def test_a_renamed_flag_keeps_its_old_name_hidden():
    seen = []
    app = typer.Typer()
    app.command("run")(command(lambda config: seen.append(config), Flags(Config, renamed={"steps": "--num-steps"})))
    app.command("other")(lambda: None)
    assert CliRunner().invoke(app, ["run", "--num-steps", "3"]).exit_code == 0
    old = CliRunner().invoke(app, ["run", "--steps", "4"])  # still works, with a note
    assert old.exit_code == 0 and "--steps is now --num-steps" in old.output
    assert seen == [Config(3, 1e-3), Config(4, 1e-3)]
    help_text = CliRunner().invoke(app, ["run", "--help"]).output
    assert "--num-steps" in help_text and "--steps" not in help_text

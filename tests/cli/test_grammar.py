"""One grammar for the command line: every command's parameters walked (a short flag means one thing in every
command, every parameter says what it is, -h is help, help shows flags and arguments as they are typed), method
options in both their forms, and a flag given a value."""

import json
from types import SimpleNamespace

import pytest
import typer.main
from typer.testing import CliRunner

from accelgen.cli import app
from accelgen.method_options import parse_method_options


def walk(command, path=()):
    """(path, command) of the app and of every group and command under it."""
    yield path, command
    for name, sub in getattr(command, "commands", {}).items():
        yield from walk(sub, (*path, name))


COMMANDS = list(walk(typer.main.get_command(app)))
NAMES = [" ".join(path) or "accelgen" for path, _ in COMMANDS]


def options(command):
    return [param for param in command.params if param.param_type_name == "option" and not param.hidden]


def long_name(option) -> str:
    return next(name for name in option.opts if name.startswith("--"))


def test_a_short_flag_means_one_thing_in_every_command():
    meanings = {}  # -o -> {--option: [commands]}
    for path, command in COMMANDS:
        for option in options(command):
            for name in option.opts + option.secondary_opts:
                if not name.startswith("--"):
                    meanings.setdefault(name, {}).setdefault(long_name(option), []).append(" ".join(path))
    assert {short: uses for short, uses in meanings.items() if len(uses) > 1} == {}


def test_every_parameter_says_what_it_is():
    missing = [f"{' '.join(path)} {param.name}" for path, command in COMMANDS for param in command.params
               if not getattr(param, "hidden", False) and not (param.help or "").strip()]
    assert missing == []


def test_the_same_names_mean_the_same_things():
    flags = {(" ".join(path), long_name(option)): option for path, command in COMMANDS for option in options(command)}
    # --heads is a folder of trained heads wherever it is taken; a count of heads has a name of its own
    assert all(str(option.bare_type()) != "int" for (_, name), option in flags.items() if name == "--heads")
    # wherever tokens are generated, -n is their number
    assert all("-n" in option.opts for (_, name), option in flags.items() if name == "--max-new-tokens")
    assert {"train online", "train distillspec"} <= {command for command, name in flags if name == "--max-new-tokens"}
    # the larger model judging SoT's answers and labelling questions for its router
    assert ("bench-sot", "--judge") in flags and ("train sot-router", "--judge") in flags


@pytest.mark.parametrize("path, command", COMMANDS, ids=NAMES)
def test_h_is_help_written_as_people_type_it(path, command):
    result = CliRunner().invoke(app, [*path, "-h"], terminal_width=200)
    assert result.exit_code == 0, result.output
    usage = result.output.strip().splitlines()[0]
    assert usage.startswith("Usage:") and "{" not in usage, usage  # PROMPT, not typer's {prompt}
    assert "<bool>" not in result.output  # --chat is typed without a value


def test_a_flag_given_a_value_is_told_it_takes_none():
    result = CliRunner().invoke(app, ["generate", "--chat", "true", "x"])
    assert result.exit_code == 2
    assert "--chat is a flag" in result.output and "unexpected extra argument" not in result.output


def test_a_plain_option_belongs_to_the_one_method_and_a_dotted_one_names_it():
    assert parse_method_options(["gamma=8", "speculative.gamma_schedule=heuristic"], ["speculative"]) == {
        "speculative": {"gamma": 8, "gamma_schedule": "heuristic"}}
    # variants of one method are still that one method
    assert parse_method_options(["beta=2"], ["specdec@tau=0.5", "specdec"]) == {"specdec": {"beta": 2}}
    with pytest.raises(ValueError, match="several methods .*speculative.gamma=8"):
        parse_method_options(["gamma=8"], ["speculative", "pld"])
    with pytest.raises(ValueError, match="method.name=value"):
        parse_method_options(["gamma=8"])  # the methods are not known yet (bench's default: all that can run)


@pytest.fixture
def generated(monkeypatch):
    """The keyword arguments `accelgen generate` hands accelgen.generate, with no model loaded."""
    import accelgen
    import accelgen.cli.generate as generate_command

    seen = {}
    monkeypatch.setattr(generate_command, "load_target_and_draft", lambda *args, **kwargs: (None, None, None))
    monkeypatch.setattr(accelgen, "generate", lambda *args, **kwargs: seen.update(kwargs) or SimpleNamespace(
        to_dict=lambda: {}))
    return seen


@pytest.mark.parametrize("option", ["max_ngram=2", "pld.max_ngram=2", "pld.max-ngram=2"])
def test_generate_takes_both_forms(generated, option):
    result = CliRunner().invoke(app, ["generate", "--method", "pld", "--dtype", "float32", "-o", option, "--json", "x"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == {} and generated["max_ngram"] == 2


def test_generate_refuses_options_of_a_method_it_does_not_run(generated):
    result = CliRunner().invoke(app, ["generate", "--method", "pld", "-o", "speculative.gamma=8", "x"])
    assert result.exit_code == 2 and "speculative" in result.output and not generated


def test_serve_and_bench_take_a_plain_option_for_their_one_method(monkeypatch):
    def loaded(*args, **kwargs):
        raise SystemExit("options parsed")  # the options passed their checks: stop before a model loads

    monkeypatch.setattr("accelgen.cli.serve.load_target_and_draft", loaded)
    result = CliRunner().invoke(app, ["serve", "--method", "pld", "-o", "max_ngram=2"])
    assert result.exit_code == 1 and "options parsed" in str(result.exception)
    several = CliRunner().invoke(app, ["serve", "--method", "pld", "--allow-methods", "lookahead", "-o", "max_ngram=2"])
    assert several.exit_code == 2 and "pld.max_ngram=2" in several.output

    monkeypatch.setattr("accelgen.cli.bench.load_bench_models", loaded)
    result = CliRunner().invoke(app, ["bench", "-m", "smollm2-135m", "--dataset", "humaneval", "--limit", "1",
                                      "--methods", "pld", "-o", "max_ngram=2"])
    assert "options parsed" in str(result.exception), result.output

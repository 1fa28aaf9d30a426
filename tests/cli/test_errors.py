"""The command line tells bad input from bugs: an input error is one line and exit status 2, before any model
loads where no model is needed to see it; any other exception shows its traceback and exit status 1."""

import subprocess
import sys
import time

import pytest
from typer.testing import CliRunner

import accelgen
from accelgen.cli import app
from accelgen.cli import generate as generate_module
from accelgen.cli import serve as serve_module
from accelgen.models import EMBEDDED_MODELS

runner = CliRunner()


@pytest.fixture(autouse=True)
def no_debug(monkeypatch):
    monkeypatch.delenv("ACCELGEN_DEBUG", raising=False)


@pytest.fixture
def no_loading(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(generate_module, "load_target_and_draft", refuse)
    monkeypatch.setattr(serve_module, "load_target_and_draft", refuse)


def one_error_line(result) -> str:
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2, result.output
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    return lines[0]


@pytest.mark.parametrize("bug", [RuntimeError, TypeError, ValueError, KeyError])
def test_an_internal_error_is_not_reported_as_bad_input(monkeypatch, no_loading, bug):
    def broken(name):
        raise bug("forced bug")

    monkeypatch.setattr(accelgen, "get_method", broken)
    result = runner.invoke(app, ["generate", "hi"])
    assert result.exit_code == 1 and isinstance(result.exception, bug), result.output
    assert "error:" not in result.output


def test_an_internal_error_shows_its_traceback():
    forced = ("import accelgen\n"
              "def broken(name):\n"
              "    raise RuntimeError('forced bug')\n"
              "accelgen.get_method = broken\n"
              "from accelgen.cli import main\n"
              "main()\n")
    result = subprocess.run([sys.executable, "-c", forced, "generate", "hi"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 1, result.stderr
    assert "Traceback" in result.stderr and "RuntimeError: forced bug" in result.stderr


@pytest.mark.parametrize("arguments, message", [
    (["generate", "--method", "speculative", "-d", "tiny", "-o", "no_such_option=1", "hi"], "no_such_option"),
    (["generate", "--method", "warp-drive", "hi"], "warp-drive"),
    (["generate", "--method", "speculative", "hi"], "needs a draft model"),
    (["generate", "-o", "gamma", "hi"], "must look like"),
])
def test_bad_input_is_one_line_and_exit_status_2_before_loading(no_loading, arguments, message):
    assert message in one_error_line(runner.invoke(app, arguments))


def test_a_negative_token_count_is_refused_by_the_flag(no_loading):
    result = runner.invoke(app, ["generate", "-n", "-5", "hi"])
    assert result.exit_code == 2 and "a model was loaded" not in result.output
    assert "--max-new-tokens" in result.output and "Traceback" not in result.output


@pytest.mark.parametrize("how", ["environment", "flag"])
def test_the_debug_switch_shows_an_input_errors_traceback(monkeypatch, no_loading, how):
    if how == "environment":
        monkeypatch.setenv("ACCELGEN_DEBUG", "1")
        arguments = ["generate", "--method", "warp-drive", "hi"]
    else:
        monkeypatch.setenv("ACCELGEN_DEBUG", "")  # monkeypatch restores it: --debug sets it for the process
        arguments = ["--debug", "generate", "--method", "warp-drive", "hi"]
    result = runner.invoke(app, arguments)
    assert result.exit_code == 2, result.output
    assert "Traceback" in result.output and "error: " in result.output and "warp-drive" in result.output


@pytest.mark.parametrize("arguments, message", [
    (["serve", "tiny", "--method", "speculative"], "needs a draft model: pass --draft"),
    (["serve", "tiny", "--method", "autoregressive", "--allow-methods", "speculative"], "needs a draft model"),
    (["serve", "tiny", "-o", "speculative.gamma=x"], "speculative"),
    (["serve", "tiny", "--method", "speculative", "-d", "tiny", "-o", "no_such_option=1"], "no_such_option"),
])
def test_serve_checks_what_needs_no_model_before_loading_one(no_loading, arguments, message):
    assert message in one_error_line(runner.invoke(app, arguments))


def test_serve_refuses_an_unknown_speculative_config_method_in_seconds(no_loading):
    started = time.monotonic()
    line = one_error_line(runner.invoke(app, ["serve", "tiny", "--speculative-config", '{"method": "warp-drive"}']))
    assert "warp-drive" in line and time.monotonic() - started < 3


def test_an_unknown_hub_id_offline_fails_fast_naming_the_embedded_models(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    started = time.monotonic()
    line = one_error_line(runner.invoke(app, ["generate", "--model", "someone/no-such-model", "-n", "2", "hi"]))
    assert time.monotonic() - started < 3
    assert "HF_HUB_OFFLINE" in line and all(name in line for name in EMBEDDED_MODELS)

import json

import pytest
from typer.testing import CliRunner

import accelgen
from accelgen.cli import app

runner = CliRunner()


def test_methods_lists_the_registry():
    result = runner.invoke(app, ["methods", "--json"])
    assert result.exit_code == 0
    methods = {m["name"]: m for m in json.loads(result.stdout)}
    assert methods["speculative"]["needs"] == ["draft_model"]
    assert methods["speculative"]["lossless"] == "distribution-exact"
    assert "gamma" in methods["speculative"]["options"]


def test_models_table(smollm):
    result = runner.invoke(app, ["models"])
    assert result.exit_code == 0
    assert "smollm2-135m" in result.stdout and "qwen2.5-coder-1.5b" in result.stdout


def test_generate_json(smollm):
    result = runner.invoke(app, ["generate", "--model", "smollm2-135m", "--dtype", "float32", "--method", "speculative",
                                 "--draft", "smollm2-135m", "--draft-dtype", "float32", "-o", "gamma=3",
                                 "--max-new-tokens", "8", "--json", "The capital of France is"])
    assert result.exit_code == 0, result.output
    output = json.loads(result.stdout.strip().splitlines()[-1])
    assert 1 <= len(output["token_ids"]) <= 8 and output["text"]
    assert output["stats"]["acceptance_rate"] == 1.0  # its own draft


def test_generate_stream_prints_the_text(smollm):
    result = runner.invoke(app, ["generate", "-m", "smollm2-135m", "--dtype", "float32", "-n", "6", "--stream", "--chat", "Hi"])
    assert result.exit_code == 0, result.output
    assert result.stdout.strip()


def test_generate_errors_are_clear():
    result = runner.invoke(app, ["generate", "--method", "nope", "hello"])
    assert result.exit_code == 2 and "unknown method 'nope'" in result.output
    result = runner.invoke(app, ["generate", "--method", "speculative", "hello"])
    assert result.exit_code == 2 and "needs a draft model" in result.output
    result = runner.invoke(app, ["generate", "-o", "gamma", "hello"])
    assert result.exit_code == 2 and "name=value" in result.output


def test_a_model_that_is_not_there_is_named(tmp_path):
    for missing, message in ((tmp_path / "no-folder", "no model at"), (tmp_path / "model.gguf", "GGUF file not found")):
        for command in (["generate", "-m", str(missing), "hello"], ["profile", "-m", str(missing)]):
            result = runner.invoke(app, command)
            output = " ".join(result.output.split())  # the console wraps long lines
            assert result.exit_code == 2 and message in output and "Traceback" not in output


def test_a_misspelled_model_name_gets_the_embedded_names(monkeypatch):
    for command in (["generate", "-m", "smollm2-135", "hello"], ["profile", "-m", "SmolLM2-135M"]):
        result = runner.invoke(app, command)
        output = " ".join(result.output.split())
        assert result.exit_code == 2 and "did you mean smollm2-135m?" in output and "qwen2.5-coder-1.5b" in output
    # a name far from every embedded one is tried on the hub; when that fails, the embedded names are listed too
    import accelgen.models

    def unreachable_hub(name, **_):
        raise OSError(f"{name} is not a local folder and is not a valid model identifier")

    monkeypatch.setattr(accelgen.models, "load_model", unreachable_hub)
    result = runner.invoke(app, ["generate", "-m", "gpt2", "hello"])
    output = " ".join(result.output.split())
    assert result.exit_code == 2 and "valid model identifier (embedded models: qwen2.5-coder-1.5b" in output


def test_method_options_are_parsed_by_their_type_and_named():
    result = runner.invoke(app, ["generate", "--method", "pld", "-o", "max_ngram=[", "hello"])
    assert result.exit_code == 2 and "pld: max_ngram must be an integer, got '['" in result.output
    assert "Traceback" not in result.output and "not supported between" not in result.output
    from accelgen.method_options import parse_options

    defaults = accelgen.get_method("auto").options
    assert parse_options(["workload=2024"], defaults) == {"workload": "2024"}  # a word, though it reads as a number


@pytest.mark.parametrize("command", [["generate", "--threads", "-1", "hello"], ["profile", "--threads", "0"],
                                     ["serve", "--threads", "-1"], ["serve", "--port", "99999"]])
def test_out_of_range_numbers_are_refused_before_anything_runs(command):
    result = runner.invoke(app, command)
    assert result.exit_code == 2 and "Invalid value for '--" in result.output and "Traceback" not in result.output


def test_docs_method_table_is_the_registry():
    """docs/methods.md's table is `accelgen methods --markdown`: regenerate it when methods change."""
    from pathlib import Path

    import accelgen
    from accelgen.cli.list_methods import methods_markdown

    page = (Path(__file__).parents[2] / "docs" / "methods.md").read_text()
    assert methods_markdown(accelgen.list_methods()) in page


def test_serve_refuses_bad_methods_and_options_before_loading():
    unknown = runner.invoke(app, ["serve", "--method", "warp-drive"])
    assert unknown.exit_code == 2 and "unknown method 'warp-drive'" in unknown.output
    unserved = runner.invoke(app, ["serve", "--method", "pld", "-o", "speculative.gamma=3"])
    assert unserved.exit_code == 2 and "does not serve" in unserved.output
    typo = runner.invoke(app, ["serve", "--method", "pld", "-o", "pld.max_ngramm=3"])
    assert typo.exit_code == 2 and "max_ngramm" in typo.output


def test_loadtest_refuses_remote_servers():
    result = runner.invoke(app, ["loadtest", "--url", "http://example.com:8000", "--dataset", "humaneval", "--limit", "2"])
    assert result.exit_code == 2 and "only targets this machine" in result.output


def test_version():
    from importlib.metadata import version

    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.stdout.strip() == f"accelgen {version('accelgen')}"


@pytest.mark.parametrize("command", [["tune", "auto"], ["calibrate", "calm"]])
def test_an_unknown_dataset_stops_tuning_before_any_model_loads(command, monkeypatch):
    import accelgen.models

    monkeypatch.setattr(accelgen.models, "load_model", lambda *args, **kwargs: pytest.fail("loaded a model"))
    result = runner.invoke(app, [*command, "--dataset", "no-such-set"])
    assert result.exit_code == 2 and "unknown dataset 'no-such-set'" in result.output and "Traceback" not in result.output

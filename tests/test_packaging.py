"""Packaging: the license and type-hint markers, `python -m accelgen --version`, extras out of the core, and
the hint a command gives when its extra is not installed."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import tomllib
from importlib.metadata import PackageNotFoundError, packages_distributions, requires, version
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

import typer
from typer.testing import CliRunner

import accelgen
from accelgen.cli import EXTRA_OF_MODULE, ExtrasHintGroup, missing_extra_hint

ROOT = Path(__file__).parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_license_is_an_spdx_string_with_its_file():
    project = PYPROJECT["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    assert "Apache License" in (ROOT / "LICENSE").read_text() and "Version 2.0" in (ROOT / "LICENSE").read_text()
    assert any(requirement.startswith("setuptools>=77") for requirement in PYPROJECT["build-system"]["requires"])


def test_the_package_declares_its_type_hints():
    assert (Path(accelgen.__file__).parent / "py.typed").is_file()
    assert "py.typed" in PYPROJECT["tool"]["setuptools"]["package-data"]["accelgen"]


def test_gguf_and_accelerate_are_extras_not_core():
    core = " ".join(PYPROJECT["project"]["dependencies"])
    extras = PYPROJECT["project"]["optional-dependencies"]
    assert "gguf" not in core and "accelerate" not in core
    assert {"gguf>=0.10", "accelerate"} <= set(extras["gguf"])
    assert "accelgen[gguf]" in extras["models"] and "accelgen[gguf]" in extras["llamacpp"]


def core_distributions() -> set[str]:
    """The core dependencies and everything they need in turn (extras of theirs left out), as installed here."""
    seen, waiting = set(), [Requirement(line).name for line in PYPROJECT["project"]["dependencies"]]
    while waiting:
        name = canonicalize_name(waiting.pop())
        if name in seen:
            continue
        seen.add(name)
        try:
            needs = requires(name) or []
        except PackageNotFoundError:
            continue
        unconditional = [req for req in map(Requirement, needs) if req.marker is None or req.marker.evaluate({"extra": ""})]
        waiting += [req.name for req in unconditional]
    return seen


def imported_modules(folder: Path) -> set[str]:
    """Top-level names of the modules the package's code imports (absolute imports, lazy ones included)."""
    names = set()
    for path in folder.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names |= {alias.name.partition(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names.add(node.module.partition(".")[0])
    return names


def test_every_import_outside_the_core_belongs_to_a_known_extra():
    """A module the code imports that `pip install accelgen` does not bring gets the hint of its extra: each one
    is in EXTRA_OF_MODULE, and that extra lists a distribution providing it."""
    core = core_distributions()
    providers = packages_distributions()
    optional = {name for name in imported_modules(Path(accelgen.__file__).parent) - set(sys.stdlib_module_names)
                if name not in ("accelgen", "__future__")
                and not {canonicalize_name(dist) for dist in providers.get(name, [])} & core}
    assert optional - set(EXTRA_OF_MODULE) == set()
    extras = PYPROJECT["project"]["optional-dependencies"]
    for name in optional & set(providers):  # installed here: its distribution is known
        listed = {canonicalize_name(Requirement(line).name) for line in extras[EXTRA_OF_MODULE[name]]}
        assert {canonicalize_name(dist) for dist in providers[name]} & listed, name


def test_python_m_accelgen_prints_the_installed_version():
    result = subprocess.run([sys.executable, "-m", "accelgen", "--version"], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"accelgen {version('accelgen')}" == f"accelgen {accelgen.__version__}"


def test_a_missing_extra_is_named_and_other_missing_modules_are_not_hidden():
    app = typer.Typer(cls=ExtrasHintGroup)

    @app.command()
    def serve():
        raise ModuleNotFoundError("No module named 'fastapi.responses'", name="fastapi.responses")

    @app.command()
    def broken():
        raise ModuleNotFoundError("No module named 'accelgen.nowhere'", name="accelgen.nowhere")

    result = CliRunner().invoke(app, ["serve"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "accelgen serve needs the server extra: pip install 'accelgen[server]'" in result.output
    result = CliRunner().invoke(app, ["broken"])
    assert isinstance(result.exception, ModuleNotFoundError)  # a bug, not a missing extra: its traceback stays
    assert missing_extra_hint("x", ModuleNotFoundError(name="accelgen.nowhere")) is None


BLOCKED_EXTRAS = sorted(EXTRA_OF_MODULE)
# A fresh interpreter where no extra is installed (sys.modules[name] = None makes `import name` fail); runs each
# command through the `accelgen` entry point and reports its exit code and output.
WITHOUT_EXTRAS = """
import contextlib, io, json, sys
for name in {blocked}:
    sys.modules[name] = None
from accelgen.cli import main
results = []
for arguments in {commands}:
    sys.argv = ["accelgen", *arguments]
    output = io.StringIO()
    with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
        try:
            main()
            code = 0
        except SystemExit as exit:
            code = exit.code
    results.append([code, output.getvalue()])
print(json.dumps(results))
"""


def test_commands_of_a_missing_extra_say_which_extra_to_install(tmp_path):
    commands = [["--help"], ["serve", "--help"], ["serve", "-m", "x"], ["loadtest", "--limit", "1"],
                ["bench", "-m", "x", "--dataset", "humaneval"], ["bench-report", str(tmp_path)],
                ["tune", "self-speculative"], ["models", "--install", "smollm2-135m"]]
    script = WITHOUT_EXTRAS.format(blocked=BLOCKED_EXTRAS, commands=commands)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr
    outcomes = [(code, " ".join(output.split())) for code, output in json.loads(result.stdout.splitlines()[-1])]
    assert len(outcomes) == len(commands)
    assert outcomes[0][0] == 0 and "serve" in outcomes[0][1]  # the CLI itself needs no extra
    assert outcomes[1][0] == 0 and "--max-batch" in outcomes[1][1]
    expected = ["accelgen serve needs the server extra: pip install 'accelgen[server]'",
                "accelgen loadtest needs the server extra: pip install 'accelgen[server]'",
                "accelgen bench needs the bench extra: pip install 'accelgen[bench]'",
                "accelgen bench-report needs the bench extra: pip install 'accelgen[bench]'",
                "accelgen tune needs the tune extra: pip install 'accelgen[tune]'",
                "accelgen models needs the gguf extra: pip install 'accelgen[gguf]'"]
    for (code, output), hint in zip(outcomes[2:], expected):
        assert code == 2 and hint in output and "Traceback" not in output, output

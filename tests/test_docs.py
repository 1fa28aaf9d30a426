"""The documentation: the site builds with `mkdocs build --strict`, the README's links lead somewhere, every
`accelgen ...` command shown in the README and docs/ parses with the current command line, every ACCELGEN_*
environment variable read is listed, and the pages state the near-tie definition of accelgen/bench/near_tie.py.

A strict build fails on a page missing from the nav's targets, a broken link or anchor between pages, a link to a
benchmark report or plot that is not in the repository, and an API reference entry that no longer resolves.
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
LINK = re.compile(r"\]\(([^)\s]+)\)")  # Markdown link and image targets


def relative_links(markdown: str) -> list[str]:
    """The targets of links that point into the repository (no scheme, not a bare anchor)."""
    return [target for target in LINK.findall(markdown) if "://" not in target and not target.startswith("#")]


def test_relative_links_are_found_in_markdown():
    text = "See [a](docs/a.md#x), ![p](benchmarks/r/p.png), [web](https://example.org) and [here](#top)."
    assert relative_links(text) == ["docs/a.md#x", "benchmarks/r/p.png"]


def test_every_relative_link_of_the_readme_exists():
    readme = (ROOT / "README.md").read_text()
    missing = [target for target in relative_links(readme) if not (ROOT / target.split("#")[0]).exists()]
    assert relative_links(readme) and not missing, f"README.md links to files that do not exist: {missing}"


def test_the_site_builds_strictly(tmp_path):
    for module in ("mkdocs", "material", "mkdocstrings_handlers"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed: pip install -e '.[docs]' to build the site")
    site = tmp_path / "site"
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                            cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stderr[-6000:]}"
    assert (site / "methods" / "index.html").is_file()
    api = (site / "api" / "index.html").read_text()
    assert "load_model" in api and "list_methods" in api  # the reference was generated from the docstrings
    copied_plot = site / "benchmarks" / "runtime-qwen1.5b-specbench-avx512bf16" / "speedup.png"
    assert copied_plot.is_file()  # docs/hooks.py copied the benchmark plots the pages embed


# Every `accelgen ...` command that the README and the docs show parses with the current command line.
DOC_PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^\s*(```|~~~)\s*(\w*)")
INLINE_COMMAND = re.compile(r"`(accelgen [^`]+)`")
SHELL_BREAKS = {"&&", "||", "|", ";", "&", ">", ">>", "2>", "2>&1", "<"}
ELISIONS = ("...", "…")  # `accelgen bench ... --dataset sharegpt`: the options shown before
PLACEHOLDER = re.compile(r"[A-Z][A-Z0-9_]*|<[^>]+>")  # `--limit N`, `--out DIR`, `<file>`: a value of any type
ALTERNATIVES = re.compile(r"[a-z0-9-]+(?:[|/][a-z0-9-]+)+")  # `accelgen train medusa|eagle`, `export vllm/sglang`


@dataclass(frozen=True)
class DocumentedCommand:
    where: str  # file:line
    arguments: tuple[str, ...]  # after `accelgen`
    complete: bool  # False for a mention (inline code, or a command with parts left out: `...`, `$COMMON`): it may
    #                 leave out required parameters, and the value of an option it ends with


def splits(line: str) -> bool:
    """Whether shlex can split line (a quote left open goes on over the next line)."""
    try:
        shlex.split(line, comments=True)
    except ValueError:
        return False
    return True


def shell_lines(markdown: str) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """(line number, line) of the shell code blocks (any but python), a command going on over several lines (after
    a backslash, or inside quotes) joined into one; and of the prose."""
    code, prose, language, pending = [], [], None, None
    for number, line in enumerate(markdown.splitlines(), 1):
        fence = FENCE.match(line)
        if fence:
            if pending:
                code.append(pending)
            language, pending = None if language is not None else fence.group(2) or "shell", None
        elif language is None:
            prose.append((number, line))
        elif language != "python":
            line = line.rstrip()
            if pending is None:
                pending = (number, line)
            elif pending[1].endswith("\\"):
                pending = (pending[0], pending[1][:-1] + " " + line.strip())
            else:
                pending = (pending[0], pending[1] + "\n" + line)
            if not pending[1].endswith("\\") and splits(pending[1]):
                code.append(pending)
                pending = None
    return code, prose


def commands_in(line: str) -> list[tuple[list[str], bool]]:
    """The `accelgen` commands a shell line runs (at its start, after a shell operator, an environment assignment,
    `env` or `-m`), each up to the next shell operator: (arguments, whether nothing is left out)."""
    if "accelgen" not in line:
        return []
    try:
        tokens = shlex.split(line, comments=True)
    except ValueError:  # a quote left open: no shell line (a file tree's apostrophe), unless it starts a command
        if line.lstrip().startswith("accelgen "):
            raise
        return []
    found = []
    for index, token in enumerate(tokens):
        before = tokens[index - 1] if index else None
        at_command = (before is None or before in SHELL_BREAKS or before in ("-m", "env", "time")
                      or re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", before) is not None)
        if token == "accelgen" and at_command:
            arguments = list(itertools.takewhile(lambda argument: argument not in SHELL_BREAKS, tokens[index + 1:]))
            found.append((arguments, not any(left_out(argument) for argument in arguments)))
    return found


def left_out(argument: str) -> bool:
    """An elision (`...`) or a shell variable (`$COMMON`): arguments the page does not show."""
    return argument in ELISIONS or argument.startswith("$")


def as_written(arguments: list[str]) -> list[list[str]]:
    """The command lines that arguments stand for: `train medusa|eagle` one for each command named, `[--draft D]`
    with the optional part given."""
    plain = []
    for argument in arguments:
        if argument.startswith("[-"):  # `[--draft D]`: an optional part, given
            argument = argument[1:]
        if argument.endswith("]") and "[" not in argument:
            argument = argument[:-1]
        plain.append(argument)
    choices, in_path = [], True  # the command path: the words before the first option
    for argument in plain:
        in_path = in_path and not argument.startswith("-")
        alternatives = in_path and ALTERNATIVES.fullmatch(argument)
        choices.append(argument.replace("/", "|").split("|") if alternatives else [argument])
    return [list(line) for line in itertools.product(*choices)]


def documented_commands(pages: list[Path] = DOC_PAGES) -> list[DocumentedCommand]:
    """Every `accelgen ...` command in the pages' (the README's and the docs') shell blocks and inline code."""
    found = []
    for page in pages:
        code, prose = shell_lines(page.read_text())
        inline = [(number, command) for number, line in prose for command in INLINE_COMMAND.findall(line)]
        for number, line in code + inline:
            where = f"{Path(os.path.relpath(page, ROOT)).as_posix()}:{number}"
            try:
                commands = commands_in(line)
            except ValueError as error:
                commands = [([f"<cannot be split: {error}>"], True)]
            for arguments, whole in commands:
                found += [DocumentedCommand(where, tuple(written), whole and (number, line) in code)
                          for written in as_written(arguments)]
    return found


@functools.cache
def command_line():
    """The click command behind `accelgen`."""
    import typer

    from accelgen.cli import app

    return typer.main.get_command(app)


def parse_problem(arguments: list[str] | tuple[str, ...], complete: bool = True) -> str | None:
    """None when `accelgen ARGUMENTS` parses with the current command line (nothing is run); else the usage
    error's message. A mention (complete=False) may leave out required parameters and a last option's value."""
    import typer

    command = command_line()
    try:
        context = command.make_context("accelgen", list(arguments), resilient_parsing=False)
        while hasattr(command, "resolve_command") and subcommand_arguments(context):
            if left_out(subcommand_arguments(context)[0]):
                return None  # `accelgen train … --out DIR`: the command itself is left out
            name, command, rest = command.resolve_command(context, subcommand_arguments(context))
            if not hasattr(command, "resolve_command"):  # the command itself: check what the page shows
                rest = [argument for argument in rest if not left_out(argument)]
            context = command.make_context(name, rest, parent=context, resilient_parsing=False)
    except typer.Exit:
        return None  # --help, --version
    except Exception as error:  # click's, or typer's own copy of click's, usage errors
        kind, option = type(error).__name__, getattr(getattr(error, "param", None), "opts", [])
        if kind == "NoArgsIsHelpError" or (not complete and kind == "MissingParameter"):
            return None  # `accelgen train` alone shows the group's help; a mention may leave out what is required
        if not complete and "requires an argument" in str(error):
            return None  # `--out` mentioned at the end, without its value
        values = [value for name, value in zip(arguments, arguments[1:]) if name in option]
        if kind == "BadParameter" and values and all(PLACEHOLDER.fullmatch(value) for value in values):
            return None  # `--limit N`: a placeholder for a number
        if hasattr(error, "format_message"):
            return error.format_message()
        raise
    return None


def subcommand_arguments(context) -> list[str]:
    """What a group's context left for its subcommand: the subcommand's name and its arguments."""
    protected = getattr(context, "_protected_args", None)
    return [*(context.protected_args if protected is None else protected), *context.args]


@pytest.fixture
def a_gpu(monkeypatch):
    """torch sees a CUDA device, so that `--device cuda` parses as it does on a GPU machine."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


def test_a_wrong_command_or_flag_does_not_parse():
    assert parse_problem(["generate", "--model", "MODEL", "<prompt>"]) is None  # placeholders are strings
    assert parse_problem(["generate", "--help"]) is None and parse_problem(["--version"]) is None
    assert "No such option: --no-such-flag" in parse_problem(["generate", "--no-such-flag", "x"])
    assert "No such command" in parse_problem(["no-such-command"])
    assert parse_problem(["bench", "--model", "M", "--limit", "many"]) is not None  # not an integer
    assert "Missing" in parse_problem(["generate", "--model", "M"])  # a command shown whole needs its prompt
    assert parse_problem(["generate", "--model"], complete=False) is None  # a mention of the option
    assert parse_problem(["generate", "--no-such-flag"], complete=False) is not None
    assert parse_problem(["bench", "--model", "M", "--limit", "N"]) is None  # a placeholder for a number


def test_commands_are_found_in_shell_blocks_and_inline_code():
    page = """Run `accelgen methods --json`, `accelgen train medusa|eagle --out` or:

```bash
FOO=1 accelgen bench ... --dataset sharegpt \\
    --limit 40 | tee log   # a comment
python -m accelgen --version && accelgen generate "two
lines" [--chat]
pip install accelgen
```

```python
accelgen = "not a command"
```
"""
    code, prose = shell_lines(page)
    found = [(arguments, whole) for _, line in code for arguments, whole in commands_in(line)]
    assert found == [(["bench", "...", "--dataset", "sharegpt", "--limit", "40"], False), (["--version"], True),
                     (["generate", "two\nlines", "[--chat]"], True)]
    assert as_written(found[2][0]) == [["generate", "two\nlines", "--chat"]]
    inline = [command for _, line in prose for command in INLINE_COMMAND.findall(line)]
    assert inline == ["accelgen methods --json", "accelgen train medusa|eagle --out"]
    assert as_written(commands_in(inline[1])[0][0]) == [["train", "medusa", "--out"], ["train", "eagle", "--out"]]


def refused(commands: list[DocumentedCommand]) -> list[str]:
    """"file:line: accelgen ARGUMENTS" and the reason, for each command the current command line refuses."""
    return [f"{command.where}: accelgen {shlex.join(command.arguments)}\n    {problem}" for command in commands
            if (problem := parse_problem(command.arguments, command.complete)) is not None]


def test_a_wrong_flag_planted_in_a_page_is_reported(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("Try `accelgen bench --methodz pld`.\n\n```bash\naccelgen generate -m M --chat \"hi\"\n"
                    "accelgen generate -m M --no-such-flag \"hi\"\n```\n")
    problems = "\n".join(refused(documented_commands([page])))
    assert "page.md:1: accelgen bench --methodz pld\n    No such option: --methodz" in problems
    assert "page.md:5: accelgen generate -m M --no-such-flag hi\n    No such option: --no-such-flag" in problems
    assert "page.md:4" not in problems


def test_every_documented_command_parses(a_gpu):
    commands = documented_commands()
    assert len(commands) > 100  # the README's and the docs' commands were found
    broken = refused(commands)
    assert not broken, "commands in the docs that the current command line refuses:\n" + "\n".join(broken)


# Every ACCELGEN_* environment variable that accelgen, its scripts or its tests read is in one table of the docs.
ENVIRONMENT_PAGE = ROOT / "docs" / "getting-started.md"
QUOTED_VARIABLE = re.compile(r"[\"'](ACCELGEN_[A-Z0-9_]+)[\"']")  # os.environ.get("..."), envvar="...", setenv
SHELL_VARIABLE = re.compile(r"\b(ACCELGEN_[A-Z0-9_]+)=")  # VARIABLE=value in a shell script or command


def variables_read() -> dict[str, str]:
    """Each ACCELGEN_* variable named in quotes or set in the code, scripts and tests -> a file that names it."""
    files = [*(ROOT / "accelgen").rglob("*.py"), *(ROOT / "scripts").iterdir(), *(ROOT / "tests").rglob("*.py")]
    found = {}
    for path in sorted(files):
        if path.is_file() and path.suffix in (".py", ".sh"):
            text = path.read_text()
            for name in QUOTED_VARIABLE.findall(text) + SHELL_VARIABLE.findall(text):
                found.setdefault(name, path.relative_to(ROOT).as_posix())
    return found


def variables_listed() -> set[str]:
    """The variables of the table under "## Environment variables"."""
    section = ENVIRONMENT_PAGE.read_text().split("## Environment variables", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `(ACCELGEN_[A-Z0-9_]+)` \|", section, flags=re.M))


def test_every_environment_variable_is_documented():
    read, listed = variables_read(), variables_listed()
    assert "ACCELGEN_LLAMACPP_LOG" in read and "ACCELGEN_CACHE" in read  # the search finds them
    missing = {name: path for name, path in read.items() if name not in listed}
    assert not missing, f"read in the code but not in {ENVIRONMENT_PAGE.name}'s Environment variables: {missing}"
    assert not listed - set(read), f"listed but read nowhere: {sorted(listed - set(read))}"


# One definition of a near-tie (accelgen/bench/near_tie.py), used by the audit and scripts/gpu_audit.py, stated by
# the docs.
STATED_TIE = re.compile(r"(?:a gap of at most|within) \[?(\d+) (?:bf16 )?ulps of the best logit")


def test_the_docs_state_the_near_tie_definition_of_the_code():
    from accelgen.bench.near_tie import LLAMACPP_TIE, TIE_ULPS

    benchmark = " ".join((ROOT / "docs" / "benchmark.md").read_text().split())
    assert f"The tolerance is **{TIE_ULPS} ulps of the best logit's magnitude in the model's dtype**" in benchmark
    assert f"the tolerance is **{LLAMACPP_TIE} logit**" in benchmark
    stated = [(page.name, int(ulps)) for page in DOC_PAGES
              for ulps in STATED_TIE.findall(" ".join(page.read_text().split()))]
    assert len(stated) >= 4 and all(ulps == TIE_ULPS for _, ulps in stated), stated
    for user in ("accelgen/bench/audit.py", "scripts/gpu_audit.py"):
        assert "from accelgen.bench.near_tie import" in (ROOT / user).read_text(), f"{user} has its own near-tie"

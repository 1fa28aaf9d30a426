"""Every folder under benchmarks/ keeps a run record in its README.md, so each published figure can be traced to
the exact command, the machine it ran on, whether other work shared that machine, and the raw output it comes from.

The record is a "## Run record" section of bullet fields, each `- name: value`; a value may go on over the
following lines (a code block holding several commands, say):

    ## Run record

    - command: `accelgen bench --model smollm2-135m ... --out benchmarks/<folder>`
    - machine: AMD EPYC; flags: avx2 fma f16c (no native bf16); 2 logical cores; Linux x86_64
    - threads: 2 torch threads
    - torch: 2.13.0+cpu (transformers 5.23.0, Python 3.11.7)
    - shared: not recorded
    - raw output: `records.jsonl` (per prompt and method), `run.json` (settings and machine)

A fact the run did not record is written "not recorded", never guessed. `shared` answers yes, no, not recorded or
not applicable (a folder of input data), with any detail after it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
RECORD_FILE = "README.md"
RECORD_HEADING = "## Run record"
FIELDS = ("command", "machine", "threads", "torch", "shared", "raw output")
SHARED_ANSWERS = ("yes", "no", "not recorded", "not applicable")
FIELD_LINE = re.compile(r"^- ([a-z][a-z ]*):(.*)$")
CODE_SPAN = re.compile(r"`([^`\n]+)`")


def benchmark_folders(root: Path = BENCHMARKS) -> list[Path]:
    return sorted(path for path in root.iterdir() if path.is_dir() and not path.name.startswith((".", "__")))


def record_section(text: str) -> list[str] | None:
    """The lines of the "## Run record" section (None when there is none); a heading inside a code block does not
    end it."""
    lines = text.splitlines()
    if RECORD_HEADING not in (line.rstrip() for line in lines):
        return None
    start = [line.rstrip() for line in lines].index(RECORD_HEADING) + 1
    section, fenced = [], False
    for line in lines[start:]:
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,2} ", line):
            break
        section.append(line)
    return section


def record_fields(section: list[str]) -> dict[str, str]:
    """name -> value of each `- name: value` field, its continuation lines (code blocks too) included."""
    fields: dict[str, list[str]] = {}
    current, fenced = None, False
    for line in section:
        match = None if fenced else FIELD_LINE.match(line)
        if line.lstrip().startswith("```"):
            fenced = not fenced
        if match:
            current = match.group(1).strip()
            fields[current] = [match.group(2)]
        elif current is not None:
            fields[current].append(line)
    return {name: "\n".join(value).strip() for name, value in fields.items()}


def record_problems(folder: Path) -> list[str]:
    """What the folder's run record lacks; empty when it is complete."""
    readme = folder / RECORD_FILE
    if not readme.is_file():
        return [f"{folder.name}: no {RECORD_FILE} with a '{RECORD_HEADING}' section"]
    section = record_section(readme.read_text(encoding="utf-8"))
    if section is None:
        return [f"{folder.name}/{RECORD_FILE}: no '{RECORD_HEADING}' section"]
    fields = record_fields(section)
    problems = [f"{folder.name}: the run record has no '{name}' field, or it is empty"
                for name in FIELDS if not fields.get(name)]
    command = fields.get("command", "")
    if command and "`" not in command and not command.lower().startswith("not applicable"):
        problems.append(f"{folder.name}: the command is not given in backticks or a code block")
    shared = fields.get("shared", "")
    if shared and not shared.lower().startswith(SHARED_ANSWERS):
        problems.append(f"{folder.name}: 'shared' must start with one of {', '.join(SHARED_ANSWERS)}, not {shared!r}")
    problems += raw_output_problems(folder, fields.get("raw output", ""))
    return problems


def raw_output_problems(folder: Path, raw_output: str) -> list[str]:
    """Every path the raw output field names in backticks must exist in the folder, and it must name one."""
    if not raw_output:
        return []
    named = [name for name in CODE_SPAN.findall(raw_output) if not re.search(r"\s", name)]
    missing = [name for name in named if not (folder / name).exists()]
    problems = [f"{folder.name}: raw output names {name}, which is not in the folder" for name in missing]
    if not named:
        problems.append(f"{folder.name}: the raw output field names no file of the folder in backticks")
    return problems


def test_the_benchmarks_folder_is_found():
    assert len(benchmark_folders()) > 10


@pytest.mark.parametrize("folder", benchmark_folders(), ids=lambda path: path.name)
def test_every_benchmark_folder_has_its_run_record(folder):
    assert record_problems(folder) == []


COMPLETE = """# A run

Some reading.

## Run record

- command:

  ```bash
  accelgen bench --model smollm2-135m --out benchmarks/x
  # the same with --dataset sharegpt
  ```

- machine: AMD EPYC; flags: avx2 fma f16c; 2 logical cores
- threads: 2 torch threads
- torch: 2.13.0+cpu
- shared: no (nothing else ran)
- raw output: `records.jsonl` (per prompt), `run/` (the machine)

## Afterwards

- command: not part of the record
"""


def folder_with(tmp_path: Path, readme: str | None, files=("records.jsonl", "run/machine.txt")) -> Path:
    folder = tmp_path / "a-run"
    folder.mkdir(parents=True)
    for name in files:
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text("{}\n")
    if readme is not None:
        (folder / RECORD_FILE).write_text(readme)
    return folder


def test_a_complete_record_passes_and_keeps_its_code_block(tmp_path):
    folder = folder_with(tmp_path, COMPLETE)
    assert record_problems(folder) == []
    fields = record_fields(record_section(COMPLETE))
    assert "# the same with --dataset sharegpt" in fields["command"]
    assert fields["shared"] == "no (nothing else ran)"


def test_a_new_folder_without_a_record_fails(tmp_path):
    folder = folder_with(tmp_path, None)
    assert record_problems(folder) == ["a-run: no README.md with a '## Run record' section"]
    (folder / RECORD_FILE).write_text("# A run\n\n- command: `accelgen bench`\n")
    assert record_problems(folder) == ["a-run/README.md: no '## Run record' section"]


@pytest.mark.parametrize("field", FIELDS)
def test_a_missing_or_empty_field_is_named(tmp_path, field):
    without = "\n".join(line for line in COMPLETE.splitlines() if not line.startswith(f"- {field}:"))
    assert f"a-run: the run record has no '{field}' field, or it is empty" in record_problems(
        folder_with(tmp_path, without))
    emptied = "\n".join(f"- {field}:  " if line.startswith(f"- {field}:") else line for line in COMPLETE.splitlines())
    if field == "command":  # its value is the code block below the line: empty it too
        emptied = re.sub(r"```bash\n.*?```\n", "", emptied, flags=re.S)
    assert f"a-run: the run record has no '{field}' field, or it is empty" in record_problems(
        folder_with(tmp_path / "empty", emptied))


def test_a_field_after_the_section_does_not_count(tmp_path):
    moved = COMPLETE.replace("- command:\n", "- note:\n")
    assert "a-run: the run record has no 'command' field, or it is empty" in record_problems(
        folder_with(tmp_path, moved))


def test_shared_must_answer_the_question(tmp_path):
    vague = COMPLETE.replace("- shared: no (nothing else ran)", "- shared: probably quiet")
    assert any("'shared' must start with" in problem for problem in record_problems(folder_with(tmp_path, vague)))


def test_a_command_in_prose_is_refused(tmp_path):
    prose = re.sub(r"- command:\n\n  ```bash\n.*?```\n", "- command: the usual bench command\n", COMPLETE,
                   flags=re.S)
    assert "a-run: the command is not given in backticks or a code block" in record_problems(
        folder_with(tmp_path, prose))


def test_the_raw_output_must_be_in_the_folder(tmp_path):
    assert "a-run: raw output names run/, which is not in the folder" in record_problems(
        folder_with(tmp_path, COMPLETE, files=("records.jsonl",)))
    unnamed = COMPLETE.replace("- raw output: `records.jsonl` (per prompt), `run/` (the machine)",
                               "- raw output: the records")
    assert "a-run: the raw output field names no file of the folder in backticks" in record_problems(
        folder_with(tmp_path / "unnamed", unnamed))

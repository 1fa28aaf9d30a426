"""The code-summarisation corpus: Python functions mined from installed source files, each paired with the first
line of its docstring, split by package so that no code of the test set was seen in training.

An example's input is the function's source with its docstring cut out (decorators, signature and body kept,
dedented); its output is the docstring's first line, kept only when it reads as a one-line sentence. Identical
function sources are kept once, so a function copied into two packages cannot sit on both sides of a split.

Mining the standard library and site-packages takes minutes; `cached_corpus` mines once and keeps the result as
a JSONL file named by what was mined (written whole or not at all: accelgen/atomic.py).
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import random
import re
import sysconfig
import warnings
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from accelgen.atomic import read_checked, write_text_atomically
from accelgen.errors import InputError

# Folders never mined: tests (code written to exercise other code, often with copied docstrings), vendored
# copies of other packages (the same code under two names would leak across the split), caches and metadata.
SKIPPED_FOLDERS = {"test", "tests", "testing", "idle_test", "__pycache__", "_vendor", "vendor", "vendored",
                   "_vendored", "site-packages", "dist-packages", "node_modules"}
SKIPPED_SUFFIXES = (".dist-info", ".egg-info")
MAX_FILE_BYTES = 1_000_000  # generated tables, not code anyone summarises
MIN_SUMMARY_WORDS, MAX_SUMMARY_WORDS = 3, 20
# first lines that are not a summary: placeholders, parameter sections, doctests, signatures ("f(x) -> int")
NOT_A_SUMMARY = re.compile(r"^(todo|fixme|xxx|deprecated|args?:|arguments?:|param|parameters?\b|returns?:|"
                           r"see\b|:|>>>|\.\. |@)|->|^[\w.]+\(.*\)", re.IGNORECASE)
MINER_VERSION = 1  # part of a cache file's name: a change to what is mined must not read an old cache


@dataclass(frozen=True)
class Example:
    package: str  # the top-level folder (or module) under its root: the unit of the split
    path: str  # the file, relative to its root
    name: str  # qualified name within the file: "Class.method", "outer.inner"
    source: str  # the function without its docstring, dedented
    summary: str  # the docstring's first line


# --- mining --------------------------------------------------------------------------------------------------


def default_roots() -> list[Path]:
    """The standard library's folder and site-packages (sysconfig's "stdlib" and "purelib"), those that exist."""
    paths = sysconfig.get_paths()
    roots = []
    for key in ("stdlib", "purelib"):
        root = Path(paths[key])
        if root.is_dir() and root not in roots:
            roots.append(root)
    return roots


def mine_functions(roots: list[Path], max_source_chars: int = 3000, packages: set[str] | None = None,
                   workers: int = 1) -> list[Example]:
    """Every function and method under roots whose docstring starts with a one-line summary, its source (without the
    docstring) at most max_source_chars long; only the given packages, when named. Deterministic: files in sorted
    order, each function source kept once (its first occurrence). workers > 1 parses files in that many processes
    (parsing is nearly all the time: site-packages holds hundreds of MB of Python); the result is the same."""
    jobs = []  # (path, root, package, max_source_chars) of each file, in order
    for root in map(Path, roots):
        for path in python_files(root):
            package = path.relative_to(root).parts[0].removesuffix(".py")
            if packages is None or package in packages:
                jobs.append((path, root, package, max_source_chars))
    if workers > 1:
        with ProcessPoolExecutor(workers) as pool:
            per_file = list(pool.map(file_examples, *zip(*jobs), chunksize=16)) if jobs else []
    else:
        per_file = [file_examples(*job) for job in jobs]
    examples, seen_sources = [], set()
    for example in (example for found in per_file for example in found):
        if example.source not in seen_sources:
            seen_sources.add(example.source)
            examples.append(example)
    return examples


def python_files(root: Path) -> list[Path]:
    """The .py files under root, in sorted order, without tests, vendored copies and metadata folders."""
    found = []
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = sorted(name for name in subfolders if not skipped_folder(name))
        found += [Path(folder) / name for name in sorted(files) if name.endswith(".py") and not is_test_file(name)]
    return found


def skipped_folder(name: str) -> bool:
    return name in SKIPPED_FOLDERS or name.endswith(SKIPPED_SUFFIXES) or name.startswith(".")


def is_test_file(name: str) -> bool:
    return name.startswith("test_") or name.endswith("_test.py") or name == "conftest.py"


def file_examples(path: Path, root: Path, package: str, max_source_chars: int) -> list[Example]:
    """The examples of one file; none when it cannot be read or parsed (Python 2 files, other encodings)."""
    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            return []
        text = path.read_text(encoding="utf-8")
        with warnings.catch_warnings():  # invalid escape sequences in old files: not ours to report
            warnings.simplefilter("ignore")
            tree = ast.parse(text)
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
        return []
    lines = text.splitlines(keepends=True)
    relative = path.relative_to(root).as_posix()
    examples = []
    for name, node in named_functions(tree):
        summary = summary_line(ast.get_docstring(node, clean=True))
        source = source_without_docstring(lines, node) if summary else None
        if source is not None and len(source) <= max_source_chars:
            examples.append(Example(package, relative, name, source, summary))
    return examples


def named_functions(tree: ast.AST, prefix: str = ""):
    """(qualified name, node) of every function and method in tree, nested ones included, in source order."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = prefix + node.name
            if not isinstance(node, ast.ClassDef):
                yield name, node
            yield from named_functions(node, name + ".")
        elif isinstance(node, (ast.stmt, ast.excepthandler, ast.match_case)):  # an if, try, with...: look inside
            yield from named_functions(node, prefix)  # (expressions cannot hold a def: not walked, for speed)


def summary_line(docstring: str | None) -> str | None:
    """The docstring's first line when it is a one-line sentence of 3 to 20 words, else None. A first line that
    the second continues (no blank line between, no full stop) is half a sentence and not kept."""
    if not docstring:
        return None
    lines = docstring.splitlines()
    first = lines[0].strip()
    continued = len(lines) > 1 and lines[1].strip() and not first.endswith((".", "!", "?"))
    words = first.split()
    if continued or not MIN_SUMMARY_WORDS <= len(words) <= MAX_SUMMARY_WORDS:
        return None
    if not first[0].isalpha() or NOT_A_SUMMARY.search(first) or not first.isprintable():
        return None
    return first


def source_without_docstring(lines: list[str], node: ast.FunctionDef | ast.AsyncFunctionDef) -> str | None:
    """The function's lines (decorators included) without its docstring's lines, dedented by the function's own
    indentation; None when the docstring shares a line with code or is all the body holds (nothing to summarise)."""
    docstring = node.body[0]
    if len(node.body) == 1:
        return None
    start = min([node.lineno] + [decorator.lineno for decorator in node.decorator_list]) - 1  # 0-based
    doc_first, doc_last = docstring.lineno - 1, docstring.end_lineno - 1
    alone = (lines[doc_first][:docstring.col_offset].strip() == ""
             and lines[doc_last][docstring.end_col_offset:].strip() == "" and node.body[1].lineno - 1 > doc_last)
    if not alone or doc_first <= start:
        return None
    kept = lines[start:doc_first] + lines[doc_last + 1:node.end_lineno]
    indent = lines[node.lineno - 1][:node.col_offset]
    # only lines that carry the indentation lose it: the continuation lines of a multi-line string stay as written
    return "".join(line[len(indent):] if line.startswith(indent) else line for line in kept).rstrip() + "\n"


# --- splitting -----------------------------------------------------------------------------------------------


def split_by_package(examples: list[Example], held_out_fraction: float = 0.1,
                     seed: int = 0) -> tuple[list[Example], list[Example], list[Example]]:
    """(train, valid, test): whole packages in a seeded random order fill the test split until it holds
    held_out_fraction of the examples, then the valid split likewise; the rest train. A package that would fill a
    held-out split past 1.5 times its share trains instead (one torch or sympy would be the whole test set). No
    package is in two splits; the same examples and seed give the same splits."""
    if not 0 < held_out_fraction < 0.5:
        raise InputError(f"held_out_fraction must be in (0, 0.5), got {held_out_fraction}")
    by_package: dict[str, list[Example]] = {}
    for example in examples:
        by_package.setdefault(example.package, []).append(example)
    if len(by_package) < 3:
        raise InputError(f"a split by package needs at least 3 packages, got {len(by_package)}")
    order = sorted(by_package)
    random.Random(seed).shuffle(order)
    wanted = held_out_fraction * len(examples)
    test, valid, train = [], [], []
    for package in order:
        group = by_package[package]
        destination = next((split for split in (test, valid) if len(split) < wanted
                            and len(split) + len(group) <= 1.5 * wanted), train)
        destination += group
    if not (train and valid and test):
        raise InputError(f"the packages cannot fill three splits ({len(train)}, {len(valid)} and {len(test)} "
                         f"examples): change held_out_fraction or mine more packages")
    return train, valid, test


# --- caching -------------------------------------------------------------------------------------------------


def save_examples(path: Path, examples: list[Example]) -> Path:
    """examples as JSONL, one per line, written atomically (a temporary file beside path, then os.replace)."""
    return write_text_atomically(path, "".join(json.dumps(asdict(example)) + "\n" for example in examples))


def load_examples(path: Path) -> list[Example]:
    def read(file: Path) -> list[Example]:
        return [Example(**json.loads(line)) for line in file.read_text(encoding="utf-8").splitlines()]

    return read_checked(path, read, "delete it to mine the corpus again")


def cached_corpus(folder: Path, roots: list[Path] | None = None, max_source_chars: int = 3000,
                  packages: set[str] | None = None, workers: int = 1) -> list[Example]:
    """mine_functions(roots or default_roots(), ...), read from folder when mined before with the same arguments
    (the file's name is a hash of them; workers change only the speed), else mined and saved there."""
    roots = [Path(root) for root in roots] if roots is not None else default_roots()
    what = {"roots": [str(root) for root in roots], "max_source_chars": max_source_chars,
            "packages": sorted(packages) if packages is not None else None, "miner": MINER_VERSION}
    key = hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]
    path = Path(folder) / f"functions-{key}.jsonl"
    if path.is_file():
        return load_examples(path)
    examples = mine_functions(roots, max_source_chars, packages, workers)
    save_examples(path, examples)
    return examples

"""Mining: a function's code without its docstring, only one-line sentence summaries, no tests or vendored copies,
one copy of duplicated code; the split by package; the atomic cache."""

from __future__ import annotations

import ast
import sysconfig
from pathlib import Path

import pytest

from accelgen.nar import data
from accelgen.nar.data import (Example, cached_corpus, default_roots, load_examples, mine_functions, save_examples,
                               split_by_package, summary_line)

MODULE = '''\
import functools


@functools.cache
def area(width, height):
    """Return the area of a rectangle.

    Both sides in metres.
    """
    # a comment stays
    return width * height


class Shelf:
    def count(self, kind):
        """Count the books of one kind on the shelf."""
        text = """a string
whose lines are not indented"""
        return sum(1 for book in self.books if book.kind == kind)

    def todo(self):
        """TODO"""
        return None

    def stub(self):
        """Do something useful with this shelf later."""

    def inline(self):  """Put the docstring on the def line."""; return 1


def wrapped():
    """Return a first sentence that goes on
    to the next line."""
    return 2
'''


def write(root: Path, relative: str, text: str) -> None:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.fixture
def tree(tmp_path) -> Path:
    root = tmp_path / "root"
    write(root, "alpha/__init__.py", MODULE)
    write(root, "alpha/tests/test_alpha.py", 'def test_it():\n    """Check that alpha works well."""\n    assert 1\n')
    write(root, "alpha/_vendor/copied.py", 'def copied(x):\n    """Return x from a vendored copy."""\n    return x\n')
    write(root, "beta.py", 'def beta(x):\n    """Double the given number please."""\n    return 2 * x\n')
    write(root, "gamma/again.py", MODULE)  # the same functions in another package: kept once, in alpha
    write(root, "delta/broken.py", "def broken(:\n")
    write(root, "delta/test_skipped.py", 'def helper(x):\n    """Help the tests of delta."""\n    return x\n')
    return root


def test_mining_keeps_the_code_without_its_docstring(tree):
    examples = mine_functions([tree])
    by_name = {example.name: example for example in examples}
    assert sorted(by_name) == ["Shelf.count", "area", "beta"]
    area = by_name["area"]
    assert (area.package, area.path, area.summary) == ("alpha", "alpha/__init__.py", "Return the area of a rectangle.")
    assert area.source == ("@functools.cache\ndef area(width, height):\n"
                           "    # a comment stays\n    return width * height\n")
    count = by_name["Shelf.count"]
    # dedented by the method's indentation, but a string's continuation line keeps its own
    assert count.source == ('def count(self, kind):\n    text = """a string\nwhose lines are not indented"""\n'
                            '    return sum(1 for book in self.books if book.kind == kind)\n')
    assert count.summary == "Count the books of one kind on the shelf."
    assert by_name["beta"].package == "beta"  # a top-level module is its own package
    for example in examples:
        ast.parse(example.source)  # still Python
        assert example.summary not in example.source


def test_mining_is_deterministic_and_can_keep_some_packages(tree):
    assert mine_functions([tree]) == mine_functions([tree]) == mine_functions([tree], workers=2)
    assert [example.name for example in mine_functions([tree], packages={"beta"})] == ["beta"]
    assert [example.name for example in mine_functions([tree], max_source_chars=60)] == ["beta"]


@pytest.mark.parametrize("docstring, summary", [
    ("Return the area of a rectangle.", "Return the area of a rectangle."),
    ("Return the area\n\nof a rectangle", "Return the area"),
    ("Two words", None),
    ("TODO: write this one day", None),
    ("Args:\n  x: the x", None),
    ("f(x, y) -> int", None),
    (":param x: the thing", None),
    (">>> f(1) == 2", None),
    ("Return a first sentence that goes on\nto the next line.", None),
    ("Return " + "many " * 20 + "words.", None),
    ("", None),
    (None, None),
])
def test_a_summary_is_a_one_line_sentence(docstring, summary):
    assert summary_line(docstring) == summary


def test_the_split_shares_no_package_and_is_deterministic():
    examples = [Example(f"package{index % 17}", f"p{index}.py", f"f{index}", f"def f{index}(): pass\n",
                        "Do one small thing.") for index in range(340)]
    train, valid, test = split_by_package(examples, held_out_fraction=0.2, seed=3)
    packages = [{example.package for example in split} for split in (train, valid, test)]
    assert not packages[0] & packages[1] and not packages[0] & packages[2] and not packages[1] & packages[2]
    assert sorted(train + valid + test, key=lambda example: example.path) == sorted(examples, key=lambda e: e.path)
    assert len(test) >= 0.2 * 340 and len(valid) >= 0.2 * 340 and len(train) > 0.5 * 340
    assert split_by_package(examples, 0.2, 3) == (train, valid, test)
    assert split_by_package(examples, 0.2, 4) != (train, valid, test)
    with pytest.raises(ValueError, match="at least 3 packages"):
        split_by_package(examples[:1], 0.2)
    giant = [Example("giant", f"g{index}.py", "f", f"def g{index}(): pass\n", "Do one big thing.")
             for index in range(200)]
    for seed in range(5):  # wherever it falls in the order, the giant package would be most of a held-out split
        assert {example.package for example in split_by_package(examples + giant, 0.2, seed)[0]} >= {"giant"}


def test_the_corpus_is_cached_atomically_and_read_back(tree, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    mined = cached_corpus(cache, [tree])
    files = list(cache.iterdir())
    assert [file.suffix for file in files] == [".jsonl"]  # no temporary file left beside it
    monkeypatch.setattr(data, "mine_functions", lambda *args: pytest.fail("mined again"))
    assert cached_corpus(cache, [tree]) == mined == load_examples(files[0])
    monkeypatch.undo()
    assert cached_corpus(cache, [tree], packages={"beta"}) != mined  # other arguments: another file
    assert len(list(cache.iterdir())) == 2


def test_examples_round_trip_through_jsonl(tmp_path):
    examples = [Example("p", "p/a.py", "f", 'def f():\n    return "é\\n"\n', "Return a string with an accent.")]
    path = save_examples(tmp_path / "examples.jsonl", examples)
    assert load_examples(path) == examples
    path.write_text('{"package": "p"')
    with pytest.raises(ValueError, match="delete it to mine the corpus again"):
        load_examples(path)


def test_the_default_roots_are_the_standard_library_and_site_packages():
    roots = default_roots()
    assert roots[0] == Path(sysconfig.get_paths()["stdlib"]) and (roots[0] / "os.py").is_file()
    assert Path(sysconfig.get_paths()["purelib"]) in roots
    # the standard library's own site-packages folder is another root's business, and tests are never mined
    json_examples = mine_functions(roots[:1], packages={"json", "site-packages", "unittest"})
    assert {example.package for example in json_examples} == {"json", "unittest"}
    assert not [example for example in json_examples if "/test" in example.path]
    assert {"dumps", "JSONEncoder.encode"} <= {example.name for example in json_examples}

"""The documentation: the site builds with `mkdocs build --strict`, and the README's links lead somewhere.

A strict build fails on a page missing from the nav's targets, a broken link or anchor between pages, a link to a
benchmark report or plot that is not in the repository, and an API reference entry that no longer resolves.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
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

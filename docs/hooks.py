"""MkDocs hook: the site serves the benchmark reports and plots that the pages link to.

MkDocs only serves files under docs/, while the pages link to `../benchmarks/<run>/...` so that the same links
work when the Markdown is read in the repository. This hook adds every benchmark report and plot to the site's
files under the source path those links name (so `mkdocs build --strict` checks each link and fails on a
missing one) and copies it to `benchmarks/<run>/...` in the site. Reports are copied as they are, not rendered:
they link to the repository's own files, which the site does not hold.
"""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File, Files, InclusionLevel

SERVED_SUFFIXES = (".png", ".md", ".json")  # the plots the pages embed, the reports and records they cite
SERVED_DATA = ("benchmarks/specbench/question.jsonl",)  # the prompt set the pages cite (other .jsonl: raw records)


class CopiedFile(File):
    """A file copied into the site as it is, even a Markdown one."""

    def is_documentation_page(self) -> bool:
        return False

    def is_static_page(self) -> bool:
        return False


def benchmark_files(docs_dir: Path) -> list[Path]:
    """The reports and plots under benchmarks/, as paths relative to the repository root."""
    root = docs_dir.parent
    found = sorted(p for p in (root / "benchmarks").rglob("*") if p.is_file() and p.suffix in SERVED_SUFFIXES)
    return [p.relative_to(root) for p in found] + [Path(data) for data in SERVED_DATA if (root / data).is_file()]


def on_files(files: Files, config) -> Files:
    docs_dir = Path(config["docs_dir"])
    for relative in benchmark_files(docs_dir):
        uri = relative.as_posix()
        files.append(CopiedFile(f"../{uri}", src_dir=str(docs_dir), dest_dir=config["site_dir"],
                                use_directory_urls=config["use_directory_urls"], dest_uri=uri,
                                inclusion=InclusionLevel.NOT_IN_NAV))  # else MkDocs drops a path starting with '.'
    return files

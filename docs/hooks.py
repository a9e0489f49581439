"""mkdocs hook: the benchmark plots live in ``benchmarks/results/`` (where the
benchmark run writes them); the site serves them from ``benchmarks/results/``
too, so ``docs/benchmarks.md`` reads the same on GitHub and on the site."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"
ON_GITHUB = "](../benchmarks/results/"
ON_SITE = "](benchmarks/results/"


def on_files(files: Files, config: Any) -> Files:
    for plot in sorted(RESULTS.glob("*.png")):
        files.append(File.generated(config, f"benchmarks/results/{plot.name}",
                                    abs_src_path=str(plot)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    if page.file.src_uri.count("/") == 0:
        return markdown.replace(ON_GITHUB, ON_SITE)
    return markdown

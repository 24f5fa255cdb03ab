"""mkdocs hook: the repository's own reports become pages of the site, unchanged.

BENCHMARKS.md, RELIABILITY.md and CHANGELOG.md are regenerated or edited at the repository's
root (`make bench`, `python -m reliability.stress`, each change), and link to the result files
beside them (`benchmarks/results/*.md`, `leaf_sweep.png`, `scale.png`). Each is added to the site at its
path in the repository, so the docs link to them (`[BENCHMARKS.md](BENCHMARKS.md)` from a page
at the docs' top level) and their own links resolve as they do on GitHub, checked by the
strict build like every other link. Search ranks them below the guides and the reference
(`REPORT_BOOST`): a search for `restore` should find how to restore before a table of
restore timings.
"""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File, Files

REPORTS = (
    "BENCHMARKS.md",
    "RELIABILITY.md",
    "CHANGELOG.md",
    "leaf_sweep.png",
    "scale.png",
    "benchmarks/results/*.md",
)

REPORT_BOOST = 0.3  # Material's per-page search boost (1 for every other page)


def on_files(files: Files, config) -> Files:
    root = Path(config.config_file_path).parent
    for pattern in REPORTS:
        found = sorted(root.glob(pattern))
        if not found:
            raise FileNotFoundError(f"docs/hooks/reports.py: no {pattern} in {root}")
        for path in found:
            uri = path.relative_to(root).as_posix()
            files.append(File.generated(config, uri, abs_src_path=str(path)))
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    if any(Path(page.file.src_uri).match(p) for p in REPORTS):
        page.meta["search"] = {"boost": REPORT_BOOST}
    return markdown

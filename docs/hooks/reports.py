"""mkdocs hook: the repository's own reports become pages of the site, unchanged.

BENCHMARKS.md, RELIABILITY.md and CHANGELOG.md are regenerated or edited at the repository's
root (`make bench`, `python -m reliability.stress`, each change), and link to the result files
beside them (`benchmarks/results/*.md`, `leaf_sweep.png`, `scale.png` and their dark twins). Each is added to the site at its
path in the repository, so the docs link to them (`[BENCHMARKS.md](BENCHMARKS.md)` from a page
at the docs' top level) and their own links resolve as they do on GitHub, checked by the
strict build like every other link. How search weighs them: `search_ranks.py`.
"""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File, Files

REPORTS = (
    "BENCHMARKS.md",
    "RELIABILITY.md",
    "CHANGELOG.md",
    "leaf_sweep.png",
    "leaf_sweep-dark.png",
    "scale.png",
    "scale-dark.png",
    "benchmarks/results/*.md",
)

REPORT_BOOST = 0.1  # Material's per-page search boost (1 for every other page)


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

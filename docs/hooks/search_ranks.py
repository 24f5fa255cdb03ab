"""mkdocs hook: how the site's search weighs each page (Material's document boost, which
multiplies a page's every match), the one place it is set. A search lists first the pages
that answer it, as tests/test_docs.py's SEARCHES says for the names users type:

- the guides (the nav's Guide section) and the API reference above the rest: what a user
  searching `restore` or `zstd` wants is how to do it, then the design pages around it;
- the reports (BENCHMARKS.md, RELIABILITY.md, the changelog, each benchmark's results page)
  far below every other page: their titles repeat the features' names ("Local tier"), and a
  table of timings answers a search only where nothing else does.
"""

from __future__ import annotations

from pathlib import Path

REFERENCE = {"api.md": 3, "api-overview.md": 2}
GUIDE_BOOST = 2
REPORT_BOOST = 0.001
REPORTS = ("BENCHMARKS.md", "RELIABILITY.md", "CHANGELOG.md", "benchmarks/results/*.md")


def _guides(nav: list) -> set[str]:
    """The pages of the nav's Guide section, at any depth."""
    found: set[str] = set()
    for entry in nav:
        for title, value in entry.items() if isinstance(entry, dict) else ():
            if title == "Guide":
                found |= _pages(value)
    return found


def _pages(value) -> set[str]:
    if isinstance(value, str):
        return {value}
    if isinstance(value, list):
        return set().union(*(_pages(v) for v in value))
    if isinstance(value, dict):
        return set().union(*(_pages(v) for v in value.values()))
    return set()


def boost(src_uri: str, nav: list) -> float | None:
    """A page's search boost (None: Material's default, 1)."""
    if any(Path(src_uri).match(p) for p in REPORTS):
        return REPORT_BOOST
    if src_uri in REFERENCE:
        return REFERENCE[src_uri]
    if src_uri in _guides(nav):
        return GUIDE_BOOST
    return None


def on_page_markdown(markdown: str, page, config, files) -> str:
    found = boost(page.file.src_uri, config["nav"])
    if found is not None:
        page.meta["search"] = {**page.meta.get("search", {}), "boost": found}
    return markdown

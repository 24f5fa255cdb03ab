"""mkdocs hook: once the site is built, every local link and image in it resolves.

mkdocs' own validation (`strict`, `validation` in mkdocs.yml) checks the links written in
the Markdown; this checks the built HTML, where the theme, mkdocstrings and the other hooks
add theirs: every `href` and `src` that is not another site's names a file of the site,
and a `#fragment` names an `id` in the page it points to. One that does not fails the
build (`make docs`, inside `make test`), each listed with the page it is on.
"""

from __future__ import annotations

from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

from mkdocs.exceptions import PluginError

ELSEWHERE = ("http", "https", "mailto", "data", "javascript")
# mkdocs' own 404 page links from the site's root, wherever it is served; not a page of ours.
SKIPPED = {"404.html"}


class _Page(HTMLParser):
    """A page's link and image targets, and its ids."""

    def __init__(self) -> None:
        super().__init__()
        self.targets: list[tuple[str, str]] = []
        self.ids: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for name, value in attrs:
            if name == "id" and value:
                self.ids.add(value)
            if name in ("href", "src") and value:
                self.targets.append((name, value))


def _read(path: Path) -> _Page:
    page = _Page()
    page.feed(path.read_text(encoding="utf-8"))
    return page


def broken(site: Path) -> list[str]:
    """Each local link or image of the built `site` that names no file or no id there."""
    pages = {p: _read(p) for p in sorted(site.rglob("*.html")) if p.name not in SKIPPED}
    found = []
    for path, page in pages.items():
        for attr, url in page.targets:
            parts = urlsplit(url)
            if parts.scheme in ELSEWHERE or parts.netloc:
                continue
            target = (path.parent / unquote(parts.path)).resolve() if parts.path else path
            if target.is_dir():
                target = target / "index.html"
            where = f"{path.relative_to(site)}: {attr}={url}"
            if not target.is_file():
                found.append(f"{where} (no such file)")
            elif parts.fragment and target.suffix == ".html":
                ids = pages[target].ids if target in pages else _read(target).ids
                if unquote(parts.fragment) not in ids:
                    found.append(f"{where} (no such id there)")
    return found


def on_post_build(config) -> None:
    found = broken(Path(config["site_dir"]))
    if found:
        raise PluginError(
            f"{len(found)} link(s) or image(s) in the built site lead nowhere:\n  "
            + "\n  ".join(found)
        )

"""Screenshots of the built docs site in headless Chromium, at a desktop and a phone width,
and what its search finds first for the names users type: what a reader sees, to look at
before and after a change to the site (`make docs-shots`, outside `make test`).

    python docs/shots.py [--site site] [--out runs/docs-shots] [--chromium chromium]

Serves the built site (`make docs` first; the make target does) on 127.0.0.1 at a free
port and drives Chromium through Playwright: loads each page of PAGES at each width and
colour scheme of WIDTHS and writes one PNG each into --out, named `<page>-<width>.png`; then
types each query of SEARCHES into the search box and writes the pages it lists first to
`search.md` (and the results for the first query as `search-desktop.png`). Prints the paths
it wrote. Every wait is bounded (a page that never loads fails the script, naming it).
"""

from __future__ import annotations

import argparse
import functools
import http.server
import shutil
import sys
import threading
from pathlib import Path

from playwright.sync_api import Page, sync_playwright

# The pages a newcomer meets first: Home, Install, a guide page, the API reference and
# Benchmarks (with its plots).
PAGES = {
    "home": "",
    "install": "install/",
    "guide": "guide/",
    "api": "api/",
    "benchmarks": "benchmarks/",
}
# (name, width, height, colour scheme): a laptop's browser window, and a phone's (CSS
# pixels), each light and dark (the site follows the reader's system).
WIDTHS = [
    ("desktop", 1400, 2400, "light"),
    ("phone", 390, 2400, "light"),
    ("desktop-dark", 1400, 2400, "dark"),
    ("phone-dark", 390, 2400, "dark"),
]
# What users type, API names first: each should find the page that answers it first.
SEARCHES = [
    "CheckpointManager",
    "restore",
    "target_on_mesh",
    "LocalTier",
    "verify",
    "pip install",
    "another mesh",
]
SHOWN = 3  # the pages search.md lists per query
TIMEOUT_MS = 60_000


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # no line per request
        pass


def serve(site: Path) -> tuple[http.server.ThreadingHTTPServer, str]:
    """The site over HTTP on 127.0.0.1 (a free port), in a thread: the server and its URL."""
    handler = functools.partial(_Quiet, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)  # a free port
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/"


def search(page: Page, url: str, query: str) -> list[str]:
    """The pages the site's search lists for `query`, best first (paths from the root)."""
    page.goto(url)
    page.keyboard.press("s")  # Material's shortcut: the search box, focused
    page.fill("input.md-search__input", query)
    meta = page.locator(".md-search-result__meta")
    page.wait_for_function(  # the worker has answered this query, not an earlier one
        "el => /\\d+ matching/.test(el.textContent)", arg=meta.element_handle(), timeout=TIMEOUT_MS
    )
    links = page.locator(".md-search-result__list > .md-search-result__item > a")
    paths = [
        href.split("?")[0].removeprefix(url)
        for href in links.evaluate_all("links => links.map(a => a.href)")
    ]
    return [path or "(home)" for path in dict.fromkeys(paths)]  # each page once, in order


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--site", type=Path, default=Path("site"))
    parser.add_argument("--out", type=Path, default=Path("runs/docs-shots"))
    parser.add_argument("--chromium", default=shutil.which("chromium") or "chromium")
    args = parser.parse_args()
    if not (args.site / "index.html").is_file():
        sys.exit(f"shots: no built site in {args.site}: run `make docs` first")
    args.out.mkdir(parents=True, exist_ok=True)
    server, url = serve(args.site)
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(
                executable_path=args.chromium,
                args=["--no-sandbox"],  # as root, in a container
            )
            for name, width, height, scheme in WIDTHS:
                viewport = {"width": width, "height": height}
                page = browser.new_page(viewport=viewport, color_scheme=scheme)
                page.set_default_timeout(TIMEOUT_MS)
                for shot, path in PAGES.items():
                    page.goto(url + path, wait_until="networkidle")
                    out = args.out / f"{shot}-{name}.png"
                    page.screenshot(path=out)
                    print(out)
            page = browser.new_page(viewport={"width": 1400, "height": 1200})
            page.set_default_timeout(TIMEOUT_MS)
            rows = ["| query | first pages found |", "| --- | --- |"]
            for i, query in enumerate(SEARCHES):
                found = search(page, url, query)
                rows.append(f"| `{query}` | {', '.join(found[:SHOWN])} |")
                if i == 0:
                    page.screenshot(path=args.out / "search-desktop.png")
                    print(args.out / "search-desktop.png")
            (args.out / "search.md").write_text("\n".join(rows) + "\n")
            print(args.out / "search.md")
            browser.close()
    finally:
        server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())

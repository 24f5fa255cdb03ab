"""Screenshots of the built docs site in headless Chromium, at a desktop and a phone width:
what a reader sees, to look at before and after a change to the site (`make docs-shots`,
outside `make test`).

    python docs/shots.py [--site site] [--out runs/docs-shots] [--chromium chromium]

Serves the built site (`make docs` first; the make target does) on 127.0.0.1 at a free
port, loads each page of PAGES at each width of WIDTHS, and writes one PNG per page and
width into --out, named `<page>-<width>.png`; then prints their paths. Each Chromium run
is bounded (a page that never loads fails the script, naming it).
"""

from __future__ import annotations

import argparse
import functools
import http.server
import shutil
import subprocess
import sys
import threading
from pathlib import Path

# The pages a newcomer meets first: Home, Install, a guide page, the API reference and
# Benchmarks (with its plots).
PAGES = {
    "home": "",
    "install": "install/",
    "guide": "guide/",
    "api": "api/",
    "benchmarks": "benchmarks/",
}
# (name, width, height): a laptop's browser window, and a phone's (CSS pixels).
WIDTHS = [("desktop", 1400, 2400), ("phone", 390, 2400)]
TIMEOUT_S = 120


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # no line per request
        pass


def serve(site: Path) -> tuple[http.server.ThreadingHTTPServer, str]:
    """The site over HTTP on 127.0.0.1 (a free port), in a thread: the server and its URL."""
    handler = functools.partial(_Quiet, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)  # a free port
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/"


def shoot(chromium: str, url: str, out: Path, width: int, height: int) -> None:
    """One screenshot of `url` at `width` x `height` into `out` (RuntimeError if none)."""
    command = [
        chromium,
        "--headless",
        "--no-sandbox",  # as root, in a container
        "--disable-gpu",
        "--hide-scrollbars",
        "--no-first-run",
        "--virtual-time-budget=5000",  # the page's scripts (search, palette) settle first
        f"--window-size={width},{height}",
        f"--screenshot={out}",
        url,
    ]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S)
    if proc.returncode != 0 or not out.is_file():
        raise RuntimeError(f"chromium made no screenshot of {url}: {proc.stderr[-2000:]}")


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
        for page, path in PAGES.items():
            for name, width, height in WIDTHS:
                out = args.out / f"{page}-{name}.png"
                shoot(args.chromium, url + path, out, width, height)
                print(out)
    finally:
        server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())

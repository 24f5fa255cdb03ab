"""The benchmarks' figures, each drawn twice: for the docs' light pages and for their dark
mode (Material's slate scheme, whose background the dark one takes), which the pages show
by the reader's scheme (`#only-light`, `#only-dark`). A plot function draws its figure with
the colours of the style it is called in (`foreground()` for a line that must stand out)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

SLATE = "#1e2029"  # Material's slate background, hsla(232, 15%, 14%)
STYLES = {
    "light": ("default", {}),
    "dark": (
        "dark_background",
        {"figure.facecolor": SLATE, "axes.facecolor": SLATE, "savefig.facecolor": SLATE},
    ),
}


def dark_twin(png: Path) -> Path:
    """Where the dark figure of `png` goes: `<name>-dark.png` beside it."""
    return png.with_name(f"{png.stem}-dark{png.suffix}")


def foreground() -> Any:
    """The text's colour in the style drawn now (black on light, white on dark)."""
    import matplotlib

    return matplotlib.rcParams["text.color"]


def save_light_and_dark(draw: Callable[[], Any], png: Path, dpi: int) -> list[Path]:
    """`draw()` (a new matplotlib figure) in each style, saved to `png` and its dark twin."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for path, (style, overrides) in zip((png, dark_twin(png)), STYLES.values(), strict=True):
        with plt.style.context([style, overrides]):
            figure = draw()
            figure.savefig(path, dpi=dpi)
            plt.close(figure)
        written.append(path)
    return written

"""The benchmarks' markdown: a table, and the one-table result page that the memory
benchmarks (plan_memory.py, restore_memory.py) write to benchmarks/results/."""

from __future__ import annotations

from pathlib import Path


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    """A markdown table's lines, `rows` of cell texts under `header`, then an empty line."""
    return [
        "| " + " | ".join(header) + " |",
        "|" + " --- |" * len(header),
        *("| " + " | ".join(r) + " |" for r in rows),
        "",
    ]


def write_page(
    out: Path, heading: str, about: str, header: list[str], rows: list[list[str]]
) -> str:
    """Writes `out` (its folder made if need be): `# heading`, the paragraph `about`, then
    the table; prints the page and returns it."""
    text = "\n".join([f"# {heading}", "", about, "", *table(header, rows)])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)
    return text

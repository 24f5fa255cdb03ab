"""mkdocs hook: the CLI reference's `--help` texts, generated at build time.

A page line `<!-- jaxckpt --help -->` becomes one section per command: the help the
installed `jaxckpt` command prints, `jaxckpt --help` first, then each command's
(`jaxckpt ls --help`, ...) in the order the command lists them. The command is the
`jaxckpt` console script's entry point (pyproject.toml's `[project.scripts]`), so the
reference follows the CLI wherever its code lives, and a new command appears without an
edit here. tests/test_docs.py checks these texts against what the command itself prints.
"""

from __future__ import annotations

import importlib.metadata
import os

MARKER = "<!-- jaxckpt --help -->"
# As printed on a terminal of WIDTH columns (or wider: click caps help text at 80 columns),
# where click lays help out in WIDTH - 2.
WIDTH = 80


def command():
    """The click group the `jaxckpt` console script runs."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # importing jaxckpt imports jax
    (entry,) = importlib.metadata.entry_points(group="console_scripts", name="jaxckpt")
    return entry.load()


def help_texts() -> list[tuple[str, str]]:
    """(`jaxckpt CMD`, its --help text) for the group and each of its commands."""
    import click

    group = command()
    root = click.Context(group, info_name="jaxckpt", terminal_width=WIDTH - 2)
    texts = [("jaxckpt", group.get_help(root))]
    for name in group.list_commands(root):
        sub = group.get_command(root, name)
        ctx = click.Context(sub, info_name=name, parent=root, terminal_width=WIDTH - 2)
        texts.append((f"jaxckpt {name}", sub.get_help(ctx)))
    return texts


def on_page_markdown(markdown: str, page, config, files) -> str:
    if MARKER not in markdown:
        return markdown
    sections = [
        f"### `{name} --help`\n\n```text\n{text.rstrip()}\n```\n" for name, text in help_texts()
    ]
    return markdown.replace(MARKER, "\n".join(sections))

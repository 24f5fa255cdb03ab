"""griffe extension: doctest examples in docstrings are shown as Python console blocks.

jaxckpt's docstrings put their runnable `>>>` examples in the text (pytest runs them with
--doctest-modules) rather than in an "Examples:" section. Markdown would read `>>>` as
nested block quotes, so each run of lines from a `>>>` line to the next blank line is
fenced as ```pycon, and `# doctest:` flags are dropped from it. Docstrings are read, never
changed on disk. Loaded by mkdocs.yml's mkdocstrings options (`extensions`).
"""

from __future__ import annotations

import re

import griffe

FLAGS = re.compile(r"\s*#\s*doctest:.*$")


def fence(text: str) -> str:
    lines, out, i = text.splitlines(), [], 0
    while i < len(lines):
        line = lines[i]
        if not line.lstrip().startswith(">>>"):
            out.append(line)
            i += 1
            continue
        indent = line[: len(line) - len(line.lstrip())]
        block = []
        while i < len(lines) and lines[i].strip():
            block.append(FLAGS.sub("", lines[i]))
            i += 1
        out += [f"{indent}```pycon", *block, f"{indent}```"]
    return "\n".join(out)


class DoctestBlocks(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None and ">>>" in obj.docstring.value:
            obj.docstring.value = fence(obj.docstring.value)

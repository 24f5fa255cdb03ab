"""mkdocs hook: the built API reference names no private type.

What a public call takes or returns must be public too, or a user meets a type the
reference does not document. Once the site is built, the text of the API page is searched
for the name of every class jaxckpt defines but does not export (`jaxckpt.__all__`,
`jaxckpt.errors`), and for a private module's path (`_layout.StepInfo`); either fails the
build (`make docs`, inside `make test`).
"""

from __future__ import annotations

import html
import importlib
import inspect
import pkgutil
import re
from pathlib import Path

from mkdocs.exceptions import PluginError

# The classes that do each tier's storage work: `CheckpointManager(store=, local_store=)`
# takes subclasses of them, the seam tests inject faults through (docs/development.md).
SEAMS = {"OrbaxStore", "LocalStore"}


def private_classes() -> set[str]:
    """The names of the classes jaxckpt's modules define and jaxckpt does not export."""
    import jaxckpt

    public = set(jaxckpt.__all__) | set(vars(jaxckpt.errors))
    found = set()
    for module in pkgutil.walk_packages(jaxckpt.__path__, "jaxckpt."):
        if module.name.endswith("__main__"):  # the CLI, run on import
            continue
        for name, value in vars(importlib.import_module(module.name)).items():
            if inspect.isclass(value) and value.__module__ == module.name:
                found.add(name)
    return found - public - SEAMS


def named(page: str, private: set[str]) -> list[str]:
    """The private names (`private`, or a private module's path) in a built page's text."""
    text = html.unescape(re.sub(r"<[^>]+>", " ", page))
    words = set(re.findall(r"\b[A-Za-z_]\w*\b", text))
    paths = set(re.findall(r"(?<![\w.])_[a-z]\w*\.\w+", text))
    return sorted((words & private) | paths)


def on_post_build(config: dict, **_: object) -> None:
    page = Path(config["site_dir"]) / "api" / "index.html"
    if found := named(page.read_text(), private_classes()):
        raise PluginError(
            f"the API reference names private types: {', '.join(found)}. Export them, or "
            "keep them out of public signatures and docstrings."
        )

"""mkdocs hook: what pyproject.toml says, on the site, read at build time.

A page line `<!-- requirements -->` (the Install page's) becomes a table: the Python
versions (`requires-python`) and each dependency with the versions jaxckpt accepts
(`[project] dependencies`), so the page says what pip will ask for, never an older copy.
Every page's footer names the version (`[project] version`) and the license, and the
site's source link and address are `[project.urls]`' Repository and Documentation, the
ones PyPI shows: none is set until the project has a public home.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

MARKER = "<!-- requirements -->"
PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def project() -> dict:
    """pyproject.toml's `[project]` table."""
    return tomllib.loads(PYPROJECT.read_text())["project"]


def table() -> str:
    """Python and each dependency with the versions accepted, in pyproject's order."""
    rows = [("Python", project()["requires-python"])]
    for requirement in project()["dependencies"]:
        name, versions = re.match(r"([A-Za-z0-9_.\-]+(?:\[[^\]]*\])?)(.*)", requirement).groups()
        rows.append((name, versions.strip() or "any"))
    lines = ["| package | versions |", "| --- | --- |"]
    lines += [f"| {name} | `{versions}` |" for name, versions in rows]
    return "\n".join(lines)


def addresses(urls: dict[str, str]) -> dict[str, str]:
    """mkdocs' `repo_url` and `site_url`, from a `[project.urls]` table (those it has)."""
    names = {"repo_url": "Repository", "site_url": "Documentation"}
    return {key: urls[name] for key, name in names.items() if name in urls}


def on_config(config):
    config["copyright"] = f"jaxckpt {project()['version']} · {project()['license']}"
    for key, url in addresses(project().get("urls", {})).items():
        config[key] = url
    return config


def on_page_markdown(markdown: str, page, config, files) -> str:
    return markdown.replace(MARKER, table()) if MARKER in markdown else markdown

"""The docs' code samples run as printed, and the docs say what the code does.

The convention (docs/development.md, "Code samples run"): every ```python block of a page
runs, in order, as one script in a fresh process on 8 CPU devices, from the repository's
root; string literals under /ckpt/ and /mnt/ are moved into the test's tmp_path, gs://bucket/
and gs://my-bucket/ into the test session's GCS emulator; collapsed `??? example` blocks
hold a sample's setup and run in their place; a block that cannot run is marked
`<!-- not run: why -->`.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import io
import json
import os
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import yaml

import jaxckpt
from conftest import REPO, run_python
from jaxckpt.hf._names import place

DOCS = REPO / "docs"
CPU8 = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
NOT_RUN = re.compile(r"^\s*<!--\s*not run:(.*?)-->\s*$")
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*\{?\s*\.?([\w+-]*)[^`]*$")
PATHS = re.compile(r"""(["'])/(ckpt|mnt)/""")
BUCKETS = re.compile(r"""(["'])(gs|s3)://(?:my-)?bucket/""")  # run on the test servers
# Pages whose samples a test of their own runs (more than once, with other checks); Home's
# one sample is the README's first example, which
# test_the_first_example_runs_as_printed_and_again_from_its_newest_step runs.
OWN_TEST = {"guide.md", "equinox.md", "index.md"}
# What a page's output must hold: what its samples print.
PRINTS = {
    "resharding.md": ["restore plan for step 1: 4 leaves"],
    "from-orbax.md": ["100 [4 5 6 7] None"],
    "hf.md": ["P(None, 'model')"],
}


@dataclasses.dataclass(frozen=True)
class Block:
    language: str
    code: str
    line: int  # 1-based, of the opening fence
    not_run: str | None  # the reason given by a `<!-- not run: ... -->` line before it


def blocks(text: str) -> list[Block]:
    """The fenced code blocks of a Markdown text, in order (indented ones in collapsed
    blocks too), their indentation removed."""
    lines, found, i = text.splitlines(), [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, fence, language = opening.groups()
        end = next(
            (j for j in range(i + 1, len(lines)) if lines[j].strip() == fence),
            None,
        )
        assert end is not None, f"line {i + 1}: the {fence} fence is never closed"
        body = [line.removeprefix(indent) for line in lines[i + 1 : end]]
        marker = NOT_RUN.match(lines[i - 1]) if i else None
        reason = marker.group(1).strip() if marker else None
        assert marker is None or reason, f"line {i}: `<!-- not run: -->` gives no reason"
        found.append(Block(language, "\n".join(body) + "\n", i + 1, reason))
        i = end + 1
    return found


def python_blocks(page: Path) -> list[Block]:
    return [b for b in blocks(page.read_text()) if b.language in ("python", "py")]


def script(page: Path, tmp_path: Path, buckets: dict[str, str] | None = None) -> str:
    """The page's runnable Python blocks as one script, its paths the test's own (its
    buckets, of each scheme, `buckets`')."""
    parts = []
    for block in python_blocks(page):
        if block.not_run is None:
            parts.append(f"# --- {page.name}, line {block.line}\n{block.code}")
    code = PATHS.sub(lambda m: f"{m[1]}{tmp_path}/{m[2]}/", "\n".join(parts))
    if buckets:
        code = BUCKETS.sub(lambda m: f"{m[1]}{buckets[m[2]]}/{page.stem}/", code)
    return code


def run_page(page: Path, tmp_path: Path, buckets: dict[str, str] | None = None, **kwargs):
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / f"sample_{page.stem}.py"  # never a module name (equinox.py)
    path.write_text(script(page, tmp_path, buckets))
    return run_python(str(path), env=CPU8, **kwargs)


def pages() -> list[Path]:
    return sorted(DOCS.glob("*.md"))


def test_every_docs_page_is_in_the_nav_and_the_samples_are_recognised():
    nav = (REPO / "mkdocs.yml").read_text()
    for page in pages():
        assert f" {page.name}" in nav, f"docs/{page.name} is not in mkdocs.yml's nav"
        for block in blocks(page.read_text()):
            assert block.language, f"docs/{page.name}:{block.line}: name the fence's language"


CODE_WIDTH = 100  # characters of a code line that fit the page at 1,400 px (make docs-shots)


def test_every_code_line_fits_the_page():
    """No line of a docs page's code blocks is wider than CODE_WIDTH: the widened page
    (docs/stylesheets/extra.css) shows it whole at 1,400 px, without a sideways scroll."""
    wide = [
        f"docs/{page.name}:{block.line + i + 1}: {len(line)} characters"
        for page in pages()
        for block in blocks(page.read_text())
        for i, line in enumerate(block.code.splitlines())
        if len(line) > CODE_WIDTH
    ]
    assert not wide, wide


@pytest.mark.parametrize(
    "page",
    [p.name for p in pages() if p.name not in OWN_TEST and python_blocks(p)],
)
def test_page_samples_run(page, tmp_path, request):
    """Every page with Python samples: they run, in order, as printed."""
    path = DOCS / page
    servers = {"gs": "gcs_server", "s3": "s3_server"}
    buckets = {
        scheme: request.getfixturevalue(servers[scheme]).url
        for scheme in {m[2] for m in BUCKETS.finditer(path.read_text())}
    }
    proc = run_page(path, tmp_path, buckets)
    for text in PRINTS.get(page, []):
        assert text in proc.stdout, proc.stdout[-3000:]


def test_the_pages_that_print_are_run():
    runnable = {p.name for p in pages() if python_blocks(p)}
    assert set(PRINTS) <= runnable - OWN_TEST
    assert runnable >= OWN_TEST


# ------------------------------------------------------------------------------ Quickstart

QUICKSTART_PRINT = '    print(f"step {step} loss {float(loss)}")\n'
PREEMPT_AT = 23


def hook(name: str, folder: str = "hooks"):
    """docs/hooks/<name>.py, the module mkdocs loads as a hook (or another docs folder's)."""
    spec = importlib.util.spec_from_file_location(name, DOCS / folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def section(text: str, heading: str) -> str:
    """The part of a Markdown text from `heading` (a "## " line) to the next one."""
    return text[text.index(heading) :].split("\n## ")[0]


def readme_quickstart() -> str:
    readme = section((REPO / "README.md").read_text(), "## Quickstart")
    (block, *_) = [b for b in blocks(readme) if b.language == "python"]
    return block.code


def test_the_sites_source_link_and_address_come_from_project_urls():
    """repo_url and site_url are pyproject's [project.urls] Repository and Documentation,
    where set (one place for the addresses PyPI and the site show)."""
    addresses = hook("requirements").addresses
    urls = {"Repository": "https://example.org/jaxckpt", "Documentation": "https://x.org/"}
    assert addresses(urls) == {"repo_url": urls["Repository"], "site_url": urls["Documentation"]}
    assert addresses({"Homepage": "https://example.org"}) == {}


def test_the_install_page_names_every_extra_and_its_requirements_come_from_pyproject():
    """docs/install.md's table of extras has one row per extra pyproject.toml declares, no
    more; its requirements table is pyproject's own (docs/hooks/requirements.py)."""
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    page = (DOCS / "install.md").read_text()
    rows = re.findall(r"^\| `(\w+)` \|", page, flags=re.M)
    assert sorted(rows) == sorted(project["optional-dependencies"]), rows
    table = hook("requirements").on_page_markdown(page, None, None, None)
    assert "<!-- requirements -->" not in table
    assert f"| Python | `{project['requires-python']}` |" in table
    for requirement in project["dependencies"]:
        name = re.match(r"[\w.\-]+(\[[^\]]*\])?", requirement).group(0)
        assert f"| {name} | `{requirement[len(name) :]}` |" in table, requirement


def test_every_page_tells_one_install_story():
    """One install story, from pyproject.toml: every page names the Python it needs as
    `requires-python` says; every pip install of jaxckpt is from the clone (it is not on
    PyPI) with extras pyproject declares; the Install page puts JAX for the accelerator
    first and installs what the Quickstart imports. Before: Home said 3.11 or 3.12, Install
    3.11; Object storage printed `pip install 'jaxckpt[gcs]'`."""
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    minimum = re.fullmatch(r">=(3\.\d+)", project["requires-python"]).group(1)
    extras = set(project["optional-dependencies"])
    pages = [REPO / "README.md", *sorted(DOCS.glob("*.md"))]
    for page in pages:
        text = page.read_text()
        for claim in re.findall(r"Python 3\.\d+(?: or (?:3\.\d+|\w+))?", text):
            assert claim == f"Python {minimum} or newer", (page.name, claim)
        for line in re.findall(r"pip install[^`\n]*", text):
            assert "jaxckpt[" not in line and "pip install jaxckpt" not in line, (page.name, line)
            for wanted in re.findall(r"'\.\[([\w,]+)\]'", line):
                assert set(wanted.split(",")) <= extras, (page.name, line)
    install = (DOCS / "install.md").read_text()
    assert install.index("pip install 'jax[cuda13]'") < install.index("pip install .")
    assert "pip install '.[train]'" in install
    assert "'.[train]'" in (REPO / "README.md").read_text()  # (its Quickstart imports flax)


def test_no_internal_word_on_a_users_page():
    """A user's page names no private module of jaxckpt, no issue number and no format
    number: the developer's pages (Architecture, Development) and the on-disk layout,
    whose formats are its subject, may. Before: Comparison named `_internals.py` and
    `_memory`, Benchmarks "issue 30's targets", Incremental steps "format 3"."""
    private = sorted(
        p.stem for p in (REPO / "jaxckpt").glob("_*.py") if not p.stem.startswith("__")
    )
    words = [
        r"jaxckpt\._[a-z]\w*",
        rf"`({'|'.join(private)})(\.py)?[`.]",
        r"\bissues? \d+",
        r"\bformats? [123]\b",
    ]
    for page in sorted(DOCS.glob("*.md")):
        if page.name in ("architecture.md", "development.md", "layout.md"):
            continue
        for word in words:
            found = re.search(word, page.read_text())
            assert not found, (page.name, found and found.group(0))


def readme_first_example() -> str:
    """README.md's first sample, before its Quickstart: Home's first screen shows it."""
    (block, *_) = [b for b in blocks((REPO / "README.md").read_text()) if b.language == "python"]
    return block.code


def test_the_readme_has_no_sample_but_the_first_example_and_the_quickstart():
    readme = blocks((REPO / "README.md").read_text())
    found = [b.code for b in readme if b.language == "python"]
    assert found == [readme_first_example(), readme_quickstart()]
    assert readme_first_example() != readme_quickstart()


def test_the_first_example_runs_as_printed_and_again_from_its_newest_step(tmp_path):
    """Home's and the README's first example, as a user runs it (in a directory of theirs,
    its steps under it): run twice, it prints what its comment says both times, the second
    time from the steps the first saved. It writes nowhere but under the working directory
    (a user who is not root writes there; /ckpt/... they may not create)."""
    code = readme_first_example()
    (expected,) = re.findall(r"print\(.*\)  # (.+)$", code, flags=re.M)
    script = tmp_path / "first_example.py"
    script.write_text(code)
    for _ in range(2):
        proc = run_python(str(script), cwd=tmp_path)
        assert proc.stdout.strip().splitlines()[-1] == expected, proc.stdout[-500:]
    saved = sorted(p.name for p in (tmp_path / "checkpoints" / "first").iterdir())
    assert [n for n in saved if n.isdigit()] == ["10", "20", "30"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints", "first_example.py"]


def test_home_shows_the_readmes_first_example_and_feature_table():
    """docs/index.md, the site's landing page, holds README.md's first example (that test
    runs it), with its install line before it, and its feature table, its links made the
    site's (`docs/x.md` -> `x.md`); the Quickstart is one click away, in Getting started."""
    home = (DOCS / "index.md").read_text()
    assert [b.code for b in python_blocks(DOCS / "index.md")] == [readme_first_example()]
    assert home.index("pip install '.[train]'") < home.index("import jaxckpt")
    assert home.index("import jaxckpt") < home.index("## Why not plain Orbax")
    assert "(guide.md#quickstart)" in home

    def table(text: str) -> list[str]:
        rows = section(text, "## What it does").splitlines()
        return [line for line in rows if line.startswith("|")]

    readme = table((REPO / "README.md").read_text())
    assert len(readme) > 10
    assert table((DOCS / "index.md").read_text()) == [r.replace("](docs/", "](") for r in readme]


def test_the_built_sites_links_and_images_are_checked(tmp_path):
    """docs/hooks/site_links.py, which `make docs` runs on the built site: a link to a page
    and an id it has, an image that is there and other sites pass; a missing image, page or
    id is named with the page it is on."""
    broken = hook("site_links").broken
    (tmp_path / "guide").mkdir()
    (tmp_path / "guide" / "index.html").write_text('<h2 id="paths">Paths</h2>')
    (tmp_path / "plot.png").write_bytes(b"")
    good = '<a href="guide/#paths">a</a><img src="plot.png"><a href="https://x.org/y">b</a>'
    (tmp_path / "index.html").write_text(good)
    assert broken(tmp_path) == []
    bad = '<img src="gone.png"><a href="guide/#nowhere">c</a><a href="missing/">d</a>'
    (tmp_path / "index.html").write_text(good + bad)
    assert broken(tmp_path) == [
        "index.html: src=gone.png (no such file)",
        "index.html: href=guide/#nowhere (no such id there)",
        "index.html: href=missing/ (no such file)",
    ]


def test_the_summary_figures_are_the_comparisons():
    """Home's "Why not plain Orbax" table and Benchmarks' "In short" repeat figures that
    docs/comparison.md states with how each was measured: every one of them is there, so
    a figure updated there and not in a summary fails here."""
    comparison = (DOCS / "comparison.md").read_text()
    for page, heading in (("index.md", "## Why not plain Orbax"), ("benchmarks.md", "## In short")):
        figures = re.findall(r"\b\d+(?:\.\d+)? m?s\b", section((DOCS / page).read_text(), heading))
        assert len(figures) >= 8, (page, figures)
        missing = [f for f in figures if f not in comparison]
        assert not missing, f"docs/{page}: {missing} not in docs/comparison.md"


def test_the_readme_links_resolve():
    """README.md is read on GitHub, not built by mkdocs: its links to files (docs pages and
    reports) and their headings are checked here."""
    readme = (REPO / "README.md").read_text()
    links = re.findall(r"\]\(([^)#\s]+)(?:#([^)\s]+))?\)", readme)
    assert links
    for path, anchor in links:
        if "://" in path:
            continue
        assert (REPO / path).exists(), f"README.md links to {path}, which does not exist"
        if anchor:
            headings = re.findall(r"^#+ (.+)$", (REPO / path).read_text(), re.M)
            slugs = {re.sub(r"[^\w\- ]", "", h.lower()).strip().replace(" ", "-") for h in headings}
            assert anchor in slugs, f"README.md links to {path}#{anchor}: no such heading"


def test_the_quickstart_resumes_bitwise_after_a_preemption(tmp_path):
    """README.md's Quickstart, the same text as docs/guide.md's: run straight (with the rest
    of its page), then preempted by SIGTERM after step 23 in a new process and resumed in
    another: it saves step 23 and exits, resumes from it, and every loss is bitwise the
    straight run's."""
    quickstart = readme_quickstart()
    guide = python_blocks(DOCS / "guide.md")
    assert guide[0].code == quickstart, "docs/guide.md's Quickstart differs from README.md's"
    assert QUICKSTART_PRINT in quickstart

    # in a directory of the user's: the Quickstart saves under the working directory
    straight = run_page(DOCS / "guide.md", tmp_path / "straight", cwd=tmp_path / "straight")
    straight = straight.stdout.splitlines()
    steps = [line for line in straight if line.startswith("step ")]
    assert [line.split()[1] for line in steps] == [str(s) for s in range(1, 51)]

    # A preemption notice arrives right after step 23's print, as a cluster sends SIGTERM.
    notice = f"    if step == {PREEMPT_AT}:\n        os.kill(os.getpid(), signal.SIGTERM)\n"
    preempted = "import os\nimport signal\n" + quickstart.replace(
        QUICKSTART_PRINT, QUICKSTART_PRINT + notice
    )
    path = tmp_path / "sample_quickstart.py"

    def run(text):
        path.write_text(text)
        return run_python(str(path), env=CPU8, cwd=tmp_path).stdout.splitlines()

    first, second = run(preempted), run(quickstart)
    assert first[-1] == f"preempted: saved step {PREEMPT_AT}", first[-3:]
    assert second[0] == f"resumed from step {PREEMPT_AT}", second[:3]
    assert first[:-1] + second[1:] == steps
    saved = sorted(int(p.name) for p in (tmp_path / "checkpoints" / "quickstart").glob("[0-9]*"))
    assert saved == [30, 40, 50]  # keep_last=3


# ------------------------------------------------------------------------------- Equinox


def test_the_equinox_recipe_resumes_bitwise_in_a_new_process(tmp_path):
    """docs/equinox.md: the script runs as printed; run twice (5 steps, then 5 more from the
    step it saved, each a new process) it gives the losses of one run of 10 steps, bit for
    bit."""
    (block,) = python_blocks(DOCS / "equinox.md")
    assert "STEPS = 5 " in block.code

    def run(directory, steps=5):
        text = PATHS.sub(lambda m: f"{m[1]}{directory}/{m[2]}/", block.code)
        path = directory / "sample_equinox.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text.replace("STEPS = 5 ", f"STEPS = {steps} "))
        return run_python(str(path), env=CPU8).stdout.splitlines()

    resumed = run(tmp_path / "a") + run(tmp_path / "a")
    straight = run(tmp_path / "b", steps=10)
    assert [line.split()[1] for line in resumed] == [str(s) for s in range(1, 11)]
    assert resumed == straight


# ----------------------------------------------------------------------------- name maps


def test_the_name_map_example_places_leaves():
    """docs/hf.md, "Name maps": the YAML example loads and places leaves as its comments
    say."""
    text = (DOCS / "hf.md").read_text()
    section = text[text.index("## Name maps") :]
    (example, *_) = [b for b in blocks(section) if b.language == "yaml"]
    names = jaxckpt.NameMap.load(yaml.safe_load(example.code))
    assert place(names, "model.wte.embedding.value", (10, 4)).names == ("transformer.wte.weight",)
    attn = place(names, "model.h.0.attn.kernel.value", (4, 8))
    assert attn.names == ("transformer.h.0.attn.weight",) and attn.transpose == (1, 0)
    mlp = place(names, "model.layers.mlp.kernel.value", (2, 4, 8))
    assert mlp.names == ("model.layers.0.mlp.weight", "model.layers.1.mlp.weight")
    assert place(names, "model.h.0.rngs.dropout.key", (2,)) is None  # dropped
    assert place(names, "opt.mu.w", (4,)) is None  # not included


# ------------------------------------------------------------------------- API reference


def public_names() -> set[str]:
    return {
        name
        for name, value in vars(jaxckpt).items()
        if not name.startswith("_") and (not inspect.ismodule(value) or name == "errors")
    }


def public_members(cls: type) -> set[str]:
    """The methods and properties a class of the public API defines, its own."""
    return {
        name
        for name, value in vars(cls).items()
        if not name.startswith("_")
        and (callable(value) or isinstance(value, property | classmethod | staticmethod))
    }


def test_the_api_reference_documents_every_public_name():
    """docs/api.md renders `jaxckpt.__all__`, which is every name jaxckpt re-exports,
    through the public names only (a private module path would break when modules move)."""
    assert sorted(jaxckpt.__all__) == sorted(public_names())
    reference = (DOCS / "api.md").read_text()
    rendered = set(re.findall(r"^::: (\S+)", reference, re.M))
    assert {f"jaxckpt.{name}" for name in jaxckpt.__all__} == rendered
    assert not re.search(r"jaxckpt\._", reference), "the reference names a private module"


def test_api_at_a_glance_links_every_public_method_and_nothing_else():
    """Every method and property of a public class is in "API at a glance" (linked to its
    reference entry), and nothing it links is missing: the reference shows no method the
    overview does not promise."""
    overview = (DOCS / "api-overview.md").read_text()
    linked = set(re.findall(r"\]\[(jaxckpt\.[\w.]+)\]", overview))
    classes = {n: v for n in jaxckpt.__all__ if inspect.isclass(v := getattr(jaxckpt, n))}
    members = {f"jaxckpt.{n}.{m}" for n, cls in classes.items() for m in public_members(cls)}
    undocumented = {  # the reference shows no member without a docstring: a dead link
        f"{n}.{m}"
        for n, cls in classes.items()
        for m in public_members(cls)
        if not inspect.getdoc(getattr(cls, m))
    }
    assert not undocumented, "public, but without a docstring"
    assert members - linked == set(), "public, but not in API at a glance"
    functions = {f"jaxckpt.{n}" for n in jaxckpt.__all__ if n != "errors"}
    assert linked - members - functions == set(), "linked, but not public"


def _overview_signatures() -> list[tuple[str, str]]:
    """Each call "API at a glance" prints with its arguments: (the object's path, the
    arguments as printed), from `[`name(args)`][path]` and `[`Name`][path]`(args)`."""
    overview = (DOCS / "api-overview.md").read_text()
    inline = re.findall(r"\[`[\w.]+\((.*?)\)`\]\[(jaxckpt\.[\w.]+)\]", overview)
    after = re.findall(r"\[`[\w.]+`\]\[(jaxckpt\.[\w.]+)\]`\((.*?)\)`", overview)
    return [(path, args) for args, path in inline] + after


def _printed_arguments(args: str) -> list[str]:
    """The arguments as printed, split at the commas between them (not those inside
    brackets or quotes)."""
    parts, depth, current, quote = [], 0, "", None
    for ch in args:
        if quote:
            quote = None if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(current.strip())
            current = ""
            continue
        current += ch
    return [p for p in [*parts, current.strip()] if p]


def test_api_at_a_glance_prints_the_codes_signatures():
    """Every signature "API at a glance" prints is the code's: its arguments in order, the
    keyword-only marker where the code has it, and each default printed equal to the code's
    (a printed `...` stands for the rest). Before: `incremental=False`, the code's None."""
    import signal
    import time

    from jaxckpt._local import LocalStore
    from jaxckpt._orbax import OrbaxStore

    names = {n: getattr(jaxckpt, n) for n in jaxckpt.__all__}
    names |= {"OrbaxStore": OrbaxStore, "LocalStore": LocalStore, "SIGTERM": signal.SIGTERM}
    names |= {"time": time}
    found = _overview_signatures()
    assert len(found) > 20, found  # (the patterns still match the page)
    for path, args in found:
        obj = jaxckpt
        for part in path.split(".")[1:]:
            obj = getattr(obj, part)
        params = [
            p
            for p in inspect.signature(
                obj.__init__ if inspect.isclass(obj) else obj
            ).parameters.values()
            if p.name != "self"
        ]
        expected: list[str] = []
        for p in params:
            if p.kind is p.KEYWORD_ONLY and not any(e.startswith("*") for e in expected):
                expected.append("*")
            stars = {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "")
            expected.append(stars + p.name)
        printed = _printed_arguments(args)
        shown = [a.split("=")[0] for a in printed if a != "..."]
        if "..." in printed:
            assert shown == [e for e in expected if e in shown], (path, shown, expected)
        else:
            assert shown == expected, (path, shown, expected)
        defaults = {p.name: p.default for p in params}
        for a in printed:
            name, _, value = a.partition("=")
            if value:  # (`every_steps=` names an argument, showing no default)
                assert eval(value, names) == defaults[name], (path, name, value, defaults[name])


def test_every_main_call_shows_an_example_the_doctests_run():
    """The calls a user starts from each carry an example in their docstring (pytest's
    --doctest-modules runs them, as `make test` does)."""
    main_calls = [
        jaxckpt.CheckpointManager,
        jaxckpt.CheckpointManager.save,
        jaxckpt.CheckpointManager.restore,
        jaxckpt.CheckpointManager.should_save,
        jaxckpt.open,
        jaxckpt.Checkpoint.read,
        jaxckpt.restore_or_init,
        jaxckpt.export_safetensors,
        jaxckpt.export_orbax,
        jaxckpt.copy_step,
        jaxckpt.save_safetensors,
        jaxckpt.load_safetensors,
    ]
    missing = [c.__qualname__ for c in main_calls if ">>> " not in (c.__doc__ or "")]
    assert not missing, missing


def test_the_reference_hook_finds_private_types():
    """docs/hooks/public_reference.py, which `make docs` runs on the built API page: the
    classes jaxckpt does not export are private, and the page names none of them."""
    check = hook("public_reference")
    private = check.private_classes()
    assert {"Reader", "Wanted", "StepInfo", "ReadRequest", "Placement"} <= private
    assert not private & {*jaxckpt.__all__, "CorruptCheckpointError"}
    page = "<code>read(info: <span>StepInfo</span>) -> Restored</code> <p>_layout.Listing</p>"
    assert check.named(page, private) == ["Listing", "StepInfo", "_layout.Listing"]
    assert check.named("<code>read(step: int) -> Restored</code>", private) == []


def test_the_vendored_inventories_are_curated_pys_and_each_entry_is_linked():
    """docs/inventories/: each project's inventory is what curated.py writes (no hand
    edit), each entry is linked from a docstring or a page (none kept for nothing), and
    Python's own inventory names the standard types the signatures show."""
    from mkdocstrings import Inventory

    curated = hook("curated", folder="inventories")
    sources = [*(REPO / "jaxckpt").rglob("*.py"), *DOCS.glob("*.md")]
    linked = "".join(path.read_text() for path in sources)
    for project, (_, _, entries) in curated.PROJECTS.items():
        written = (DOCS / "inventories" / f"{project}.inv").read_bytes()
        assert written == curated.inventory(project).format_sphinx(), project
        for name, _, _ in entries:
            assert f"][{name}]" in linked, f"{name}: in {project}.inv, linked nowhere"
    python = Inventory.parse_sphinx(io.BytesIO((DOCS / "inventories" / "python.inv").read_bytes()))
    assert {"os.PathLike", "typing.Any", "collections.abc.Mapping"} <= python.keys()


# ------------------------------------------------------------------------- CLI reference


def test_the_cli_reference_is_what_the_command_prints():
    """docs/cli.md's --help sections are generated at build time by docs/hooks/cli_help.py:
    they must be what `jaxckpt --help` and `jaxckpt ls --help` print, and name every
    command."""
    cli_help = hook("cli_help")
    texts = dict(cli_help.help_texts())
    assert "<!-- jaxckpt --help -->" in (DOCS / "cli.md").read_text()
    for command in ("ls", "inspect", "diff", "plan", "verify", "export", "rm"):
        assert f"jaxckpt {command}" in texts
    env = {"COLUMNS": str(cli_help.WIDTH), "JAX_PLATFORMS": "cpu"}
    for command in (["--help"], ["ls", "--help"]):
        proc = run_python("-m", "jaxckpt", *command, env=env)
        name = " ".join(["jaxckpt", *command[:-1]])
        assert proc.stdout.rstrip() == texts[name].rstrip()


# -------------------------------------------------------------------------------- plots

PLOT = re.compile(r"\[!\[[^\]]*\]\(([\w./-]+\.png)#only-(light|dark)\)\{ \.plot \}\]\(([\w./-]+)\)")


def test_every_plot_has_a_dark_twin_and_opens_whole():
    """A plot on a page is shown in the reader's scheme (the light figure on light pages,
    its dark twin, which benchmarks/figures.py draws beside it, on dark ones), keeps a
    legible size on a phone (class `plot`: docs/stylesheets/extra.css) and opens whole
    when tapped (a link to itself)."""
    images = 0
    for page in pages():
        text = page.read_text()
        images += len(re.findall(r"!\[", text))
        plots = PLOT.findall(text)
        for src, scheme, href in plots:
            assert src == href and (REPO / src).is_file(), (page.name, src, href)
            assert src.endswith("-dark.png") == (scheme == "dark"), (page.name, src)
        light = [src for src, scheme, _ in plots if scheme == "light"]
        dark = [src for src, scheme, _ in plots if scheme == "dark"]
        assert [s.replace(".png", "-dark.png") for s in light] == dark, page.name
        assert len(re.findall(r"!\[", text)) == len(plots), f"{page.name}: an image not so shown"
    assert images >= 4  # leaf_sweep.png and scale.png, each twice


# ------------------------------------------------------------------------------- search

# What users type, and the pages that answer it, which the site's search must list first (in
# any order: the search splits `LocalTier` as it splits `local tier`). API names find the
# reference, and the guide where the name is what it teaches; features their page; the FAQ
# where one of its questions names it.
SEARCHES = {
    "CheckpointManager": ["api/"],
    "restore": ["api/", "guide/", "faq/"],
    "target_on_mesh": ["api/"],
    "LocalTier": ["api/", "local-tier/"],
    "local tier": ["api/", "local-tier/"],
    "copy_step": ["api/"],
    "jaxckpt copy": ["cli/", "api/", "faq/"],
    "export_orbax": ["api/"],
    "IncompleteStepError": ["api/", "errors/"],
    "errors": ["api/", "errors/"],
    "pip install": ["install/"],
    "zstd": ["incremental/"],
    "compression": ["incremental/"],
    "incremental": ["incremental/"],
    "another mesh": ["resharding/"],
    "resharding": ["resharding/"],
    "verify": ["api/", "cli/", "integrity/"],
    "safetensors": ["api/", "hf/"],
    "Hugging Face": ["api/", "hf/", "faq/"],
    "preemption": ["api/", "preemption/"],
    "object storage": ["object-storage/"],
    "multi-host": ["multihost/"],
    "Orbax": ["from-orbax/", "faq/"],
    "deadline": ["deadlines/"],
    "Equinox": ["equinox/"],
}
REPORT = re.compile(r"(BENCHMARKS|RELIABILITY|CHANGELOG|benchmarks/results/.*)/")
SEEN = 5  # the results a reader sees first: a report page among them only after the others


def test_search_lists_the_page_a_user_wants_first(tmp_path):
    """The built site's search, run as the browser runs it (Material's own search worker,
    under Node.js: tests/search_order.js), lists first for each query of SEARCHES the pages
    that answer it, and among the first SEEN a report page (a table of timings, the
    changelog) only after every other page."""
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    build = [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)]
    subprocess.run(build, cwd=REPO, env=env, check=True, capture_output=True, timeout=300)
    order = [shutil.which("node") or "node", str(REPO / "tests" / "search_order.js"), str(site)]
    found = json.loads(
        subprocess.run(
            [*order, *SEARCHES], check=True, capture_output=True, text=True, timeout=120
        ).stdout
    )
    wrong = {}
    for query, pages in SEARCHES.items():
        seen = found[query][:SEEN]
        reports_last = sorted(seen, key=lambda p: bool(REPORT.fullmatch(p))) == seen
        if set(seen[: len(pages)]) != set(pages) or not reports_last:
            wrong[query] = seen
    assert not wrong, wrong


# ------------------------------------------------------------------ the architecture page

CHAIN_MODULES = (
    "jaxckpt._manager",
    "jaxckpt._tiers",
    "jaxckpt._reader",
    "jaxckpt._integrity",
    "jaxckpt._match",
    "jaxckpt._orbax",
    "jaxckpt._orbax_steps",
    "jaxckpt._jaxckpt_steps",
    "jaxckpt._read_interfaces",
    "jaxckpt._local",
    "jaxckpt._layout",
    "jaxckpt._transfer",
    "jaxckpt._spread",
    "jaxckpt._iterators",
)


def restore_chain() -> list[str]:
    page = (REPO / "docs" / "architecture.md").read_text()
    block = page[page.index("<!-- restore-chain -->") :].split("```text\n", 1)[1]
    block = block.split("```", 1)[0]
    return re.findall(r"^\s*([\w.]+)\s{2,}", block, re.M)


def test_the_restore_chain_names_what_the_code_has():
    """docs/architecture.md's restore chain: every name in it is in the modules the chain
    runs through, as written (a rename fails here, not silently in the docs)."""
    import importlib

    modules = [importlib.import_module(m) for m in CHAIN_MODULES]
    chain = restore_chain()
    assert len(chain) >= 15, chain
    for name in chain:
        first, *rest = name.split(".")
        if first in ("_iterators", "_transfer", "_spread"):  # named by their module
            obj = importlib.import_module(f"jaxckpt.{first}")
        else:
            owners = [m for m in modules if hasattr(m, first)]
            assert owners, f"{name}: no module of the chain has {first}"
            obj = getattr(owners[0], first)
        for attr in rest:
            assert hasattr(obj, attr), f"{name}: no {attr} in {obj}"
            obj = getattr(obj, attr)


def test_the_restore_walk_goes_down_no_module_imports_in_a_cycle_or_is_long():
    """The reader and the tiers never import the manager (nothing calls back up), and
    jaxckpt's modules import one another without a cycle: every import, read by ast, those
    inside functions and under TYPE_CHECKING included (a lazy import is a circle all the
    same: it only hides it from the interpreter)."""
    import ast

    names = {
        ".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
        for p in (REPO / "jaxckpt").rglob("*.py")
    }
    packages = {"jaxckpt", "jaxckpt.hf", "jaxckpt.cli"}  # re-exports: not layers
    graph: dict[str, set[str]] = {}
    for path in (REPO / "jaxckpt").rglob("*.py"):
        module = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.ImportFrom)
                and node.module
                and node.module.startswith("jaxckpt")
            ):
                imported.add(node.module)
                imported.update(f"{node.module}.{a.name}" for a in node.names)
            elif isinstance(node, ast.Import):
                imported.update(a.name for a in node.names if a.name.startswith("jaxckpt"))
        graph[module] = (imported & names) - packages - {module}
    for low in ("jaxckpt._reader", "jaxckpt._tiers"):
        assert "jaxckpt._manager" not in graph[low], f"{low} imports the manager"
    assert "jaxckpt._tiers" not in graph["jaxckpt._reader"]

    def cycle_from(start: str, path: list[str]) -> list[str] | None:
        for nxt in sorted(graph.get(path[-1], ())):
            if nxt == start:
                return [*path, nxt]
            if nxt not in path and (found := cycle_from(start, [*path, nxt])):
                return found
        return None

    for module in sorted(graph.keys() - packages):
        assert cycle_from(module, [module]) is None, cycle_from(module, [module])
    sizes = {
        str(p.relative_to(REPO)): len(p.read_text().splitlines())
        for p in (REPO / "jaxckpt").rglob("*.py")
    }
    # Over 550 lines a module is flagged for review (split it along a concern it holds,
    # never pack it to fit); over 650 it fails.
    if review := {m: n for m, n in sizes.items() if 550 < n <= 650}:
        warnings.warn(f"modules over 550 lines, to split by what they do: {review}", stacklevel=1)
    long = {m: n for m, n in sizes.items() if n > 650}
    assert not long, f"modules over 650 lines (split them by what they do): {long}"

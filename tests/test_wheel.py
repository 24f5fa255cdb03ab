"""The wheel a user installs: built from the package's files, it holds what the package needs
and runs on its own.

It is built as pip builds it (`pip wheel --no-deps`), without build isolation so that it
needs no network (the venv's setuptools, which the test extra pins), from a copy of the
files the build reads: a stale build/ folder in the checkout cannot leak into it. It is
installed with `pip install --no-deps --target` into a folder of its own, and run from there
with that folder alone on PYTHONPATH, the venv's site-packages giving the dependencies: the
checkout is neither the working directory nor on the path, and the test asserts that
`jaxckpt` was imported from the folder, so a module or data file missing from the wheel
fails here rather than for a user.
"""

from __future__ import annotations

import email.parser
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from conftest import REPO

TIMEOUT = 300


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    source = tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    shutil.copytree(
        REPO / "jaxckpt", source / "jaxckpt", ignore=shutil.ignore_patterns("__pycache__")
    )
    out = tmp_path_factory.mktemp("wheel")
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    subprocess.run(
        [*pip, "wheel", str(source), "--no-deps", "--no-build-isolation", "-w", str(out), "-q"],
        check=True,
        timeout=TIMEOUT,
    )
    (built,) = out.glob("jaxckpt-*.whl")
    return built


def test_the_wheel_holds_the_package_and_its_metadata(wheel):
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        (info,) = {n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info")}
        metadata = email.parser.Parser().parsestr(archive.read(f"{info}/METADATA").decode())
        entry_points = archive.read(f"{info}/entry_points.txt").decode()
    assert {"jaxckpt/__init__.py", "jaxckpt/errors.py", "jaxckpt/py.typed"} <= names
    sources = {p.relative_to(REPO).as_posix() for p in (REPO / "jaxckpt").rglob("*.py")}
    assert sources <= names, f"left out of the wheel: {sorted(sources - names)}"
    assert {n.split("/")[0] for n in names} == {"jaxckpt", info}  # no tests, examples, docs
    assert metadata["Name"] == "jaxckpt"
    assert metadata["License-Expression"] == "Apache-2.0"  # PEP 639: an SPDX expression
    script = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]["jaxckpt"]
    assert f"jaxckpt = {script}" in entry_points


def test_the_installed_wheel_imports_and_runs_its_command(wheel, tmp_path):
    target = tmp_path / "installed"
    subprocess.run(
        [
            *(sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"),
            *("install", "--no-deps", "--no-index", "--target", str(target), "-q", str(wheel)),
        ],
        check=True,
        timeout=TIMEOUT,
    )
    # Only the installed folder on the path (the venv's site-packages holds the
    # dependencies), run from a directory of its own: never the checkout.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=str(target), JAX_PLATFORMS="cpu")
    run = {"cwd": tmp_path, "env": env, "capture_output": True, "text": True, "timeout": TIMEOUT}

    code = (
        "import sys, jaxckpt, jaxckpt.cli, jaxckpt.errors\n"
        "for name, module in sorted(sys.modules.items()):\n"
        "    if name.split('.')[0] == 'jaxckpt':\n"
        "        print(module.__file__)\n"
    )
    imported = subprocess.run([sys.executable, "-c", code], **run)
    assert imported.returncode == 0, imported.stderr[-3000:]
    files = imported.stdout.split()
    assert files and all(Path(f).is_relative_to(target) for f in files), files

    command = subprocess.run([str(target / "bin" / "jaxckpt"), "--help"], **run)
    assert command.returncode == 0, command.stderr[-3000:]
    assert command.stdout.startswith("Usage: jaxckpt [OPTIONS] COMMAND [ARGS]...")
    for name in ("ls", "inspect", "diff", "plan", "verify", "export", "rm"):
        assert f"  {name} " in command.stdout

"""Starts the child Python processes of the tests, the reliability trials and the benchmarks,
all one way: this interpreter, the repo as working directory, and the repo's code importable
(jaxckpt, reliability, benchmarks; tests/ too, for the tests' own `children` package).

    launch.start("-m", "children.freezer", directory, stderr=subprocess.DEVNULL)  # a Popen
    launch.run("-m", "jaxckpt", "verify", directory, timeout=120)  # waited for, bounded

A child is a real module run with `-m` (so ruff reads it), not code in a string.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def environment(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment with the repo (and tests/) first on PYTHONPATH, then `env`."""
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    path = os.pathsep.join([str(REPO), str(REPO / "tests"), *inherited])
    return {**os.environ, "PYTHONPATH": path, **(env or {})}


def start(*argv: object, env: Mapping[str, str] | None = None, **popen: Any) -> subprocess.Popen:
    """Starts `python *argv` (`"-m", module, its arguments...`) in the repo and returns at
    once; `popen` goes to subprocess.Popen (stdout=, stderr=, text=...)."""
    command = [sys.executable, *map(str, argv)]
    return subprocess.Popen(command, **{"cwd": REPO, "env": environment(env), **popen})


def run(
    *argv: object, timeout: float, env: Mapping[str, str] | None = None, **kwargs: Any
) -> subprocess.CompletedProcess:
    """`start`, waited for: killed, and subprocess.TimeoutExpired raised, after `timeout`
    seconds; `kwargs` go to subprocess.run (capture_output=, text=...)."""
    command = [sys.executable, *map(str, argv)]
    return subprocess.run(
        command, timeout=timeout, **{"cwd": REPO, "env": environment(env), **kwargs}
    )

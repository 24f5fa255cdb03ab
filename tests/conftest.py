"""Test set-up: 8 CPU devices, before anything touches a device."""

import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def mesh():
    """A (4, 2) data x model mesh with the classic (Auto) axis behaviour."""
    auto = (jax.sharding.AxisType.Auto,) * 2
    return jax.make_mesh((4, 2), ("data", "model"), axis_types=auto)


@pytest.fixture
def ckpt_dir(tmp_path):
    return tmp_path / "ckpt"


def run_python(*args: str, timeout: float = 300, check: bool = True, **kwargs):
    """Runs a fresh Python process with the repo importable; output captured as text."""
    env = {**os.environ, "PYTHONPATH": str(REPO), **kwargs.pop("env", {})}
    proc = subprocess.run(
        [sys.executable, *args],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        **kwargs,
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{args} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}"
            f"\n--- stderr\n{proc.stderr[-4000:]}"
        )
    return proc

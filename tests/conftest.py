"""Test set-up: 8 CPU devices, before anything touches a device."""

import os
import signal
from pathlib import Path

import jax
import pytest

from reliability import gcs, launch

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)
os.environ.update(gcs.LOOPBACK_ENV)  # before gcsfs or google-auth is imported
# The dispositions the preemption tests (and their children, which inherit them) rely on,
# whatever this process inherited: a job started in the background of a non-interactive
# shell ignores SIGINT (Python then installs no KeyboardInterrupt), and a runner may ignore
# SIGTERM; a handler ignored before the manager's stays ignored after it, as it should.
signal.signal(signal.SIGINT, signal.default_int_handler)
signal.signal(signal.SIGTERM, signal.SIG_DFL)

REPO = Path(__file__).resolve().parent.parent
collect_ignore = ["old_orbax"]  # run by an old Orbax's own Python (tests/test_from_orbax.py)


class Iterator:
    """A data iterator with JSON state, like grain's DatasetIterator."""

    def __init__(self, position=0):
        self.position = position

    def __next__(self):
        self.position += 1
        return self.position

    def get_state(self):
        return {"position": self.position}

    def set_state(self, state):
        self.position = state["position"]


@pytest.fixture(scope="session")
def mesh():
    """A (4, 2) data x model mesh with the classic (Auto) axis behaviour."""
    auto = (jax.sharding.AxisType.Auto,) * 2
    return jax.make_mesh((4, 2), ("data", "model"), axis_types=auto)


@pytest.fixture
def ckpt_dir(tmp_path):
    return tmp_path / "ckpt"


@pytest.fixture(scope="session")
def gcs_log(tmp_path_factory):
    """The GCS emulator's log: a line per request (`reliability.gcs.requests` reads it)."""
    return tmp_path_factory.mktemp("gcs") / "server.log"


@pytest.fixture(scope="session")
def gcs_bucket(gcs_log):
    """gs://jaxckpt-test on a real GCS emulator on 127.0.0.1, for this test session."""
    proc, url = gcs.start(gcs_log, log_level="info")
    patch = pytest.MonkeyPatch()
    for key, value in gcs.point_at(url).items():
        patch.setenv(key, value)
    yield f"gs://{gcs.BUCKET}"
    patch.undo()
    gcs.stop(proc)


@pytest.fixture
def gcs_dir(gcs_bucket, request):
    """A fresh gs:// prefix per test."""
    return f"{gcs_bucket}/{request.node.name}"


def run_python(*args: str, timeout: float = 300, check: bool = True, **kwargs):
    """Runs a fresh Python process (reliability.launch: in the repo, with it importable) to
    its end; output captured as text."""
    proc = launch.run(*args, timeout=timeout, capture_output=True, text=True, **kwargs)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{args} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}"
            f"\n--- stderr\n{proc.stderr[-4000:]}"
        )
    return proc

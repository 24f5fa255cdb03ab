"""Test set-up: 8 CPU devices, before anything touches a device."""

import dataclasses
import os
import re
import signal
from collections.abc import Callable
from pathlib import Path

import jax
import pytest

from reliability import gcs, launch, s3

REPO = Path(__file__).resolve().parent.parent

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)
# What XLA compiles is kept in one cache on disk, shared by this process, the other test
# workers and every child interpreter and job process (they inherit the environment): the
# same training step compiled by dozens of fresh processes is compiled once a machine. A
# hit is the executable the compile would have made, so no claim changes: a fresh
# interpreter is still fresh, only its compile is skipped. The size limit also has JAX
# lock each entry's read and write (filelock), so no process reads one half written.
# (`make clean` removes it.)
COMPILE_CACHE = {
    "JAX_COMPILATION_CACHE_DIR": str(REPO / ".jax-cache"),
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    "JAX_COMPILATION_CACHE_MAX_SIZE": str(1 << 30),
}
os.environ.update(COMPILE_CACHE)
for name, value in COMPILE_CACHE.items():
    jax.config.update(name.lower(), int(value) if value.isdigit() else value)
os.environ.update(gcs.LOOPBACK_ENV)  # before gcsfs or google-auth is imported
os.environ.update(s3.LOOPBACK_ENV)  # before boto3 or s3fs make a client
# The dispositions the preemption tests (and their children, which inherit them) rely on,
# whatever this process inherited: a job started in the background of a non-interactive
# shell ignores SIGINT (Python then installs no KeyboardInterrupt), and a runner may ignore
# SIGTERM; a handler ignored before the manager's stays ignored after it, as it should.
signal.signal(signal.SIGINT, signal.default_int_handler)
signal.signal(signal.SIGTERM, signal.SIG_DFL)

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


@dataclasses.dataclass(frozen=True)
class Bucket:
    """A bucket on a real object-storage server on 127.0.0.1, for this test session."""

    url: str  # gs://jaxckpt-test or s3://jaxckpt-test
    log: Path  # the server's log: a line per request
    parse: Callable[..., list[tuple[str, str]]]  # (log, since) -> [(kind, object)]

    def requests(self, since: int) -> list[tuple[str, str]]:
        """The requests made since byte `since` of the log (`mark`), as (kind, object)."""
        return self.parse(self.log, since)

    def mark(self) -> int:
        return self.log.stat().st_size


@pytest.fixture(scope="session")
def gcs_server(tmp_path_factory):
    """gs://jaxckpt-test on a real GCS emulator (fake-gcs-server)."""
    log = tmp_path_factory.mktemp("gcs") / "server.log"
    proc, url = gcs.start(log, log_level="info")
    patch = pytest.MonkeyPatch()
    for key, value in gcs.point_at(url).items():
        patch.setenv(key, value)
    yield Bucket(f"gs://{gcs.BUCKET}", log, gcs.requests)
    patch.undo()
    gcs.stop(proc)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """s3://jaxckpt-test on a real S3 server (moto's)."""
    log = tmp_path_factory.mktemp("s3") / "server.log"
    proc, url = s3.start(log)
    patch = pytest.MonkeyPatch()
    for key, value in s3.point_at(url).items():
        patch.setenv(key, value)
    yield Bucket(f"s3://{s3.BUCKET}", log, s3.requests)
    patch.undo()
    s3.stop(proc)


SERVERS = {"gs": "gcs_server", "s3": "s3_server"}  # each store's server fixture


@pytest.fixture(params=list(SERVERS))
def bucket(request):
    """Each object store in turn: a test taking it holds on gs:// and on s3:// alike."""
    return request.getfixturevalue(SERVERS[request.param])


def prefix_on(bucket: Bucket, request) -> str:
    """A fresh prefix per test (no glob characters: fsspec would expand them)."""
    return f"{bucket.url}/{re.sub(r'[^A-Za-z0-9_.-]', '-', request.node.name)}"


@pytest.fixture
def bucket_dir(bucket, request):
    """A fresh prefix per test, on each object store in turn."""
    return prefix_on(bucket, request)


@pytest.fixture
def gcs_bucket(gcs_server):
    return gcs_server.url


@pytest.fixture
def gcs_dir(gcs_server, request):
    """A fresh gs:// prefix per test."""
    return prefix_on(gcs_server, request)


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


# Modules whose module-scoped fixtures cost a child process or a training run: each one's
# tests run on one of `make test`'s workers, so that each fixture is made once, not once
# per worker (tests marked one_job_at_a_time stay in their own group).
ONE_WORKER_MODULES = {
    "test_bounded_reads",
    "test_cli",
    "test_cli_escapes",
    "test_cli_messages",
    "test_from_orbax",
    "test_hf",
    "test_hf_complex",
    "test_hf_select",
    "test_hostile",
    "test_packed_hostile",
    "test_resume_exact",
    "test_wheel",
}


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own, which reads the groups
def pytest_collection_modifyitems(items):
    for item in items:
        module = item.path.stem
        if module in ONE_WORKER_MODULES and not item.get_closest_marker("xdist_group"):
            item.add_marker(pytest.mark.xdist_group(module))


def pytest_collection_finish(session):
    """`make test`'s workers (--dist loadgroup) must keep the tests marked
    one_job_at_a_time (tests/multihost.py) on one worker; pytest-xdist marks each such
    test's id with its group, and where a pytest release stops that (pytest-xdist#1386) the
    jobs would run side by side on two cores, each past the timeouts it was written for."""
    if getattr(session.config.option, "loadgroup", False):
        ungrouped = [
            item.nodeid
            for item in session.items
            if item.get_closest_marker("xdist_group") and "@" not in item.nodeid
        ]
        if ungrouped:
            raise pytest.UsageError(
                f"pytest-xdist did not group {len(ungrouped)} tests marked xdist_group (first: "
                f"{ungrouped[0]}); install the pytest version pyproject.toml pins"
            )

"""A local directory this process cannot read (mode 000): the persistent tier still serves
latest_step and restore (a warning names the directory), and a local save's failure is a
SaveError naming the directory and the cause. Root reads any mode, so the job runs as an
unprivileged user (it drops root itself, `children.local_tier.unreadable`)."""

import os
import shutil
import tempfile
from pathlib import Path

import pytest
from children import local_tier as job
from multihost import one_job_at_a_time, run_job

pytestmark = one_job_at_a_time  # every test here runs a multi-process job

NOBODY = 65534


@pytest.fixture
def base():
    """A folder the unprivileged job may write in (pytest's own are root's, mode 700)."""
    folder = Path(tempfile.mkdtemp(prefix="jaxckpt-unreadable-"))
    if os.geteuid() == 0:
        os.chown(folder, NOBODY, NOBODY)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def test_an_unreadable_local_directory_leaves_the_persistent_tier_serving(base):
    local = base / "local"
    (result,) = run_job(
        job.unreadable,
        processes=1,
        devices=8,
        args={"persistent": str(base / "persistent"), "local": str(local), "uid": NOBODY},
        timeout=240,
    )
    report = result.report()
    assert report["latest"] == [10], report
    assert report["restore"] == [[10, "persistent"]], report
    error, message = report["save"]
    assert error == "SaveError", report
    assert f"local step 14 into {local}" in message and "Permission denied" in message, message
    assert "close" not in report, report
    assert f"{local} cannot be read" in result.stderr, result.stderr[-3000:]

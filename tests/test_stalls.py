"""A stopped process (SIGSTOP: stuck in a driver call, on a dead mount) never hangs the
others: every wait between processes ends by the deadline its call states (`timeout_s`),
in a named error naming the stopped process, and no committed step is lost.

Real 2-process `jax.distributed` jobs on 127.0.0.1; the stop is armed at a point in the
stopped process itself, never timed (tests/children/stalls.py)."""

from children import stalls
from multihost import one_job_at_a_time, run_job

import jaxckpt

pytestmark = one_job_at_a_time  # every test here runs a multi-process job

TIMEOUT_S = 6
# The deadline is the bound; the slack covers wording the error on a loaded machine. Before
# each wait had one, these calls hung (saves, restores), or took 2.1x timeout_s (the
# commit's two barriers in a row).
SLACK_S = 4


def _stalled(tmp_path, scenario):
    args = {"dir": str(tmp_path / "ckpt"), "scratch": str(tmp_path), "timeout_s": TIMEOUT_S}
    survivor, stopped = run_job(scenario, processes=2, devices=4, args=args, check=False)
    assert stopped.returncode == -9, stopped.stderr[-2000:]  # killed by process 0, stopped
    return survivor.report(), args


def _committed(args) -> list[int]:
    return stalls.committed(args["dir"])


def test_a_save_waits_for_a_stopped_process_no_longer_than_timeout_s(tmp_path):
    report, args = _stalled(tmp_path, stalls.stopped_before_save)
    assert report["type"] == "SaveError", report
    assert report["missing"] == [1], report
    assert (
        "process(es) 1 did not reach the save of step 2 within 6 s (timeout_s)" in (report["error"])
    )
    assert "Step 2 was not committed; committed steps are intact: 1." in report["error"]
    assert report["seconds"] < TIMEOUT_S + SLACK_S, report
    assert _committed(args) == [1]


def test_a_restore_waits_for_a_stopped_process_no_longer_than_timeout_s(tmp_path):
    report, args = _stalled(tmp_path, stalls.stopped_before_restore)
    assert report["type"] == "ProcessesMissingError", report
    assert report["missing"] == [1], report
    assert report["error"].startswith(
        "process(es) 1 did not reach the restore of the latest step within 6 s (timeout_s)"
    )
    assert report["seconds"] < TIMEOUT_S + SLACK_S, report
    assert _committed(args) == [1]


def test_a_commit_waits_for_a_stopped_process_once_not_once_per_barrier(tmp_path):
    report, args = _stalled(tmp_path, stalls.stopped_once_written)
    assert report["type"] == "SaveError", report
    assert report["missing"] == [1], report
    assert "Step 2 was not committed; committed steps are intact: 1." in report["error"]
    # from save(2)'s start: its deadline, not one per barrier of the commit
    assert report["save_returned_s"] + report["seconds"] < TIMEOUT_S + SLACK_S, report
    assert _committed(args) == [1]


def test_a_lock_process_0_cannot_take_fails_every_process_not_only_process_0(tmp_path):
    # Process 0 takes the writer lock for the job; the others used to wait for it in
    # Orbax's first barrier, for ever once it had left with LockedError.
    args = {"dir": str(tmp_path / "ckpt"), "timeout_s": TIMEOUT_S}
    with jaxckpt.CheckpointManager(args["dir"]):  # this test's process holds the lock
        results = run_job(stalls.open_locked, processes=2, devices=4, args=args)
    first, other = (r.report() for r in results)
    assert first["type"] == "LockedError" and "is being written by" in first["error"], first
    assert other["type"] == "LockedError", other
    assert other["error"].startswith("process 0 could not take the writer lock of"), other

"""Every process makes every agreement of a call, decided once: real multi-process jobs whose
processes meet the store at uneven times (random delays at every storage seam, injected
through the manager's store seam, `faults.manager`) save many steps under retention, and every kept step
restores bitwise; processes that make different calls are told so at once."""

import pytest
from children import agreements
from multihost import one_job_at_a_time, run_job

import jaxckpt

pytestmark = one_job_at_a_time


@pytest.mark.parametrize(
    ("processes", "devices", "retention"),
    [
        (2, 4, {"keep_last": 2}),
        (4, 2, {"keep_last": 3, "keep_every": 10}),
    ],
    ids=["2-processes-keep-last", "4-processes-keep-every"],
)
def test_uneven_processes_under_retention_commit_every_save(
    tmp_path, processes, devices, retention
):
    # Before: process 1, listing later, no longer saw the step process 0 had just deleted
    # and skipped the deletion's barrier; the barriers then paired with the next save's, and
    # the job died at step 4 (ProcessesMissingError, then an abort).
    saves = 30
    args = {"dir": str(tmp_path), "saves": saves, "seed": processes, "delay_s": 0.05, **retention}
    results = run_job(
        agreements.saves_under_retention,
        processes=processes,
        devices=devices,
        args=args,
        timeout=300,
    )
    policy = jaxckpt.RetentionPolicy(**retention)
    want = sorted(set(range(1, saves + 1)) - set(policy.steps_to_delete(range(1, saves + 1))))
    for r in results:
        assert r.report()["kept"] == want


def test_processes_making_different_calls_are_told_at_once_which(tmp_path):
    results = run_job(
        agreements.disagreeing,
        processes=2,
        devices=4,
        args={"dir": str(tmp_path)},
        timeout=120,
    )
    deleting, saving = (r.report() for r in results)
    assert deleting["error"] == "ProcessesDisagreeError"
    assert saving["error"] == "SaveError" and saving["cause"] == "ProcessesDisagreeError"
    for report in (deleting, saving):
        assert report["agreements"] == {
            "0": "the deletion of step 1",
            "1": "the start of the save of step 2",
        }
        assert report["waited_s"] < 30  # at once, not at the deadline (60 s)
    # Nothing was deleted or started: step 1 stands, whole.
    with jaxckpt.open(tmp_path) as ckpt:
        assert ckpt.steps() == [1]
        assert all(r.ok for r in jaxckpt.verify(tmp_path))


def test_process_0s_decisions_and_its_refusals_reach_every_process(tmp_path):
    results = run_job(
        agreements.decided_for_all, processes=2, devices=4, args={"dir": str(tmp_path)}
    )
    for r in results:
        report = r.report()
        assert report["steps"] == [1]
        kind, message, step = report["errors"]["delete"]
        assert (kind, step) == ("StepNotFoundError", 7)
        assert "step 7 is not a committed checkpoint" in message
        kind, message, _ = report["errors"]["save"]
        assert kind == "StepExistsError"
        assert "step 1 already exists" in message


def test_a_restore_where_one_process_reads_slower_than_timeout_s_in_all_succeeds(tmp_path):
    # Before: timeout_s counted from the restore's start, so process 0 named process 1,
    # alive and reading, as missing once its whole restore took longer than that.
    # Process 1 reads 0.4 s slower at each of its 8 reads (a batch of two parts each): 3.2 s
    # behind in all, 0.4 s at any one agreement.
    timeout_s = 1.5
    results = run_job(
        agreements.uneven_restore,
        processes=2,
        devices=4,
        args={"dir": str(tmp_path), "leaves": 16, "timeout_s": timeout_s, "delay_s": 0.4},
    )
    for r in results:
        report = r.report()
        assert report["same"], report
    assert results[1].report()["took_s"] > timeout_s  # (the case: longer than it in all)

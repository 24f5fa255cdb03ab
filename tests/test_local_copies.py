"""The local tier's copies between real processes (127.0.0.1, gloo): a peer that is stopped
(SIGSTOP) never blocks a save, and wait() reports it after its timeout; a link in a local
directory is never followed by a copy. The protocol itself, fed what a hostile peer could
send: tests/test_peers.py."""

import os

from children import local_tier as job
from multihost import one_job_at_a_time, run_job

pytestmark = one_job_at_a_time  # every test here runs a multi-process job


def _args(tmp_path, **more):
    return {
        "persistent": str(tmp_path / "persistent"),
        "local": str(tmp_path / "local-{process}"),
        "start": 0,
        "data": True,
        **more,
    }


def test_a_stopped_peer_never_blocks_a_save_and_wait_names_it(tmp_path):
    results = run_job(
        job.freeze, processes=2, devices=4, args=_args(tmp_path, copy_timeout_s=10), timeout=300
    )
    frozen, thawed = (r.report() for r in results)
    # Both saves returned while process 1 was stopped, before any copy to it failed: the
    # copies go in the background (a blocked save waits for the copy's socket to time out).
    assert frozen["stopped_after_save"], frozen
    assert frozen["warned_before_save_returned"] == [], frozen
    # wait() waits for the copies, bounded: it returned with process 1 still stopped, and
    # said which process did not answer.
    assert frozen["stopped_after_wait"], frozen
    assert any("process 1" in w and "did not answer" in w for w in frozen["warned_by_wait"])
    assert frozen["latest"] == thawed["latest"] == 16
    assert "16" in os.listdir(tmp_path / "local-0" / "replicas" / "1")  # sent once resumed


def test_a_link_in_a_local_directory_is_never_followed(tmp_path):
    """Process 0's folder for process 1's copies is a link to a folder elsewhere: no copy
    is written there; the job goes on without those copies, and says why."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (tmp_path / "local-0" / "replicas").mkdir(parents=True)
    (tmp_path / "local-0" / "replicas" / "1").symlink_to(outside)
    results = run_job(job.train, processes=2, devices=4, args=_args(tmp_path, stop=14), timeout=240)
    assert [r.report()["latest"] for r in results] == [14, 14]
    assert list(outside.iterdir()) == []
    assert (tmp_path / "local-0" / "replicas" / "1").is_symlink()
    assert "is a link" in results[0].stderr, results[0].stderr[-3000:]
    assert "no copy of step 14: process 0" in results[1].stderr, results[1].stderr[-3000:]


def test_a_copy_sends_only_the_blocks_that_changed_since_the_last(tmp_path):
    """A state whose 2 MiB leaf is frozen: each process's later parts reach its peer as the
    blocks that changed, the rest kept from the peer's copy of the step before."""
    results = run_job(job.frozen, processes=2, devices=4, args=_args(tmp_path), timeout=240)
    for result in results:
        report = result.report()
        assert report["latest"] == 6
        taken = {step: (received, total) for step, received, total in report["taken"]}
        assert sorted(taken) == [2, 4, 6], taken
        assert taken[2][0] == taken[2][1] > 2**20  # the first copy: every byte of the part
        for step in (4, 6):
            received, total = taken[step]
            assert received < total / 4, taken  # `big`'s 1 MiB a process never resent

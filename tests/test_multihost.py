"""Multi-host checkpoints with JAX's multi-controller runtime: real processes, gloo, 127.0.0.1.

Saved from 2 processes x 4 devices, restored in 1 process with 8 and with 2 devices and on 2
processes with another mesh; saved from 1 process, restored on 2. Every process checks the
shards it holds against the global array.
"""

import json
import shutil

import pytest
from children import multihost_checkpoints as job
from multihost import one_job_at_a_time, run_job

from reliability.faults import largest_data_file

pytestmark = one_job_at_a_time  # every test here runs a multi-process job


@pytest.fixture(scope="module")
def saved_once(tmp_path_factory):
    """Step 5 saved by a 2-process job, once for the tests here."""
    where = tmp_path_factory.mktemp("saved-on-two-hosts")
    results = run_job(job.save, processes=2, devices=4, args={"dir": str(where)})
    assert [r.report() for r in results] == [{"steps": [5]}] * 2
    assert sorted(p.name for p in (where / "5" / "data").glob("process_*")) == [
        "process_0-of-2.json",
        "process_1-of-2.json",
    ]
    return where


@pytest.fixture
def saved_on_two_hosts(saved_once, tmp_path):
    """That step, copied into the test's own directory (which it may damage)."""
    shutil.copytree(saved_once, tmp_path, dirs_exist_ok=True)
    return tmp_path


def test_each_process_packs_each_shard_once_and_the_replicated_ones_spread(saved_on_two_hosts):
    packed = saved_on_two_hosts / "5" / "packed"
    index = [json.loads((packed / f"{p}-of-2.json").read_text()) for p in (0, 1)]
    w = [doc["leaves"]["state"]["w"]["pieces"] for doc in index]
    assert len(w[0]) == len(w[1]) == 4  # w on a (4, 2) mesh: 4 of its 8 shards each
    pieces = [
        {(n, str(b)) for n, e in doc["leaves"]["state"].items() for _, b, _ in e["pieces"]}
        for doc in index
    ]
    assert not pieces[0] & pieces[1]  # no shard written twice
    # b (replicated over the processes) and step (a NumPy leaf) are not all process 0's
    assert {n for n, _ in pieces[1]} - {"w"}, pieces
    for doc, p in zip(index, (0, 1), strict=True):
        assert (packed / f"{p}-of-2.bin").stat().st_size == doc["bytes"]


def test_replicated_pieces_are_spread_by_their_own_bytes(tmp_path):
    # Each process writes about half: 256 + 2 x 64 and 6 x 64 bytes. Before, a leaf's bytes
    # were counted with the dtype of the first leaf of its shape and sharding: each int8
    # piece as 256 bytes, so process 0 wrote 512 bytes and process 1 256.
    run_job(
        job.save_replicated_leaves_of_two_dtypes,
        processes=2,
        devices=4,
        args={"dir": str(tmp_path)},
    )
    packed = tmp_path / "1" / "packed"
    assert [(packed / f"{p}-of-2.bin").stat().st_size for p in (0, 1)] == [384, 384]


@pytest.mark.parametrize(
    "devices, shape, specs",
    [
        (8, (2, 4), {"w": ["model", "data"], "b": ["data"]}),
        (2, (2, 1), {"w": ["data"], "b": []}),
    ],
    ids=["8-devices", "2-devices"],
)
def test_two_host_save_restores_in_one_process(saved_on_two_hosts, devices, shape, specs):
    args = {"dir": str(saved_on_two_hosts), "shape": shape, "specs": specs}
    (result,) = run_job(job.restore_without_then_with_data, processes=1, devices=devices, args=args)
    report = result.report()
    assert report["step"] == 5 and report["meta"] == {"hosts": 2} and report["position"] is None
    # Per-process data state saved by 2 processes cannot go to 1: a clear error, not a guess.
    assert "process_0-of-1.json" in report["data_error"]
    assert "process_0-of-2.json" in report["data_error"]


def test_two_host_save_restores_on_two_hosts_with_another_mesh(saved_on_two_hosts):
    args = {"dir": str(saved_on_two_hosts)}
    results = run_job(job.plan_and_restore_onto_2_4, processes=2, devices=4, args=args)
    reports = [r.report() for r in results]
    assert [r["position"] for r in reports] == [100, 101]
    # Each process reads its half of w and b (and the scalar step, 8 bytes, in full).
    half = (64 * 16 * 4 + 16 * 4) // 2 + 8
    assert all(r["plan_reads"] == [half, half] for r in reports)


def test_one_host_save_restores_on_two_hosts(tmp_path):
    run_job(job.save, processes=1, devices=8, args={"dir": str(tmp_path)})
    results = run_job(job.restore_onto_2_4, processes=2, devices=4, args={"dir": str(tmp_path)})
    assert [r.report()["step"] for r in results] == [5, 5]


# A process that dies during a save of step 2 (job.dies_during_step_2): the survivor's wait()
# raises SaveError, then the test's own process lists the steps and restores the latest.
def _kill_during_step_2(tmp_path, kill):
    """Runs job.dies_during_step_2 with process 1 killed at the moment `kill` names, on 2
    processes: the survivor's report, then what another process finds in the directory."""
    # The survivor's barrier times out after 5 s (timeout_s); JAX aborts it once the dead
    # peer's heartbeat lapses. 30 s between the two leaves it the time to word and print its
    # report on a loaded machine (with 10 s, a loaded run aborted it first). Its report
    # printed, it exits at once rather than wait out that heartbeat in JAX's shutdown.
    args = {"dir": str(tmp_path / "ckpt"), "scratch": str(tmp_path), "heartbeat_s": 30}
    survivor, dead = run_job(
        job.dies_during_step_2,
        processes=2,
        devices=4,
        args=args | {"kill": kill, "exit_at_once": True},
        check=False,
    )
    assert dead.returncode == -9, dead.stderr[-2000:]
    report = survivor.report()
    assert report["missing"] == [1], report
    assert report["seconds"] < 60  # bounded by timeout_s per barrier, not a hang
    # What a process that was not in the job finds there (this one: no job start-up).
    return report, job.list_and_restore(args["dir"])


def test_a_process_dying_before_it_confirms_its_part_fails_the_others_and_never_commits(
    tmp_path,
):
    # Process 1 dies once its shards are written, before the barrier where every process
    # confirms its part.
    report, after = _kill_during_step_2(tmp_path, "once_written")
    assert not report["committed"]
    assert "saving step 2 failed in the background: " in report["error"]
    assert "Process(es) 1 never reached the commit barrier" in report["error"]
    assert "Step 2 was not committed; committed steps are intact: 1." in report["error"]
    assert after == {"steps": [1], "restored": 1, "intact": True}  # no partial step 2


def test_a_process_dying_after_the_write_barrier_leaves_a_whole_step_and_says_so(tmp_path):
    # Every part is written and confirmed; process 0 kills process 1 while it commits. The
    # step is whole, and the survivor's error must not claim that it was not committed.
    # Process 1 dies at the commit's last barrier (the survivor's save fails, naming it) or
    # past it (the survivor's save succeeds, and its next one names it): either is whole.
    report, after = _kill_during_step_2(tmp_path, "while_committing")
    if report["error"] is not None:
        assert report["committed"]
        assert "saving step 2 failed in the background: " in report["error"]
        assert "Process(es) 1 never confirmed the commit" in report["error"]
        assert "it resumes from step 2" in report["error"]
        assert (
            "Step 2 committed all the same and is whole; committed steps: 1, 2."
            in (report["error"])
        )
    else:
        assert "process(es) 1 did not reach the save of step 3" in report["next_error"].lower()
    assert after == {"steps": [1, 2], "restored": 2, "intact": True}


def test_two_processes_agree_that_a_corrupt_step_is_corrupt(saved_on_two_hosts):
    # Each process checks a share of the files: both must refuse, whichever found the damage.
    victim = largest_data_file(saved_on_two_hosts / "5")
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    args = {"dir": str(saved_on_two_hosts)}
    results = run_job(job.restore_a_corrupt_step, processes=2, devices=4, args=args)
    errors = [r.report()["error"] for r in results]
    assert all(e and "step 5" in e and "is corrupt" in e for e in errors), errors
    assert any("contents changed" in e for e in errors), errors

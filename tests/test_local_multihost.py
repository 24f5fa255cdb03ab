"""The host-local tier across real processes (127.0.0.1, gloo): every process its own local
directory, a shared persistent one; each case kills the job, damages what a preemption or a
replaced host would, restarts it, and compares the continuation bitwise with a run that was
never interrupted (states and data positions, per process)."""

import shutil
import signal

import pytest
from children import local_tier as job
from multihost import one_job_at_a_time, run_job

pytestmark = one_job_at_a_time  # every test here runs a multi-process job


def _run(tmp_path, processes, devices, *, local=None, check=True, **args):
    args = {
        "persistent": str(tmp_path / "persistent"),
        "local": local or str(tmp_path / "local-{process}"),
        "start": 0,
        "stop": 20,
        "data": True,
        **args,
    }
    return run_job(
        job.train, processes=processes, devices=devices, args=args, timeout=240, check=check
    )


def _killed(results):
    """Every process killed; or aborted by JAX once it saw another one gone (SIGABRT)."""
    dead = (-signal.SIGKILL, -signal.SIGABRT)
    assert all(r.returncode in dead for r in results), [
        (r.returncode, r.stderr[-2000:]) for r in results
    ]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Per process count: each process's report of the run from step 0 to 20 unbroken."""
    found = {}

    def of(processes, devices):
        if (processes, devices) not in found:
            where = tmp_path_factory.mktemp(f"unbroken-{processes}")
            found[processes, devices] = [r.report() for r in _run(where, processes, devices)]
        return found[processes, devices]

    return of


@pytest.fixture(scope="module")
def killed_at_14(tmp_path_factory):
    """A 2-process job (4 devices each) killed after its step 14, run once: `take(tmp_path)`
    copies its persistent and local directories into a test's own (six tests start there)."""
    where = tmp_path_factory.mktemp("killed-at-14")
    _killed(_run(where, 2, 4, kill_after=14, check=False))

    def take(tmp_path):
        shutil.copytree(where, tmp_path, symlinks=True, dirs_exist_ok=True)

    return take


def _same_continuation(got, want):
    for g, w in zip(got, want, strict=True):
        assert (g["step"], g["position"], g["digest"]) == (w["step"], w["position"], w["digest"])


@pytest.mark.parametrize("processes, devices", [(2, 4), (4, 2)])
def test_a_job_killed_after_a_local_step_resumes_from_it(
    tmp_path, uninterrupted, killed_at_14, processes, devices
):
    if (processes, devices) == (2, 4):
        killed_at_14(tmp_path)
    else:
        _killed(_run(tmp_path, processes, devices, kill_after=14, check=False))
    resumed = [r.report() for r in _run(tmp_path, processes, devices, start="latest")]
    assert {(r["restored"], r["tier"]) for r in resumed} == {(14, "local")}
    _same_continuation(resumed, uninterrupted(processes, devices))


def test_local_directories_lost_or_moved(tmp_path, uninterrupted, killed_at_14):
    killed_at_14(tmp_path)
    (tmp_path / "local-0").rename(tmp_path / "moved")  # process 0's: at a new path
    moved = [str(tmp_path / "moved"), str(tmp_path / "local-1")]
    resumed = [r.report() for r in _run(tmp_path, 2, 4, local=moved, start="latest", stop=14)]
    assert {(r["restored"], r["tier"]) for r in resumed} == {(14, "local")}

    _killed(_run(tmp_path, 2, 4, local=moved, start="latest", kill_after=16, check=False))
    shutil.rmtree(tmp_path / "local-1")  # process 1's host replaced: its directory is empty
    results = _run(tmp_path, 2, 4, local=moved, start="latest")
    resumed = [r.report() for r in results]
    assert {(r["restored"], r["tier"]) for r in resumed} == {(16, "local")}
    assert "step 16 fetched from process 0's copy" in results[1].stderr
    _same_continuation(resumed, uninterrupted(2, 4))


def test_a_job_killed_right_after_wait_keeps_the_copy_of_its_newest_step(tmp_path, uninterrupted):
    """wait() returns once the copies are where they are due, both ways: process 0 is killed
    right after its wait(), and process 1's copy of that step (sent last: process 1 saves
    the step only once process 0's copy of it arrived) is at process 0 all the same."""
    _killed(_run(tmp_path, 2, 4, kill_after=14, copy_first=True, check=False))
    shutil.rmtree(tmp_path / "local-1")  # process 1's host replaced
    results = _run(tmp_path, 2, 4, start="latest")
    resumed = [r.report() for r in results]
    assert {(r["restored"], r["tier"]) for r in resumed} == {(14, "local")}
    assert "step 14 fetched from process 0's copy" in results[1].stderr
    _same_continuation(resumed, uninterrupted(2, 4))


def test_after_going_back_to_an_older_step_no_newer_local_step_returns(tmp_path, uninterrupted):
    """Restored to step 10 (and killed at once): the local steps 12-16 and their copies are
    of a run that does not go on; were the copies kept, they would make 16 whole again."""
    _killed(_run(tmp_path, 2, 4, kill_after=16, check=False))
    _killed(_run(tmp_path, 2, 4, start="latest", restore_step=10, kill_after=10, check=False))
    resumed = [r.report() for r in _run(tmp_path, 2, 4, start="latest")]
    assert {(r["restored"], r["tier"]) for r in resumed} == {(10, "persistent")}
    _same_continuation(resumed, uninterrupted(2, 4))


def test_a_lost_directory_without_copies_restores_the_persistent_step(tmp_path, uninterrupted):
    _killed(_run(tmp_path, 2, 4, kill_after=14, replicas=0, check=False))
    assert not (tmp_path / "local-0" / "replicas").exists()
    shutil.rmtree(tmp_path / "local-1")
    resumed = [r.report() for r in _run(tmp_path, 2, 4, start="latest", replicas=0)]
    assert {(r["restored"], r["tier"]) for r in resumed} == {(10, "persistent")}
    _same_continuation(resumed, uninterrupted(2, 4))


def test_every_local_directory_lost_restores_the_persistent_step(
    tmp_path, uninterrupted, killed_at_14
):
    killed_at_14(tmp_path)
    for p in (0, 1):
        shutil.rmtree(tmp_path / f"local-{p}")
    resumed = [r.report() for r in _run(tmp_path, 2, 4, start="latest")]
    assert {(r["restored"], r["tier"]) for r in resumed} == {(10, "persistent")}
    _same_continuation(resumed, uninterrupted(2, 4))


def test_a_process_killed_mid_local_save_leaves_the_newest_complete_step(tmp_path, uninterrupted):
    _killed(_run(tmp_path, 2, 4, kill_in_local_write=16, check=False))
    assert (tmp_path / "local-0" / "16").is_dir()  # process 0 wrote its part of 16
    assert not (tmp_path / "local-1" / "16").exists()  # process 1 died before its rename
    resumed = [r.report() for r in _run(tmp_path, 2, 4, start="latest")]
    assert {(r["restored"], r["tier"]) for r in resumed} == {(14, "local")}
    _same_continuation(resumed, uninterrupted(2, 4))


def _flip(path, at=100):
    raw = bytearray(path.read_bytes())
    raw[at] ^= 0x01
    path.write_bytes(bytes(raw))


def test_a_corrupted_local_file_is_replaced_by_its_copy(tmp_path, uninterrupted, killed_at_14):
    killed_at_14(tmp_path)
    _flip(tmp_path / "local-1" / "14" / "packed" / "1-of-2.bin")
    results = _run(tmp_path, 2, 4, start="latest")
    resumed = [r.report() for r in results]
    assert {(r["restored"], r["tier"]) for r in resumed} == {(14, "local")}
    assert "step 14 fetched from process 0's copy" in results[1].stderr
    _same_continuation(resumed, uninterrupted(2, 4))


def test_a_corrupted_file_and_copy_pass_the_step_over(tmp_path, uninterrupted, killed_at_14):
    killed_at_14(tmp_path)
    _flip(tmp_path / "local-1" / "14" / "packed" / "1-of-2.bin")
    _flip(tmp_path / "local-0" / "replicas" / "1" / "14" / "packed" / "1-of-2.bin")
    results = _run(tmp_path, 2, 4, start="latest")
    resumed = [r.report() for r in results]
    assert {(r["restored"], r["tier"]) for r in resumed} == {(12, "local")}
    assert "local step 14" in results[1].stderr and "checksum mismatch" in results[1].stderr
    assert "process(es) [1]" in results[0].stderr  # process 0 says who refused
    _same_continuation(resumed, uninterrupted(2, 4))


def test_a_restart_on_another_process_count_restores_the_persistent_step(tmp_path, killed_at_14):
    killed_at_14(tmp_path)
    (report,) = [
        r.report()
        for r in _run(tmp_path, 1, 8, local=str(tmp_path / "local-0"), start="latest", data=False)
    ]
    assert (report["restored"], report["tier"]) == (10, "persistent")

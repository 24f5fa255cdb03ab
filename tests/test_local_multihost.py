"""The host-local tier across real processes (127.0.0.1, gloo): every process its own local
directory, a shared persistent one; each case kills the job, damages what a preemption or a
replaced host would, restarts it, and compares the continuation bitwise with a run that was
never interrupted (states and data positions, per process).

Each test is a case (`@case`): its body yields the jobs it runs and asserts on what they
did. The cases' jobs run together (tests/multihost.py's `run_cases`): a job that is killed
in a job of its own, the runs that end normally (the resumes) one after another in one job
per process count. Every case runs at the module's first test; each test then raises what
its own case raised."""

import shutil
import signal

import pytest
from children import local_tier as job
from multihost import Run, one_job_at_a_time, run_cases

pytestmark = one_job_at_a_time  # every test here runs a multi-process job

TIMEOUT_S = 240
CASES = {}  # test id -> (its body, a generator of Runs; its (processes, devices)): `case`


def case(*shapes):
    """Makes a generator `body(where, given, processes, devices)` a test of a case: the body
    runs in the module's `outcomes` (with the other cases' jobs), once per (processes,
    devices) in `shapes` (default: 2 x 4), in a directory `where` of its own; `given` has the
    module's shared runs. The test raises what the body raised."""
    shapes = shapes or ((2, 4),)

    def register(body):
        for shape in shapes:
            CASES[_name(body.__name__, shapes, shape)] = body, shape

        if len(shapes) == 1:

            def test(outcomes):
                _raise(outcomes[body.__name__])
        else:

            @pytest.mark.parametrize("shape", shapes, ids=[f"{p}-{d}" for p, d in shapes])
            def test(outcomes, shape):
                _raise(outcomes[_name(body.__name__, shapes, shape)])

        test.__name__ = test.__qualname__ = body.__name__
        test.__doc__ = body.__doc__
        return test

    return register


def _raise(raised):
    if raised is not None:
        raise raised


def _name(name, shapes, shape):
    return name if len(shapes) == 1 else f"{name}[{shape[0]}-{shape[1]}]"


def _args(where, *, local=None, **args):
    return {
        "persistent": str(where / "persistent"),
        "local": local or str(where / "local-{process}"),
        "start": 0,
        "stop": 20,
        "data": True,
        **args,
    }


def train(where, processes=2, devices=4, **args) -> Run:
    """A run of job.train in `where`: killed when `kill_after` or `kill_in_local_write` says."""
    killed = "kill_after" in args or "kill_in_local_write" in args
    return Run(job.train, _args(where, **args), processes, devices, killed=killed)


def _killed(results):
    """Every process killed; or aborted by JAX once it saw another one gone (SIGABRT)."""
    dead = (-signal.SIGKILL, -signal.SIGABRT)
    assert all(r.returncode in dead for r in results), [
        (r.returncode, r.stderr[-2000:]) for r in results
    ]


class Given:
    """What the cases share: the uninterrupted runs, and one 2 x 4 job killed after step 14."""

    def __init__(self, tmp_path_factory):
        self.factory, self.found = tmp_path_factory, {}
        self.at_14 = tmp_path_factory.mktemp("killed-at-14")
        _killed(train(self.at_14, kill_after=14).run(timeout=TIMEOUT_S, check=False))

    def uninterrupted(self, processes, devices):
        """Each process's report of the run from step 0 to 20 unbroken."""
        if (processes, devices) not in self.found:
            where = self.factory.mktemp(f"unbroken-{processes}")
            results = train(where, processes, devices).run(timeout=TIMEOUT_S, check=True)
            self.found[processes, devices] = [r.report() for r in results]
        return self.found[processes, devices]

    def killed_at_14(self, where):
        """The 2 x 4 job killed after its step 14: its directories copied into `where`."""
        shutil.copytree(self.at_14, where, symlinks=True, dirs_exist_ok=True)


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    """Every case run, its jobs with the others': what each raised (None: it passed)."""
    given = Given(tmp_path_factory)
    bodies = {
        name: (
            lambda body=body, shape=shape, name=name: body(
                tmp_path_factory.mktemp(name[:40]), given, *shape
            )
        )
        for name, (body, shape) in CASES.items()
    }
    return run_cases(bodies, timeout=TIMEOUT_S)


def _same_continuation(got, want):
    for g, w in zip(got, want, strict=True):
        assert (g["step"], g["position"], g["digest"]) == (w["step"], w["position"], w["digest"])


def _resumed(results):
    return [r.report() for r in results]


@case((2, 4), (4, 2))
def test_a_job_killed_after_a_local_step_resumes_from_it(where, given, processes, devices):
    if (processes, devices) == (2, 4):
        given.killed_at_14(where)
    else:
        _killed((yield train(where, processes, devices, kill_after=14)))
    resumed = _resumed((yield train(where, processes, devices, start="latest")))
    assert {(r["restored"], r["tier"]) for r in resumed} == {(14, "local")}
    _same_continuation(resumed, given.uninterrupted(processes, devices))


@case()
def test_local_directories_lost_or_moved(where, given, *_):
    given.killed_at_14(where)
    (where / "local-0").rename(where / "moved")  # process 0's: at a new path
    moved = [str(where / "moved"), str(where / "local-1")]
    resumed = _resumed((yield train(where, local=moved, start="latest", stop=14)))
    assert {(r["restored"], r["tier"]) for r in resumed} == {(14, "local")}

    _killed((yield train(where, local=moved, start="latest", kill_after=16)))
    shutil.rmtree(where / "local-1")  # process 1's host replaced: its directory is empty
    results = yield train(where, local=moved, start="latest")
    resumed = _resumed(results)
    assert {(r["restored"], r["tier"]) for r in resumed} == {(16, "local")}
    assert "step 16 fetched from process 0's copy" in results[1].stderr
    _same_continuation(resumed, given.uninterrupted(2, 4))


@case()
def test_a_job_killed_right_after_wait_keeps_the_copy_of_its_newest_step(where, given, *_):
    """wait() returns once the copies are where they are due, both ways: process 0 is killed
    right after its wait(), and process 1's copy of that step (sent last: process 1 saves
    the step only once process 0's copy of it arrived) is at process 0 all the same."""
    _killed((yield train(where, kill_after=14, copy_first=True)))
    shutil.rmtree(where / "local-1")  # process 1's host replaced
    results = yield train(where, start="latest")
    resumed = _resumed(results)
    assert {(r["restored"], r["tier"]) for r in resumed} == {(14, "local")}
    assert "step 14 fetched from process 0's copy" in results[1].stderr
    _same_continuation(resumed, given.uninterrupted(2, 4))


@case()
def test_after_going_back_to_an_older_step_no_newer_local_step_returns(where, given, *_):
    """Restored to step 10 (and killed at once): the local steps 12-16 and their copies are
    of a run that does not go on; were the copies kept, they would make 16 whole again."""
    _killed((yield train(where, kill_after=16)))
    _killed((yield train(where, start="latest", restore_step=10, kill_after=10)))
    resumed = _resumed((yield train(where, start="latest")))
    assert {(r["restored"], r["tier"]) for r in resumed} == {(10, "persistent")}
    _same_continuation(resumed, given.uninterrupted(2, 4))


@case()
def test_a_lost_directory_without_copies_restores_the_persistent_step(where, given, *_):
    _killed((yield train(where, kill_after=14, replicas=0)))
    assert not (where / "local-0" / "replicas").exists()
    shutil.rmtree(where / "local-1")
    resumed = _resumed((yield train(where, start="latest", replicas=0)))
    assert {(r["restored"], r["tier"]) for r in resumed} == {(10, "persistent")}
    _same_continuation(resumed, given.uninterrupted(2, 4))


@case()
def test_every_local_directory_lost_restores_the_persistent_step(where, given, *_):
    given.killed_at_14(where)
    for p in (0, 1):
        shutil.rmtree(where / f"local-{p}")
    resumed = _resumed((yield train(where, start="latest")))
    assert {(r["restored"], r["tier"]) for r in resumed} == {(10, "persistent")}
    _same_continuation(resumed, given.uninterrupted(2, 4))


@case()
def test_a_process_killed_mid_local_save_leaves_the_newest_complete_step(where, given, *_):
    _killed((yield train(where, kill_in_local_write=16)))
    assert (where / "local-0" / "16").is_dir()  # process 0 wrote its part of 16
    assert not (where / "local-1" / "16").exists()  # process 1 died before its rename
    resumed = _resumed((yield train(where, start="latest")))
    assert {(r["restored"], r["tier"]) for r in resumed} == {(14, "local")}
    _same_continuation(resumed, given.uninterrupted(2, 4))


def _flip(path, at=100):
    raw = bytearray(path.read_bytes())
    raw[at] ^= 0x01
    path.write_bytes(bytes(raw))


@case()
def test_a_corrupted_local_file_is_replaced_by_its_copy(where, given, *_):
    given.killed_at_14(where)
    _flip(where / "local-1" / "14" / "packed" / "1-of-2.bin")
    results = yield train(where, start="latest")
    resumed = _resumed(results)
    assert {(r["restored"], r["tier"]) for r in resumed} == {(14, "local")}
    assert "step 14 fetched from process 0's copy" in results[1].stderr
    _same_continuation(resumed, given.uninterrupted(2, 4))


@case()
def test_a_corrupted_file_and_copy_pass_the_step_over(where, given, *_):
    given.killed_at_14(where)
    _flip(where / "local-1" / "14" / "packed" / "1-of-2.bin")
    _flip(where / "local-0" / "replicas" / "1" / "14" / "packed" / "1-of-2.bin")
    results = yield train(where, start="latest")
    resumed = _resumed(results)
    assert {(r["restored"], r["tier"]) for r in resumed} == {(12, "local")}
    assert "local step 14" in results[1].stderr and "checksum mismatch" in results[1].stderr
    assert "process(es) [1]" in results[0].stderr  # process 0 says who refused
    _same_continuation(resumed, given.uninterrupted(2, 4))


@case()
def test_a_restart_on_another_process_count_restores_the_persistent_step(where, given, *_):
    given.killed_at_14(where)
    local = str(where / "local-0")
    (report,) = _resumed((yield train(where, 1, 8, local=local, start="latest", data=False)))
    assert (report["restored"], report["tier"]) == (10, "persistent")

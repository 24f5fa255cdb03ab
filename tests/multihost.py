"""Runs real multi-process JAX jobs on this machine: N processes on 127.0.0.1, gloo, CPU.

A job is a function of a `children` module, `def scenario(job) -> dict | None`: each process
runs it in `children.job` (distributed initialisation with a bounded timeout first), with
`job.process_id`, `job.num_processes` and `job.args` (a dict). Every wait is bounded: a job
that does not finish in time is killed and reported with its output.

`run_in_turn` runs several scenarios that end normally in one job, one after another;
`run_cases` runs several tests' jobs together that way (tests/test_local_multihost.py).
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass

import pytest
from children.job import SCENARIO, in_turn

from reliability import launch

# Marks a test that runs multi-process jobs: `make test`'s parallel workers (pytest-xdist,
# --dist loadgroup) run every test so marked on one worker, one after another, so that two
# jobs never share this machine's cores (each test's timeouts assume its job has them).
one_job_at_a_time = pytest.mark.xdist_group("multi-process-jobs")


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str

    def report(self) -> dict:
        """The JSON object the scenario returned (its process's last `RESULT ` line)."""
        lines = [line for line in self.stdout.splitlines() if line.startswith("RESULT ")]
        assert lines, (
            f"no RESULT line (rc={self.returncode})\n{self.stdout[-2000:]}\n{self.stderr[-12000:]}"
        )
        return json.loads(lines[-1][len("RESULT ") :])


def run_job(
    scenario: Callable,
    *,
    processes: int,
    devices: int,
    args: dict | None = None,
    timeout: float = 180,
    check: bool = True,
    while_running=None,
) -> list[Result]:
    """Runs `scenario` in `processes` processes with `devices` CPU devices each; waits for
    all of them.

    `while_running(popens)`, if given, is called once all have started (e.g. to signal one).
    """
    port = launch.free_port()
    where = (scenario.__module__, scenario.__name__)
    procs = [
        launch.start(
            "-m",
            "children.job",
            *where,
            i,
            processes,
            devices,
            port,
            json.dumps(args or {}),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(processes)
    ]
    results = []
    try:
        if while_running is not None:
            while_running(procs)
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            results.append(Result(p.returncode, out, err))
    finally:
        for p in procs:
            p.kill()
    if check:
        for i, r in enumerate(results):
            assert r.returncode == 0, (
                f"process {i} exited {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
            )
    return results


def run_in_turn(
    scenarios: Iterable[tuple[Callable, dict]], *, processes: int, devices: int, timeout: float
) -> list[list[Result]]:
    """Several (scenario, args) one after another in one job (one start-up, one gloo ring),
    each ending normally: per scenario, each process's Result, its output from that
    scenario's start to the next one's. AssertionError if the job fails."""
    turns = [[f.__module__, f.__name__, args] for f, args in scenarios]
    job = run_job(
        in_turn, processes=processes, devices=devices, args={"turns": turns}, timeout=timeout
    )
    split = [(_parts(r.stdout, len(turns)), _parts(r.stderr, len(turns))) for r in job]
    return [[Result(0, out[i], err[i]) for out, err in split] for i in range(len(turns))]


def _parts(output: str, n: int) -> list[str]:
    """`output` cut at in_turn's SCENARIO lines: the n scenarios' own."""
    parts: list[list[str]] = [[] for _ in range(n)]
    at = -1
    for line in output.splitlines(keepends=True):
        if line.startswith(SCENARIO):
            at = int(line[len(SCENARIO) :])
        elif at >= 0:
            parts[at].append(line)
    return ["".join(p) for p in parts]


@dataclass(frozen=True)
class Run:
    """One job a case asks for (see `run_cases`): `scenario` on `processes` x `devices`;
    `killed`: it kills its processes, so it needs a job of its own."""

    scenario: Callable
    args: dict
    processes: int = 2
    devices: int = 4
    killed: bool = False

    def run(self, *, timeout: float, check: bool) -> list[Result]:
        """This run in a job of its own (`run_job`)."""
        return run_job(
            self.scenario,
            processes=self.processes,
            devices=self.devices,
            args=self.args,
            timeout=timeout,
            check=check,
        )


Case = Callable[[], Generator[Run, list[Result], None]]


def run_cases(cases: dict[str, Case], *, timeout: float) -> dict[str, Exception | None]:
    """Runs several cases' jobs together, fewer jobs than one per run. A case is a generator
    (a test's body, its assertions included) that yields each Run it needs and gets that
    run's Results back. Round by round, every case's next run: those `killed` each in a job
    of their own, the others of one shape one after another in one job (`run_in_turn`).
    Returns each case's outcome: None, or what it raised (or the shared job that failed)."""
    outcome: dict[str, Exception | None] = {}
    waiting: dict[str, tuple[Generator, Run]] = {}

    def advance(name: str, gen: Generator, got: list[Result] | Exception | None) -> None:
        """The case goes on with what its run gave (its first run: None) to its next run."""
        try:
            waiting[name] = gen, gen.throw(got) if isinstance(got, Exception) else gen.send(got)
        except StopIteration:
            outcome[name] = None
        except Exception as e:  # the case's own assertion, reported by its test
            outcome[name] = e

    for name, case in cases.items():
        advance(name, case(), None)
    while waiting:
        now, waiting = waiting, {}
        got: dict[str, list[Result] | Exception] = {}
        shapes: dict[tuple[int, int], list[str]] = {}
        for name, (_, run) in now.items():
            if run.killed:
                got[name] = _attempt(run.run, timeout=timeout, check=False)
            else:
                shapes.setdefault((run.processes, run.devices), []).append(name)
        for (processes, devices), names in shapes.items():
            runs = [(now[n][1].scenario, now[n][1].args) for n in names]
            each = _attempt(
                run_in_turn, runs, processes=processes, devices=devices, timeout=timeout
            )
            if isinstance(each, Exception):
                each = [each] * len(names)
            got.update(zip(names, each, strict=True))
        for name, (gen, _) in now.items():
            advance(name, gen, got[name])
    return outcome


def _attempt(call: Callable, *args, **kwargs):
    """What `call` returned, or the exception it raised (a job that failed or hung)."""
    try:
        return call(*args, **kwargs)
    except Exception as e:
        return e

"""Runs real multi-process JAX jobs on this machine: N processes on 127.0.0.1, gloo, CPU.

A job is a function of a `children` module, `def scenario(job) -> dict | None`: each process
runs it in `children.job` (distributed initialisation with a bounded timeout first), with
`job.process_id`, `job.num_processes` and `job.args` (a dict). Every wait is bounded: a job
that does not finish in time is killed and reported with its output.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from dataclasses import dataclass

import pytest

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

"""Runs real multi-process JAX jobs on this machine: N processes on 127.0.0.1, gloo, CPU.

Each process executes PRELUDE (distributed initialisation with a bounded timeout) and then
the test's body, with `PROCESS_ID`, `NUM_PROCESSES` and `ARGS` (a dict) defined. Every wait
is bounded: a job that does not finish in time is killed and reported with its output.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from dataclasses import dataclass

from conftest import REPO

PRELUDE = """
import json, os, sys
import jax
jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", {devices})
jax.config.update("jax_cpu_collectives_implementation", "gloo")
PROCESS_ID, NUM_PROCESSES = {process_id}, {num_processes}
ARGS = json.loads({args!r})
if NUM_PROCESSES > 1:
    jax.distributed.initialize(
        "127.0.0.1:{port}", num_processes=NUM_PROCESSES, process_id=PROCESS_ID,
        initialization_timeout=60, heartbeat_timeout_seconds=ARGS.get("heartbeat_s", 100),
    )
import numpy as np
import jax.numpy as jnp
import jaxckpt
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str

    def report(self) -> dict:
        """The JSON object the body printed on its last `RESULT ` line."""
        lines = [line for line in self.stdout.splitlines() if line.startswith("RESULT ")]
        assert lines, (
            f"no RESULT line (rc={self.returncode})\n{self.stdout[-2000:]}\n{self.stderr[-12000:]}"
        )
        return json.loads(lines[-1][len("RESULT ") :])


def run_job(
    body: str,
    *,
    processes: int,
    devices: int,
    args: dict | None = None,
    timeout: float = 180,
    check: bool = True,
    while_running=None,
) -> list[Result]:
    """Starts `processes` processes with `devices` CPU devices each; waits for all of them.

    `while_running(popens)`, if given, is called once all have started (e.g. to signal one).
    """
    port = free_port()
    procs = []
    for i in range(processes):
        code = PRELUDE.format(
            devices=devices,
            process_id=i,
            num_processes=processes,
            args=json.dumps(args or {}),
            port=port,
        ) + textwrap.dedent(body)
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", code],
                cwd=REPO,
                env={**os.environ, "PYTHONPATH": str(REPO)},
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
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

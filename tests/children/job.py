"""One process of a multi-process JAX job on this machine, as tests/multihost.py starts them:

    python -m children.job MODULE FUNCTION PROCESS_ID NUM_PROCESSES DEVICES PORT ARGS_JSON

Sets JAX up (CPU devices, gloo; with 2 processes or more, `jax.distributed` on 127.0.0.1
with a bounded start-up), then calls MODULE.FUNCTION(job); the dict it returns, if any, is
printed as this process's `RESULT <json>` line. With `"exit_at_once": true` in ARGS the
process then ends without JAX's shutdown barrier, which a job whose peer was killed would
wait in until the peer's heartbeat lapsed (`heartbeat_s`).
"""

import importlib
import json
import os
import sys
from dataclasses import dataclass
from typing import Any

from reliability import launch

SCENARIO = "SCENARIO "  # in_turn's line as each scenario starts


@dataclass(frozen=True)
class Job:
    process_id: int
    num_processes: int
    args: dict[str, Any]


def main() -> None:
    module, function, process_id, num_processes, devices, port, args = sys.argv[1:]
    job = Job(int(process_id), int(num_processes), json.loads(args))
    heartbeat = job.args.get("heartbeat_s", 100)
    launch.join_job(
        devices, job.num_processes, job.process_id, port, heartbeat_timeout_seconds=heartbeat
    )
    _run(module, function, job)
    if job.args.get("exit_at_once"):
        sys.stderr.flush()
        os._exit(0)


def in_turn(job: Job) -> None:
    """Several scenarios in this one job, one after another (tests/multihost.py's
    `run_in_turn`): `job.args["turns"]` holds [module, function, args] each. Each prints a
    `SCENARIO <i>` line on stdout and on stderr as it starts, and its RESULT line."""
    for i, (module, function, args) in enumerate(job.args["turns"]):
        for stream in (sys.stdout, sys.stderr):
            print(f"{SCENARIO}{i}", file=stream, flush=True)
        _run(module, function, Job(job.process_id, job.num_processes, args))


def _run(module: str, function: str, job: Job) -> None:
    """`module.function(job)`; the dict it returns, if any, printed as its RESULT line."""
    report = getattr(importlib.import_module(module), function)(job)
    if report is not None:
        print("RESULT " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main()

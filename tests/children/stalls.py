"""The jobs of tests/test_stalls.py (run by children.job in every process): process 1 stops
itself (SIGSTOP) at a point armed before it, never timed, while process 0 saves or
restores; process 0 reports the error it got and how long it waited, then kills process 1
(its pid in the scratch folder, written before step 1 was agreed) and leaves at once."""

import json
import os
import signal
import sys
import time
from pathlib import Path

import jax.numpy as jnp

import jaxckpt
from children.job import Job
from jaxckpt import _internals
from reliability import faults


def state(step: int) -> dict:
    """The state every step saves here and in children.notices."""
    return {"w": jnp.arange(1024, dtype=jnp.float32) + step}


def _manager(job: Job) -> jaxckpt.CheckpointManager:
    Path(job.args["scratch"], f"pid{job.process_id}").write_text(str(os.getpid()))
    return jaxckpt.CheckpointManager(job.args["dir"], timeout_s=job.args["timeout_s"])


def _stop() -> None:
    faults.stop_here()  # process 0 kills us


def _report_and_leave(job: Job, call, **extra) -> None:
    """Process 0: `call()`, then its error's type, text, missing processes and seconds
    printed as the RESULT line; process 1 killed; gone without JAX's shutdown barrier
    (which would wait for the dead process)."""
    t0 = time.monotonic()
    try:
        call()
        report = {"error": None}
    except jaxckpt.errors.JaxckptError as e:
        report = {"error": str(e), "type": type(e).__name__}
        report["missing"] = getattr(e, "missing_processes", None)
    report |= {"seconds": time.monotonic() - t0} | extra
    os.kill(int(Path(job.args["scratch"], "pid1").read_text()), signal.SIGKILL)
    print("RESULT " + json.dumps(report), flush=True)
    sys.stdout.flush()
    os._exit(0)


def stopped_before_save(job: Job) -> None:
    """Both save step 1; process 1 stops before its save of step 2."""
    m = _manager(job)
    m.save(1, state=state(1))
    m.wait()
    if job.process_id == 1:
        _stop()
    _report_and_leave(job, lambda: m.save(2, state=state(2)))


def stopped_before_restore(job: Job) -> None:
    """Both save step 1; process 1 stops before its restore."""
    m = _manager(job)
    m.save(1, state=state(1))
    m.wait()
    if job.process_id == 1:
        _stop()
    _report_and_leave(job, lambda: m.restore(state={"w": jnp.zeros(1024, jnp.float32)}))


def stopped_once_written(job: Job) -> None:
    """Both save step 1; process 1 stops once its part of step 2 is written, before the
    barrier that precedes the commit: process 0 waits in its save's background (Orbax's
    barriers, two in a row) until the deadline the save started."""
    m = _manager(job)
    m.save(1, state=state(1))
    m.wait()

    def stop_once_written() -> None:
        if job.process_id == 1:
            _stop()

    with _internals.on_writes_done(stop_once_written):
        t0 = time.monotonic()
        m.save(2, state=state(2))
        _report_and_leave(job, m.wait, save_returned_s=time.monotonic() - t0)


def committed(directory: str) -> list[int]:
    """The committed steps in `directory`, as a process that was not in the job lists them
    (the test's own); the latest read back whole."""
    with jaxckpt.open(directory) as ckpt:
        steps = ckpt.steps()
        restored = ckpt.read(state={"w": jnp.zeros(1024, jnp.float32)})
        assert (restored.state["w"] == state(restored.step)["w"]).all()
    return steps


def open_locked(job: Job) -> dict:
    """Both open a manager on a directory whose writer lock another process holds."""
    try:
        jaxckpt.CheckpointManager(job.args["dir"], timeout_s=job.args["timeout_s"])
        return {"type": None}
    except jaxckpt.errors.JaxckptError as e:
        return {"type": type(e).__name__, "error": str(e)}

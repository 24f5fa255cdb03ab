"""The jobs of tests/test_preemption.py that stop a process (run by children.job in every
process): process 1 stopped (SIGSTOP) where the others wait for it to agree on a step to
save, after a preemption notice or for `every_seconds`; process 0 reports the error it got
and when, kills process 1 (its pid in the scratch folder) and leaves at once, without JAX's
shutdown barrier, which would wait for the dead process."""

import json
import os
import signal
import sys
import time
from pathlib import Path

import jaxckpt
from children.job import Job
from children.stalls import state
from jaxckpt import _internals


def _report_and_leave(job: Job, error: Exception | None, **extra) -> None:
    report = {"error": str(error) if error else None, "type": type(error).__name__}
    report |= {"missing": getattr(error, "missing_processes", None), "at": time.time()} | extra
    os.kill(int(Path(job.args["scratch"], "pid1").read_text()), signal.SIGKILL)
    print("RESULT " + json.dumps(report), flush=True)
    sys.stdout.flush()
    os._exit(0)


def _started(job: Job, m: jaxckpt.CheckpointManager) -> None:
    """Step 1 committed, this process's pid written, then its ready file."""
    Path(job.args["scratch"], f"pid{job.process_id}").write_text(str(os.getpid()))
    m.save(1, state=state(1))
    m.wait()
    Path(job.args["scratch"], f"ready{job.process_id}").touch()


def sigterm_to_both(job: Job) -> None:
    """A training loop that saves only for a preemption; the parent stops process 1 and
    sends SIGTERM to both (tests/test_preemption.py); process 0 reports how should_save
    ended."""
    policy = jaxckpt.PreemptionPolicy(timeout_s=job.args["timeout_s"])
    m = jaxckpt.CheckpointManager(job.args["dir"], preemption=policy)
    _started(job, m)
    try:
        for step in range(2, 100_000):
            time.sleep(0.01)  # the work of a step
            if m.should_save(step):
                m.save(step, state=state(step))
                break
        error = None
    except jaxckpt.errors.JaxckptError as e:
        error = e
    _report_and_leave(job, error)


def _stopped(pid: int, timeout: float = 60) -> None:
    """Until process `pid` is stopped (its state in /proc), bounded."""
    deadline = time.monotonic() + timeout
    while Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":
        assert time.monotonic() < deadline, f"process {pid} did not stop in {timeout} s"
        time.sleep(0.01)


def stopped_every_seconds(job: Job) -> None:
    """`every_seconds` with process 1 stopped after its should_save of step 18: process 0
    waits until it is, then its clock (injected) says that a save is due. Both first count
    their requests to the coordination service and collectives over 17 steps of should_save
    with no notice."""
    now = [0.0]
    m = jaxckpt.CheckpointManager(
        job.args["dir"],
        policy=jaxckpt.SavePolicy(every_seconds=1000),
        clock=lambda: now[0],
        timeout_s=job.args["timeout_s"],
    )
    _started(job, m)
    with _internals.count_collectives() as counts:
        assert not any(m.should_save(step) for step in range(2, 19))
    # both processes are past the counting before either stops or is stopped
    Path(job.args["scratch"], f"counted{job.process_id}").write_text(json.dumps(counts))
    if job.process_id == 1:
        os.kill(os.getpid(), signal.SIGSTOP)  # process 0 kills us
    _stopped(int(Path(job.args["scratch"], "pid1").read_text()))
    now[0] = 5000.0  # a save is due, by process 0's clock
    t0 = time.monotonic()
    try:
        for step in range(19, 100_000):
            time.sleep(0.01)
            if m.should_save(step):
                m.save(step, state=state(step))
                break
        error = None
    except jaxckpt.errors.JaxckptError as e:
        error = e
    counted = [json.loads(Path(job.args["scratch"], f"counted{i}").read_text()) for i in (0, 1)]
    _report_and_leave(job, error, seconds=time.monotonic() - t0, counts=counted)


def every_seconds(job: Job) -> dict:
    """`every_seconds` in 40 steps, met by both processes (a barrier each), by process 0's
    clock alone (one second a step there; process 1's clock stands still): the steps each
    process saved, and how many keys of the agreements are left in the coordination
    service."""
    step_now = [0]
    first = job.process_id == 0
    m = jaxckpt.CheckpointManager(
        job.args["dir"],
        policy=jaxckpt.SavePolicy(every_seconds=10),
        clock=lambda: float(step_now[0]) if first else 0.0,
    )
    saved = []
    for step in range(1, 41):
        step_now[0] = step
        # the processes in step, as a training step's collectives keep them: neither runs
        # more than a step ahead, whatever the machine's load
        _internals.barrier(f"test/every_seconds/{step}", 60_000)
        if m.should_save(step):
            m.save(step, state=state(step))
            saved.append(step)
    m.wait()
    steps = m.all_steps()
    keys = _internals.published("jaxckpt/notices") if first else {}
    m.close()
    return {"saved": saved, "keys": sorted(keys), "steps": steps}

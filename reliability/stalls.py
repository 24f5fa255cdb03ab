"""Stall trials of `reliability.stress`: one process of a 2-process job stops (SIGSTOP: a
host stuck in a driver call, on a dead mount) at a seeded point, and the other must end in
jaxckpt's named error by the deadline its call states (`timeout_s`), naming the stopped
process; then the stopped one is killed and the recovery checks run (`stress.check`).

The stopped process is always process 1: process 0 hosts JAX's coordination service, and
a stopped process 0 ends the job by JAX's heartbeat timeout instead (docs/deadlines.md).

    python -m reliability.stalls DIRECTORY PROCESS_ID PORT WHERE STEP   (one process of a trial)
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

from reliability import launch

TIMEOUT_S = 5  # the writers' timeout_s
SLACK_S = 10  # on top of it: wording the error on a loaded machine
WHERES = {
    "before_save": "before its save",
    "before_restore": "before its restore",
    "once_written": "once its part of a step is written, before the commit",
}


def trials(seed: int, n: int) -> list[tuple[str, int, str]]:
    """`n` seeded stall trials, as rows of RELIABILITY.md's table (fault, trials, result)."""
    from reliability.stress import check

    rng = random.Random(seed)
    failures, seconds, tried = [], [], {where: 0 for where in WHERES}
    for i in range(n):
        where, step = rng.choice(list(WHERES)), rng.randint(2, 3)
        tried[where] += 1
        with tempfile.TemporaryDirectory(prefix="jaxckpt-stall-") as directory:
            try:
                seconds.append(_trial(directory, where, step))
                check(directory)
            except (AssertionError, TimeoutError, subprocess.TimeoutExpired) as e:
                failures.append(f"{where} at step {step}: {e}")
        print(f"stall {i + 1}/{n}: {len(failures)} failures", flush=True)
    fault = (
        "SIGSTOP of 1 of 2 processes, at a seeded point ("
        + ", ".join(f"{WHERES[w]}: {k}" for w, k in tried.items())
        + f"), timeout_s={TIMEOUT_S}"
    )
    if not n:
        return [(fault, 0, "not run")]
    if failures:
        return [(fault, n, f"FAILED {len(failures)}: " + "; ".join(failures[:3]))]
    return [
        (
            fault,
            n,
            "the other process raised the named error (SaveError or ProcessesMissingError) "
            f"naming process 1 after {min(seconds):.1f}-{max(seconds):.1f} s; once the stopped "
            "one was killed, every committed step verified and restored, and a new writer "
            "saved the next one",
        )
    ]


def _trial(directory: str, where: str, step: int) -> float:
    """One trial: the seconds process 0 waited before its named error."""
    port = launch.free_port()
    procs = [
        launch.start(
            "-m",
            "reliability.stalls",
            directory,
            i,
            port,
            where,
            step,
            stdout=subprocess.PIPE if i == 0 else subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        for i in range(2)
    ]
    try:
        deadline, line = time.monotonic() + 240, ""  # start-up, saves, then the deadline
        while not line.startswith("RESULT "):  # (skip gloo's chatter)
            line = launch.readline(procs[0], timeout=max(0.0, deadline - time.monotonic()))
            assert line, "process 0 exited without a result"
        report = json.loads(line[len("RESULT ") :])
        assert report.get("missing") == [1], report
        assert report["type"] in ("SaveError", "ProcessesMissingError"), report
        assert report["seconds"] < TIMEOUT_S + SLACK_S, report
        return float(report["seconds"])
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=60)


def _child() -> None:
    """One process of a trial: saves steps 1 to STEP - 1, then process 1 stops at WHERE
    while process 0 goes on; process 0 prints what it raised, and how soon."""
    directory, process_id, port, where, last = sys.argv[1:]
    me, last = int(process_id), int(last)
    launch.join_job(4, 2, me, port, heartbeat_timeout_seconds=300)
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxckpt
    from jaxckpt import _internals
    from reliability.stress import N, expected

    mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    sharding = NamedSharding(mesh, P("x"))

    def state(step: int) -> dict:
        return {"x": jax.make_array_from_callback((N,), sharding, lambda i: expected(step)[i])}

    def stop() -> None:
        if me == 1:
            os.kill(os.getpid(), signal.SIGSTOP)  # the parent kills it

    m = jaxckpt.CheckpointManager(directory, timeout_s=TIMEOUT_S)
    for step in range(1, last):
        m.save(step, state=state(step), meta={"step": step})
    m.wait()
    t0 = time.monotonic()
    try:
        if where == "once_written":
            with _internals.on_writes_done(stop):
                m.save(last, state=state(last), meta={"step": last})
                m.wait()
        else:
            stop()
            if where == "before_save":
                m.save(last, state=state(last), meta={"step": last})
            else:
                m.restore(state={"x": np.zeros(N, np.float32)})
        report = {"type": None}
    except jaxckpt.errors.JaxckptError as e:
        report = {"type": type(e).__name__, "missing": getattr(e, "missing_processes", None)}
        report["error"] = str(e)
    report["seconds"] = time.monotonic() - t0
    print("RESULT " + json.dumps(report), flush=True)
    os._exit(0)  # not JAX's shutdown barrier, which would wait for the stopped process


if __name__ == "__main__":
    _child()

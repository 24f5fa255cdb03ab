"""Stall trials of `reliability.stress`, each followed by the recovery checks
(`stress.check`):

* one process of a 2-process job stops (SIGSTOP: a host stuck in a driver call, on a dead
  mount) at a seeded point, and the other must end in jaxckpt's named error by the deadline
  its call states (`timeout_s`), naming the stopped process; then the stopped one is
  killed. The stopped process is always process 1: process 0 hosts JAX's coordination
  service, and a stopped process 0 ends the job by JAX's heartbeat timeout instead
  (docs/deadlines.md);
* the store's server (fake-gcs-server, moto's S3 server) stops answering (SIGSTOP) at a
  seeded point of a writer's: its save's background, its restore's read, its close; the
  call must end by the give-up time's bound (`JAXCKPT_STORAGE_TIMEOUT_S`), named; then the
  server resumes.

    python -m reliability.stalls DIRECTORY PROCESS_ID PORT WHERE STEP   (one process of a trial)
    python -m reliability.stalls store URL SERVER_PID WHERE STEP        (a writer of a store's)
    python -m reliability.stalls check URL                              (stress.check, alone)
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
from collections.abc import Callable
from pathlib import Path

from reliability import launch

Row = tuple[str, int, str]  # a row of RELIABILITY.md's table: fault, trials, result
STORE_TIMEOUT_S = 6  # the store trials' JAXCKPT_STORAGE_TIMEOUT_S
STORE_WHERES = {
    "save": ("its save's background writes", "SaveError"),
    "restore": ("its restore's read", "StorageError"),
    "close": ("its close()", None),
}

TIMEOUT_S = 5  # the writers' timeout_s
SLACK_S = 10  # on top of it: wording the error on a loaded machine
WHERES = {
    "before_save": "before its save",
    "before_restore": "before its restore",
    "once_written": "once its part of a step is written, before the commit",
}


def trials(seed: int, n: int) -> list[Row]:
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
            except Exception as e:  # a failed trial, named; the others still run
                failures.append(f"{where} at step {step}: {e}")
        print(f"stall {i + 1}/{n}: {len(failures)} failures", flush=True)
    fault = (
        "SIGSTOP of 1 of 2 processes, at a seeded point ("
        + ", ".join(f"{WHERES[w]}: {k}" for w, k in tried.items())
        + f"), timeout_s={TIMEOUT_S}"
    )
    return _row(
        fault,
        n,
        failures,
        lambda: (
            "the other process raised the named error (SaveError or ProcessesMissingError) "
            f"naming process 1 after {min(seconds):.1f}-{max(seconds):.1f} s; once the stopped "
            "one was killed, every committed step verified and restored, and a new writer "
            "saved the next one"
        ),
    )


def store_trials(seed: int, n: int) -> list[Row]:
    """`n` seeded trials of a store that stops answering: half on gs://, half on s3://,
    each store's server started once (the clients of this process keep their endpoint)."""
    from reliability import gcs, s3

    rng = random.Random(seed)
    failures, seconds = [], []
    tried = {where: 0 for where in STORE_WHERES}
    env = {"JAXCKPT_STORAGE_TIMEOUT_S": str(STORE_TIMEOUT_S)}
    for store, server, trials_here in (("gs", gcs, (n + 1) // 2), ("s3", s3, n // 2)):
        saved = dict(os.environ)
        os.environ.update(server.LOOPBACK_ENV | env)
        with tempfile.TemporaryDirectory(prefix=f"jaxckpt-stall-{store}-") as log_dir:
            proc, endpoint = server.start(Path(log_dir) / "server.log")
            os.environ.update(server.point_at(endpoint))
            try:
                for i in range(trials_here):
                    where, step = rng.choice(list(STORE_WHERES)), rng.randint(2, 3)
                    tried[where] += 1
                    url = f"{store}://{server.BUCKET}/stall-{seed}-{i}"
                    try:
                        seconds.append(_store_trial(url, proc.pid, where, step))
                        # in a process of its own: this one's clients keep the endpoints
                        # of the servers that earlier trials started
                        checked = launch.run(
                            "-m",
                            "reliability.stalls",
                            "check",
                            url,
                            timeout=600,
                            capture_output=True,
                            text=True,
                        )
                        assert checked.returncode == 0, checked.stderr[-1500:]
                    except Exception as e:  # a failed trial, named; the others still run
                        failures.append(f"{store}, {where} at step {step}: {e}")
                    print(f"{store} stall {i + 1}/{trials_here}: {len(failures)} failures")
            finally:
                os.killpg(proc.pid, signal.SIGCONT)
                server.stop(proc)
                os.environ.clear()
                os.environ.update(saved)
    fault = (
        "gs:// and s3:// in turn: the server stopped (SIGSTOP) at a seeded point ("
        + ", ".join(f"{STORE_WHERES[w][0]}: {k}" for w, k in tried.items())
        + f"), JAXCKPT_STORAGE_TIMEOUT_S={STORE_TIMEOUT_S}, then resumed"
    )
    return _row(
        fault,
        n,
        failures,
        lambda: (
            "the save's wait() raised SaveError and the restore StorageError, each naming "
            f"the store, close() returned; after {min(seconds):.1f}-{max(seconds):.1f} s. "
            "Once the server resumed, every committed step verified and restored, and a new "
            "writer saved the next one"
        ),
    )


def _row(fault: str, n: int, failures: list[str], ok: Callable[[], str]) -> list[Row]:
    """The report's row: `ok()` when all `n` trials recovered."""
    if not n:
        return [(fault, 0, "not run")]
    if failures:
        return [(fault, n, f"FAILED {len(failures)}: " + "; ".join(failures[:3]))]
    return [(fault, n, ok())]


def _store_trial(url: str, server_pid: int, where: str, step: int) -> float:
    """One trial on a store: the seconds the call waited before it ended as it must."""
    proc = launch.start(
        "-m",
        "reliability.stalls",
        "store",
        url,
        server_pid,
        where,
        step,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        report = _result(proc)
        assert report["type"] == STORE_WHERES[where][1], report
        if report["type"] is not None:
            assert "the store at" in report["error"] or "did not answer" in report["error"], report
        # the give-up time, its pauses and a third of it for the listing that words a
        # SaveError, and slack for a loaded machine
        assert report["seconds"] < 2 * STORE_TIMEOUT_S + SLACK_S, report
        return float(report["seconds"])
    finally:
        os.killpg(server_pid, signal.SIGCONT)  # (the child resumes it too, unless it died)
        proc.kill()
        proc.wait(timeout=60)


def _result(proc: subprocess.Popen) -> dict:
    """The `RESULT {json}` line `proc` prints (skipping gloo's chatter), within 240 s."""
    deadline, line = time.monotonic() + 240, ""
    while not line.startswith("RESULT "):
        line = launch.readline(proc, timeout=max(0.0, deadline - time.monotonic()))
        assert line, f"{launch.describe(proc)} exited without a result"
    return dict(json.loads(line[len("RESULT ") :]))


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
        report = _result(procs[0])  # start-up, saves, then the deadline
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
    from reliability import faults
    from reliability.stress import N, expected

    mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    sharding = NamedSharding(mesh, P("x"))

    def state(step: int) -> dict:
        return {"x": jax.make_array_from_callback((N,), sharding, lambda i: expected(step)[i])}

    def stop() -> None:
        if me == 1:
            faults.stop_here()  # the parent kills it

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


def _store_child() -> None:
    """A writer of a store trial: saves steps 1 to STEP - 1, then stops the store's server
    at WHERE (through the manager's store seam, `faults.manager`) and prints what the call raised, and
    how soon; the server is resumed before it leaves."""
    url, server, where, last = sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
    import jax
    import numpy as np

    jax.config.update("jax_platforms", "cpu")
    import jaxckpt
    from reliability import faults
    from reliability.stress import N, expected

    def freeze() -> None:
        os.killpg(server, signal.SIGSTOP)

    def save_then_freeze(real, info, *args, **kwargs):
        real(info, *args, **kwargs)
        if info.step == last and where == "save":  # its background writes to a frozen store
            freeze()

    def freeze_then_read(real, *args, **kwargs):
        if where == "restore":
            freeze()
        return real(*args, **kwargs)

    store = faults.store(save=save_then_freeze, read_arrays=freeze_then_read)
    m = faults.manager(url, writer_lease_s=2, store=store)
    for step in range(1, last):
        m.save(step, state={"x": expected(step)}, meta={"step": step})
    m.wait()
    t0 = time.monotonic()
    try:
        if where == "save":
            m.save(last, state={"x": expected(last)}, meta={"step": last})
            m.wait()
        elif where == "restore":
            m.restore(state={"x": np.zeros(N, np.float32)})
        else:
            freeze()
            m.close()
        report: dict = {"type": None}
    except jaxckpt.errors.JaxckptError as e:
        report = {"type": type(e).__name__, "error": str(e)}
    report["seconds"] = time.monotonic() - t0
    os.killpg(server, signal.SIGCONT)
    print("RESULT " + json.dumps(report), flush=True)
    os._exit(0)  # (threads left waiting on the store that froze are not waited for)


if __name__ == "__main__":
    if sys.argv[1] == "check":  # the recovery checks, in a fresh process
        from reliability.stress import check

        check(sys.argv[2])
    elif sys.argv[1] == "store":
        _store_child()
    else:
        _child()

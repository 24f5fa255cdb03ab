"""Starts the child Python processes of the tests, the reliability trials and the benchmarks,
all one way: this interpreter, the repo as working directory, and the repo's code importable
(jaxckpt, reliability, benchmarks; tests/ too, for the tests' own `children` package).

    launch.start("-m", "children.freezer", directory, stderr=subprocess.DEVNULL)  # a Popen
    launch.run("-m", "jaxckpt", "verify", directory, timeout=120)  # waited for, bounded
    launch.readline(proc, timeout=120)  # its next stdout line, or TimeoutError
    launch.wait_stopped(proc, timeout=120)  # os.waitpid(WUNTRACED), or TimeoutError
    launch.serve([binary, ...], log, ready_url, "the S3 server")  # a server on 127.0.0.1

A child is a real module run with `-m` (so ruff reads it), not code in a string. Every wait
on one is bounded: a child that hangs fails its test or trial, naming what it never did,
instead of blocking the parent (and CI) for ever.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def environment(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment with the repo (and tests/) first on PYTHONPATH, then `env`."""
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    path = os.pathsep.join([str(REPO), str(REPO / "tests"), *inherited])
    return {**os.environ, "PYTHONPATH": path, **(env or {})}


def start(*argv: object, env: Mapping[str, str] | None = None, **popen: Any) -> subprocess.Popen:
    """Starts `python *argv` (`"-m", module, its arguments...`) in the repo and returns at
    once; `popen` goes to subprocess.Popen (stdout=, stderr=, text=...)."""
    command = [sys.executable, *map(str, argv)]
    return subprocess.Popen(command, **{"cwd": REPO, "env": environment(env), **popen})


def run(
    *argv: object, timeout: float, env: Mapping[str, str] | None = None, **kwargs: Any
) -> subprocess.CompletedProcess:
    """`start`, waited for: killed, and subprocess.TimeoutExpired raised, after `timeout`
    seconds; `kwargs` go to subprocess.run (capture_output=, text=...)."""
    command = [sys.executable, *map(str, argv)]
    return subprocess.run(
        command, timeout=timeout, **{"cwd": REPO, "env": environment(env), **kwargs}
    )


def report(*argv: object, timeout: float) -> dict:
    """`run` of a child that reports as it ends (a `RESULT <json>` line): the last report.
    SystemExit with its stderr's tail if it failed or reported nothing (a benchmark stops)."""
    proc = run(*argv, timeout=timeout, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{argv} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return dict(json.loads(lines[-1][len("RESULT ") :]))


def job(
    module: str,
    *argv: object,
    processes: int,
    args: Mapping[str, Any],
    timeout: float,
    env: Mapping[str, str] | None = None,
) -> list[dict]:
    """`python -m module *argv <i> <processes> <devices> <port> <args as JSON>` for each
    process `i` of a job on 127.0.0.1 (8 CPU devices in all), to their ends: each one's
    report, its last `RESULT <json>` line. AssertionError naming a process that failed or
    reported nothing; every process is killed on the way out."""
    port = free_port()
    procs = [
        start("-m", module, *argv, i, processes, 8 // processes, port, json.dumps(dict(args)),
              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i in range(processes)
    ]  # fmt: skip
    reports = []
    try:
        for i, proc in enumerate(procs):
            out, err = proc.communicate(timeout=timeout)
            lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
            assert proc.returncode == 0 and lines, (
                f"process {i} exited {proc.returncode}: {err[-1500:]}"
            )
            reports.append(json.loads(lines[-1][len("RESULT ") :]))
    finally:
        for proc in procs:
            proc.kill()
    return reports


def describe(proc: subprocess.Popen) -> str:
    """`proc` for an error message: its arguments after the interpreter, pid and state."""
    args = proc.args[1:] if isinstance(proc.args, list | tuple) else [proc.args]
    code = proc.poll()
    state = "still running" if code is None else f"exited {code}"
    return f"the child `{' '.join(map(str, args))}` (pid {proc.pid}, {state})"


def readline(proc: subprocess.Popen, timeout: float) -> str:
    """The next line of `proc`'s stdout (a pipe), "" once the child closed it, like
    `proc.stdout.readline()`; TimeoutError, naming the child, when no whole line came
    within `timeout` seconds. The read is `proc.stdout.readline()` itself, in a daemon
    thread: the same buffering as calling it directly. After a TimeoutError that thread
    still reads: kill the child (its pipe closes, the thread ends) rather than read on."""
    got: list = []

    def read() -> None:
        try:
            got.append(proc.stdout.readline())
        except BaseException as e:  # raised in the waiting thread instead
            got.append(e)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout)
    if reader.is_alive():
        raise TimeoutError(f"{describe(proc)} printed no line in {timeout:.0f} s")
    (line,) = got
    if isinstance(line, BaseException):
        raise line
    return line


def wait_stopped(proc: subprocess.Popen, timeout: float) -> int:
    """`os.waitpid(proc.pid, os.WUNTRACED)`, bounded: the wait status once the child stopped
    (e.g. it sent itself SIGSTOP) or exited; TimeoutError, naming the child, when it did
    neither within `timeout` seconds. Polls with WNOHANG, so a child that never stops
    cannot block the caller."""
    deadline = time.monotonic() + timeout
    while True:
        pid, status = os.waitpid(proc.pid, os.WNOHANG | os.WUNTRACED)
        if pid:
            return status
        if time.monotonic() > deadline:
            raise TimeoutError(f"{describe(proc)} neither stopped nor exited in {timeout:.0f} s")
        time.sleep(0.05)


def join_job(devices: int, processes: int, process_id: int, port: int | str, **options: Any):
    """In a child, before JAX is used: CPU devices, gloo collectives and, for several
    processes, `jax.distributed` on 127.0.0.1 (`options`, e.g. heartbeat_timeout_seconds,
    pass through)."""
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", int(devices))
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if processes > 1:
        jax.distributed.initialize(
            f"127.0.0.1:{port}",
            num_processes=processes,
            process_id=process_id,
            initialization_timeout=60,
            **options,
        )


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(
    command: list[str],
    log: Path,
    ready: str,
    what: str,
    timeout_s: float,
    env: Mapping[str, str] | None = None,
) -> subprocess.Popen:
    """Starts a server (the object-storage tests' emulators), its output to `log` (never a
    pipe: an unread pipe stalls it), in a session of its own; returns once the URL `ready`
    answers. RuntimeError naming `what` and the log if it exits or does not answer within
    `timeout_s`."""
    out = log.open("w")
    proc = subprocess.Popen(
        command,
        stdout=out,
        stderr=subprocess.STDOUT,
        env={**os.environ, **(env or {})},
        start_new_session=True,
    )
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            urllib.request.urlopen(ready, timeout=1).close()
            return proc
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"{what} did not start; see {log}") from None
            time.sleep(0.1)


def stop_server(proc: subprocess.Popen) -> None:
    """Ends a server `serve` started (its whole session), bounded."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)

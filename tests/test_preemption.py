"""A preemption notice makes should_save true at one step that every process agrees on."""

import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
from multihost import run_job

import jaxckpt
from conftest import REPO, WRITES_DONE_EVENT
from jaxckpt import errors


def test_callback_notice_saves_the_next_step_once(ckpt_dir):
    notice = []
    policy = jaxckpt.PreemptionPolicy(check=lambda: bool(notice))
    with jaxckpt.CheckpointManager(ckpt_dir, preemption=policy) as m:
        assert not m.should_save(3) and not m.preempted
        notice.append("maintenance event")
        assert m.should_save(4) and m.preempted
        m.save(4, state={"x": np.ones(2)})
        assert not m.should_save(5)  # one save for one notice; the script exits now
    with jaxckpt.CheckpointManager(ckpt_dir) as m:
        assert m.latest_step() == 4


def test_sigterm_is_caught_and_the_previous_handler_restored(ckpt_dir):
    before = signal.getsignal(signal.SIGTERM)
    with jaxckpt.CheckpointManager(ckpt_dir, policy=jaxckpt.SavePolicy(every_steps=100)) as m:
        assert not m.should_save(1)
        os.kill(os.getpid(), signal.SIGTERM)  # handled at once, in this thread
        assert m.should_save(2) and m.preempted
    assert signal.getsignal(signal.SIGTERM) is before


def test_disabled_preemption_leaves_signals_alone(ckpt_dir):
    before = signal.getsignal(signal.SIGTERM)
    policy = jaxckpt.PreemptionPolicy(enabled=False)
    with jaxckpt.CheckpointManager(ckpt_dir, preemption=policy) as m:
        assert signal.getsignal(signal.SIGTERM) is before
        assert not m.should_save(1) and not m.preempted


def test_a_second_signal_is_handled_as_before_the_manager_caught_it(ckpt_dir):
    # SIGINT's handler before the manager is Python's own: KeyboardInterrupt.
    policy = jaxckpt.PreemptionPolicy(signals=(signal.SIGINT,))
    with jaxckpt.CheckpointManager(ckpt_dir, preemption=policy) as m:
        signal.raise_signal(signal.SIGINT)  # the notice: only a flag
        assert m.should_save(1) and m.preempted
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)


def test_a_second_signal_that_was_ignored_stays_ignored(ckpt_dir):
    before = signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    try:
        policy = jaxckpt.PreemptionPolicy(signals=(signal.SIGUSR2,))
        with jaxckpt.CheckpointManager(ckpt_dir, preemption=policy) as m:
            signal.raise_signal(signal.SIGUSR2)
            signal.raise_signal(signal.SIGUSR2)
            assert m.should_save(1)
        assert signal.getsignal(signal.SIGUSR2) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGUSR2, before)


# A child blocked for good in a real restore (of 16 MiB, over and over) or wait (its writer
# frozen at Orbax's write-done event); it echoes jaxckpt's log records and its markers to
# stdout, written with os.write: atomic lines, safe from a signal handler and from two threads.
BLOCKED = textwrap.dedent(
    """
    import logging, os, sys, threading
    import jax
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", 8)
    import numpy as np
    import jaxckpt

    def echo(text):
        os.write(1, (text + "\\n").encode())

    class Echo(logging.Handler):
        def emit(self, record):
            echo(record.getMessage())

    logging.getLogger("jaxckpt").addHandler(Echo())
    directory, blocked_in, writes_done = sys.argv[1:]
    x = np.arange(4 * 2**20, dtype=np.float32)
    m = jaxckpt.CheckpointManager(directory)
    if blocked_in == "restore":
        m.save(1, state={"x": x})
        m.wait()
        echo("BLOCKED")
        while True:
            m.restore(state={"x": np.zeros_like(x)})
    else:
        def freeze(event, duration, **kwargs):
            if event == writes_done:  # in Orbax's background thread: it never goes on
                echo("BLOCKED")
                threading.Event().wait()

        jax.monitoring.register_event_duration_secs_listener(freeze)
        m.save(1, state={"x": x})
        echo("WAITING")
        m.wait()
    """
)


def _expect(lines: queue.Queue, proc: subprocess.Popen, timeout: float, *texts: str) -> None:
    """Reads the child's stdout lines until each of `texts` was in one (bounded)."""
    deadline = time.monotonic() + timeout
    missing, seen = set(texts), []
    while missing:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise AssertionError(
                f"no {sorted(missing)} from the child within {timeout} s (exit {proc.poll()}); "
                f"it wrote {seen}"
            ) from None
        if line is None:
            raise AssertionError(f"the child exited {proc.wait()} before {sorted(missing)}: {seen}")
        seen.append(line.rstrip())
        missing = {text for text in missing if text not in line}


@pytest.mark.parametrize(
    ("blocked_in", "second"),
    [("restore", signal.SIGTERM), ("wait", signal.SIGTERM), ("restore", signal.SIGINT)],
)
def test_a_second_signal_ends_a_process_blocked_in_restore_or_wait(tmp_path, blocked_in, second):
    """The first SIGTERM is only a notice; a second one (or Ctrl-C) ends the process with
    the signal's own default action, though the main thread never leaves restore/wait."""
    with open(tmp_path / "stderr.txt", "w+") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-c", BLOCKED, str(tmp_path / "ckpt"), blocked_in, WRITES_DONE_EVENT],
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
        lines: queue.Queue = queue.Queue()

        def read():
            for line in proc.stdout:
                lines.put(line)
            lines.put(None)

        threading.Thread(target=read, daemon=True).start()
        try:
            # Start-up and a 16 MiB save; in the "wait" child, the main thread enters wait().
            ready = ["BLOCKED", "WAITING"] if blocked_in == "wait" else ["BLOCKED"]
            _expect(lines, proc, 120, *ready)
            proc.send_signal(signal.SIGTERM)
            _expect(lines, proc, 60, "preemption notice")  # handled in restore/wait
            assert proc.poll() is None  # the notice did not end it
            proc.send_signal(second)
            try:
                code = proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"{second!r} after the notice did not end the child") from None
            stderr.seek(0)
            assert code == -second, stderr.read()[-4000:]
        finally:
            proc.kill()
            proc.wait()


def test_bad_policy():
    with pytest.raises(errors.ConfigError, match="signal numbers"):
        jaxckpt.PreemptionPolicy(signals=("SIGTERM",))


LOOP = """
ready = os.path.join(ARGS["dir"], f"ready-{PROCESS_ID}")
mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
w = jax.make_array_from_callback((64,), sharding, lambda i: np.arange(64.0, dtype=np.float32)[i])
add = jax.jit(lambda w: w + 1)
m = jaxckpt.CheckpointManager(ARGS["dir"], policy=jaxckpt.SavePolicy(every_steps=10_000))
start = m.latest_step() or 0
if start:
    w = m.restore(state={"w": jaxckpt.target_like(w)}).state["w"]
saved = None
for step in range(start + 1, start + 3000):
    w = add(w)  # a training step; it is a collective-free update on every device
    if step == start + 5:
        open(ready, "w").close()
    time.sleep(0.01)  # the work of a real step
    if m.should_save(step):
        m.save(step, state={"w": w})
        saved = step
    if m.preempted:
        break
m.close()
print("RESULT " + json.dumps({"saved": saved, "preempted": m.preempted, "start": start}))
"""


def test_sigterm_on_one_of_two_processes_saves_one_agreed_step(tmp_path):
    def preempt_process_1(procs):
        deadline = time.monotonic() + 120
        while not (tmp_path / "ready-1").exists():  # bounded: the job's start-up
            assert time.monotonic() < deadline and procs[1].poll() is None, (
                "process 1 never started"
            )
            time.sleep(0.05)
        procs[1].send_signal(signal.SIGTERM)

    body = "import time\n" + LOOP
    results = run_job(
        body, processes=2, devices=4, args={"dir": str(tmp_path)}, while_running=preempt_process_1
    )
    reports = [r.report() for r in results]
    assert all(r["preempted"] for r in reports)
    saved = {r["saved"] for r in reports}
    assert len(saved) == 1 and None not in saved, reports  # the same step on both processes
    (step,) = saved

    # The restarted job resumes from that step, with its values.
    results = run_job(
        body.replace("3000", "3"), processes=2, devices=4, args={"dir": str(tmp_path)}
    )
    assert [r.report()["start"] for r in results] == [step, step]
    with jaxckpt.CheckpointManager(tmp_path) as m:
        restored = m.restore(step, state={"w": np.zeros(64, np.float32)}).state["w"]
    np.testing.assert_array_equal(restored, np.arange(64.0, dtype=np.float32) + step)

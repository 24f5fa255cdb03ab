"""A process killed mid-save leaves no visible partial step, and its leftovers are cleaned.

The writer is a real child process saving real arrays with real Orbax; it is killed with
SIGKILL either at a chosen point (frozen the instant `save` returned) or after a seeded
random delay while it saves in a loop. Every step that is visible afterwards must restore
with exactly the bytes that were saved for it.
"""

import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import jaxckpt
from conftest import REPO

N = 4 * 1024 * 1024  # 16 MiB of float32 per step


def expected(step: int) -> np.ndarray:
    return np.arange(N, dtype=np.float32) + step


WRITER = textwrap.dedent(
    """
    import os, signal, sys
    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    import jax.numpy as jnp
    import jaxckpt

    directory, mode, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    m = jaxckpt.CheckpointManager(directory)
    start = (m.latest_step() or 0) + 1
    for step in range(start, start + 1000):
        m.save(step, state={"x": jnp.arange(n, dtype=jnp.float32) + step}, meta={"step": step})
        if mode == "freeze" and step == start + 1:
            os.kill(os.getpid(), signal.SIGSTOP)   # frozen mid-save: the parent kills us
        if mode == "freeze":
            m.wait()
        print(step, flush=True)
    """
)


def start_writer(directory, mode):
    return subprocess.Popen(
        [sys.executable, "-c", WRITER, str(directory), mode, str(N)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )


def tmp_leftovers(directory):
    return sorted(p.name for p in directory.iterdir() if "tmp" in p.name)


def check_recovery(directory):
    """A new manager sees only complete steps, restores them exactly, cleans up, continues."""
    with jaxckpt.CheckpointManager(directory) as m:
        steps = m.all_steps()
        for step in steps:
            restored = m.restore(step, state={"x": np.zeros(N, np.float32)})
            np.testing.assert_array_equal(restored.state["x"], expected(step))
            assert restored.meta == {"step": step}
        new = (steps[-1] if steps else 0) + 1
        m.save(new, state={"x": expected(new)}, meta={"step": new})
        m.wait()
        assert m.all_steps() == [*steps, new]
    assert tmp_leftovers(directory) == [], "leftovers of the killed save were not cleaned"
    return steps


def test_kill_while_a_save_is_in_flight(tmp_path):
    proc = start_writer(tmp_path, "freeze")
    try:
        _, status = os.waitpid(proc.pid, os.WUNTRACED)
        assert os.WIFSTOPPED(status)
        proc.kill()
        proc.wait(timeout=30)
    finally:
        proc.kill()
    assert tmp_leftovers(tmp_path) == ["2.orbax-checkpoint-tmp"]  # step 2 was cut off mid-write
    assert check_recovery(tmp_path) == [1]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kill_at_a_random_moment_of_a_save_loop(tmp_path, seed):
    delay = random.Random(seed).uniform(0.0, 1.0)
    proc = start_writer(tmp_path, "loop")
    try:
        assert proc.stdout.readline().strip() == "1"  # one save started and returned
        time.sleep(delay)  # the moment of the kill, not a wait for a result
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proc.kill()
    check_recovery(tmp_path)

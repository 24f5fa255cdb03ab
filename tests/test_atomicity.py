"""A process killed mid-save leaves no visible partial step, and its leftovers are cleaned.

The writer is a real child process saving real arrays with real Orbax; it is killed with
SIGKILL either at a chosen point (frozen once a step's arrays are written, before its
commit) or after a seeded random delay while it saves in a loop (the stress script's trial).
Every step that is visible afterwards must verify and restore with exactly the bytes that
were saved for it.
"""

import os
import subprocess
import sys
import textwrap

import pytest

from conftest import REPO, WRITES_DONE_EVENT
from reliability.stress import N, Tally, check, kill_trial

FREEZER = textwrap.dedent(
    """
    import os, signal, sys
    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    import jax.numpy as jnp
    import jaxckpt

    directory, n, writes_done = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    m = jaxckpt.CheckpointManager(directory)
    m.save(1, state={"x": jnp.arange(n, dtype=jnp.float32) + 1}, meta={"step": 1})
    m.wait()

    def freeze(event, duration, **kwargs):
        if event == writes_done:  # step 2's arrays are written, its commit not yet made
            os.kill(os.getpid(), signal.SIGSTOP)  # the parent kills us now

    jax.monitoring.register_event_duration_secs_listener(freeze)
    m.save(2, state={"x": jnp.arange(n, dtype=jnp.float32) + 2}, meta={"step": 2})
    m.wait()
    """
)


def test_kill_while_a_save_is_in_flight(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-c", FREEZER, str(tmp_path), str(N), WRITES_DONE_EVENT],
        cwd=REPO,
        stderr=subprocess.DEVNULL,
    )
    try:
        _, status = os.waitpid(proc.pid, os.WUNTRACED)
        assert os.WIFSTOPPED(status)
        proc.kill()
        proc.wait(timeout=30)
    finally:
        proc.kill()
    leftovers = sorted(p.name for p in tmp_path.iterdir() if "tmp" in p.name)
    assert leftovers == ["2.orbax-checkpoint-tmp"]  # step 2 was cut off mid-write
    steps, leftover = check(tmp_path)
    assert steps == [1] and leftover


@pytest.mark.parametrize(("seed", "processes"), [(0, 1), (1, 1), (2, 1), (1000, 2)])
def test_kill_at_a_random_moment_of_a_save_loop(seed, processes):
    # The stress script's trial (python -m reliability.stress runs 30 + 6 of them).
    tally = Tally()
    kill_trial(seed, processes, tally)
    assert tally.trials == 1 and tally.failures == []

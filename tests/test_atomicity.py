"""A process killed mid-save leaves no visible partial step, and its leftovers are cleaned.

The writer is a real child process saving real arrays with real Orbax; it is killed with
SIGKILL either at a chosen point (frozen once a step's arrays are written, before its
commit) or after a seeded random delay while it saves in a loop (the stress script's trial).
Every step that is visible afterwards must verify and restore with exactly the bytes that
were saved for it.
"""

import os
import subprocess

import pytest
from multihost import one_job_at_a_time

from reliability import launch
from reliability.stress import N, Tally, check, kill_trial


def test_kill_while_a_save_is_in_flight(tmp_path):
    proc = launch.start("-m", "children.freezer", tmp_path, N, stderr=subprocess.DEVNULL)
    try:
        status = launch.wait_stopped(proc, timeout=180)
        assert os.WIFSTOPPED(status)
        proc.kill()
        proc.wait(timeout=30)
    finally:
        proc.kill()
    leftovers = sorted(p.name for p in tmp_path.iterdir() if "tmp" in p.name)
    assert leftovers == ["2.orbax-checkpoint-tmp"]  # step 2 was cut off mid-write
    steps, leftover = check(tmp_path)
    assert steps == [1] and leftover


@pytest.mark.parametrize(
    ("seed", "processes"),
    [(0, 1), (1, 1), (2, 1), pytest.param(1000, 2, marks=one_job_at_a_time)],
)
def test_kill_at_a_random_moment_of_a_save_loop(seed, processes):
    # The stress script's trial (python -m reliability.stress runs 30 + 6 of them).
    tally = Tally()
    kill_trial(seed, processes, tally)
    assert tally.trials == 1 and tally.failures == []

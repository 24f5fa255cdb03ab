"""reliability.launch's bounded waits: a child that hangs fails the wait, naming the child
and what it never did, instead of blocking the test for ever."""

import os
import signal
import subprocess
import time

import pytest

from reliability import launch


def hanger(*lines: str) -> subprocess.Popen:
    return launch.start("-m", "children.hanger", *lines, stdout=subprocess.PIPE, text=True)


def test_readline_returns_each_line_then_times_out_naming_the_child():
    proc = hanger("one", "two")
    try:
        assert launch.readline(proc, timeout=60) == "one\n"
        assert launch.readline(proc, timeout=60) == "two\n"
        t0 = time.monotonic()
        with pytest.raises(
            TimeoutError,
            match=r"children\.hanger one two` \(pid \d+, still running\) printed no line in 1 s",
        ):
            launch.readline(proc, timeout=1)
        assert time.monotonic() - t0 < 30
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_readline_at_the_end_of_the_output_is_empty():
    proc = hanger("last")
    proc.kill()
    proc.wait(timeout=30)
    assert launch.readline(proc, timeout=60) in ("last\n", "")  # killed before or after it
    assert launch.readline(proc, timeout=60) == ""


def test_wait_stopped_returns_once_the_child_stopped_itself():
    proc = hanger("stop")
    try:
        status = launch.wait_stopped(proc, timeout=60)
        assert os.WIFSTOPPED(status) and os.WSTOPSIG(status) == signal.SIGSTOP
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_a_thread_that_stops_its_process_runs_no_further():
    """faults.stop_here() in a background thread (where tests stop a process once its save's
    arrays are written): that thread does nothing more. With os.kill(os.getpid(), SIGSTOP)
    it printed its next line in 4 of 20 tries on an idle machine; on a loaded one, a save
    thread passed the barrier before its commit, and a step meant to stay uncommitted
    committed."""
    for _ in range(20):
        proc = hanger("stop-in-a-thread")
        try:
            status = launch.wait_stopped(proc, timeout=60)
            assert os.WIFSTOPPED(status), status
        finally:
            proc.kill()
            out, _ = proc.communicate(timeout=30)
        assert out == "stop-in-a-thread\n"


def test_wait_stopped_times_out_on_a_child_that_never_stops():
    proc = hanger("running")
    try:
        with pytest.raises(
            TimeoutError, match=r"\(pid \d+, still running\) neither stopped nor exited in 1 s"
        ):
            launch.wait_stopped(proc, timeout=1)
    finally:
        proc.kill()
        proc.wait(timeout=30)

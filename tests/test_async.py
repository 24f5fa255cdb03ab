"""Saves are asynchronous, and a failure in the background is never swallowed.

Both are observed in a child process: it stops itself (SIGSTOP) the instant `save` returns,
so the parent sees the directory as it was then; a real write error comes from the kernel
(RLIMIT_FSIZE: "File too large") inside tensorstore's background write.
"""

import json
import os
import signal
import subprocess

import numpy as np
import pytest

from conftest import run_python
from reliability import faults, launch


def test_save_returns_before_the_step_is_committed_and_after_the_device_copy(tmp_path):
    ckpt = tmp_path / "ckpt"
    proc = launch.start(
        "-m",
        "children.async_saves",
        "stop_after_save",
        ckpt,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        status = launch.wait_stopped(proc, timeout=180)
        assert os.WIFSTOPPED(status), "the child should have stopped itself after save returned"
        assert not (ckpt / "1").exists(), "save returned after the step was committed"
        proc.send_signal(signal.SIGCONT)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert json.loads(out.splitlines()[-1]) == [1]

    import jaxckpt

    with jaxckpt.CheckpointManager(ckpt) as m:
        restored = m.restore(1, state={"x": np.zeros(16 * 1024 * 1024, np.float32)})
    np.testing.assert_array_equal(
        restored.state["x"], np.arange(16 * 1024 * 1024, dtype=np.float32)
    )


def test_background_write_error_surfaces_at_the_next_wait_save_and_close(tmp_path):
    ckpt = tmp_path / "ckpt"
    proc = run_python("-m", "children.async_saves", "write_errors", str(ckpt), timeout=180)
    report = json.loads(proc.stdout.splitlines()[-1])
    assert report["visible_after_save"] == [1]
    for name, step in [("wait", 2), ("save", 3), ("close", 5)]:
        assert report[name] is not None, f"the failure of step {step} was swallowed by {name}()"
        assert f"saving step {step} failed in the background" in report[name]
        assert "File too large" in report[name]
        assert "committed steps are intact: 1" in report[name]
    assert report["wait_again"] is None
    assert report["steps"] == [1, 4]

    import jaxckpt

    with jaxckpt.CheckpointManager(ckpt) as m:
        np.testing.assert_array_equal(m.restore(1).state["w"], np.arange(16.0, dtype=np.float32))
        np.testing.assert_array_equal(m.restore(4).state["w"], np.arange(16.0, dtype=np.float32))


def test_save_leaves_the_garbage_collector_as_it_found_it(tmp_path):
    """`save` pauses the cyclic collector while it blocks, and only then."""
    import gc

    import jaxckpt

    state = {f"w{i}": np.full(8, i, np.float32) for i in range(100)}
    with jaxckpt.CheckpointManager(tmp_path) as m:
        m.save(1, state=state)
        assert gc.isenabled()
        with pytest.raises(jaxckpt.errors.StepExistsError):
            m.save(1, state=state)  # refused after the state was flattened
        assert gc.isenabled()
        gc.disable()
        try:
            m.save(2, state=state)
            assert not gc.isenabled()  # a user's choice is kept
        finally:
            gc.enable()
        m.wait()
        assert m.all_steps() == [1, 2]


def test_restore_pauses_the_garbage_collector_and_restores_it(tmp_path):
    """`restore` runs with the cyclic collector paused (the data iterator, moved last, sees
    it off) and turns it back on afterwards, also when the restore fails."""
    import gc

    import jaxckpt

    class Iterator:
        def __init__(self):
            self.position, self.gc_during = 0, []

        def get_state(self):
            return {"position": self.position}

        def set_state(self, state):
            self.gc_during.append(gc.isenabled())
            self.position = state["position"]

    data = Iterator()
    data.position = 7
    state = {f"w{i}": np.full(8, i, np.float32) for i in range(10)}
    with jaxckpt.CheckpointManager(tmp_path) as m:
        m.save(1, state=state, data=data)
        m.wait()
        restored = m.restore(1, state=state, data=Iterator()).data
        assert restored.position == 7 and restored.gc_during == [False]
        assert gc.isenabled()
        with pytest.raises(jaxckpt.errors.TreeMismatchError):
            m.restore(1, state={"other": np.zeros(8, np.float32)})
        assert gc.isenabled()


def test_a_save_failing_after_its_background_commit_started_says_whether_it_committed(
    tmp_path,
):
    """Orbax's save can fail in the foreground after it started the step's commit in the
    background: on several hosts, its last barrier meets a dead process. The error is worded
    once that commit is over, from the directory, and the manager keeps working."""
    import jaxckpt

    def fail_at_step_2(save, info, *args):  # Orbax's save returned: the commit runs
        save(info, *args)
        if info.step == 2:
            raise OSError("the barrier after the write started failed")

    x = np.arange(1024, dtype=np.float32)
    with faults.manager(tmp_path, store=faults.store(save=fail_at_step_2)) as m:
        m.save(1, state={"x": x + 1})
        with pytest.raises(jaxckpt.errors.SaveError) as failed:
            m.save(2, state={"x": x + 2})
        assert failed.value.committed and failed.value.step == 2
        assert "saving step 2 failed: OSError: the barrier after the write started" in str(
            failed.value
        )
        assert "Step 2 committed all the same and is whole; committed steps: 1, 2." in str(
            failed.value
        )
        m.save(3, state={"x": x + 3})
    with jaxckpt.CheckpointManager(tmp_path, read_only=True) as m:
        assert m.all_steps() == [1, 2, 3]
        for step in (1, 2, 3):
            np.testing.assert_array_equal(m.restore(step).state["x"], x + step)

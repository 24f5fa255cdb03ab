"""Saves are asynchronous, and a failure in the background is never swallowed.

Both are observed in a child process: it stops itself (SIGSTOP) the instant `save` returns,
so the parent sees the directory as it was then; a real write error comes from the kernel
(RLIMIT_FSIZE: "File too large") inside tensorstore's background write.
"""

import json
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from conftest import REPO, run_python

PRELUDE = textwrap.dedent(
    """
    import json, os, resource, signal, sys
    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    import jax.numpy as jnp
    import numpy as np
    import jaxckpt
    """
)


def test_save_returns_before_the_step_is_committed_and_after_the_device_copy(tmp_path):
    ckpt = tmp_path / "ckpt"
    child = PRELUDE + textwrap.dedent(
        f"""
        m = jaxckpt.CheckpointManager({str(ckpt)!r})
        x = jnp.arange(16 * 1024 * 1024, dtype=jnp.float32)  # 64 MiB: the write takes a while
        m.save(1, state={{"x": x}})
        x.delete()  # the device buffer is gone: save must already hold a host copy
        os.kill(os.getpid(), signal.SIGSTOP)  # the parent looks at the directory now
        m.wait()
        print(json.dumps(m.all_steps()))
        m.close()
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", child],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _, status = os.waitpid(proc.pid, os.WUNTRACED)
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
    child = PRELUDE + textwrap.dedent(
        f"""
        # Files over 1 MiB fail with EFBIG, as on a full disk; ignore the signal, keep the error.
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))
        small = {{"w": jnp.arange(16.0)}}
        big = {{"w": jax.random.normal(jax.random.key(0), (1024, 1024))}}  # 4 MiB, incompressible
        report = {{}}

        def attempt(name, fn):
            try:
                fn()
                report[name] = None
            except jaxckpt.errors.SaveError as e:
                report[name] = str(e)

        m = jaxckpt.CheckpointManager({str(ckpt)!r})
        m.save(1, state=small)
        m.wait()
        m.save(2, state=big)                      # returns: the failure happens later
        report["visible_after_save"] = m.all_steps()
        attempt("wait", m.wait)
        attempt("wait_again", m.wait)             # raised once, not forever
        m.save(3, state=big)
        attempt("save", lambda: m.save(4, state=small))
        m.save(4, state=small)                    # the manager keeps working
        m.save(5, state=big)
        attempt("close", m.close)
        report["steps"] = jaxckpt.CheckpointManager({str(ckpt)!r}).all_steps()
        print(json.dumps(report))
        """
    )
    proc = run_python("-c", child, timeout=180)
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
    tmp_path, monkeypatch
):
    """Orbax's save can fail in the foreground after it started the step's commit in the
    background: on several hosts, its last barrier meets a dead process. The error is worded
    once that commit is over, from the directory, and the manager keeps working."""
    import jaxckpt
    from jaxckpt import _orbax

    save = _orbax.OrbaxStore.save

    def fail_at_step_2(self, step, **kwargs):  # Orbax's save returned: the commit runs
        save(self, step, **kwargs)
        if step == 2:
            raise OSError("the barrier after the write started failed")

    monkeypatch.setattr(_orbax.OrbaxStore, "save", fail_at_step_2)
    x = np.arange(1024, dtype=np.float32)
    with jaxckpt.CheckpointManager(tmp_path) as m:
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

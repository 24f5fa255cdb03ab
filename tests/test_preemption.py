"""A preemption notice makes should_save true at one step that every process agrees on."""

import os
import signal
import time

import numpy as np
import pytest
from multihost import run_job

import jaxckpt
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

"""The job of tests/test_preemption.py (run by children.job in every process): a training
loop that saves only when `should_save` says so (a preemption notice), resuming from the
latest step; `job.args["steps"]` steps at most. With `job.args["check_at"]`, process 1's
`PreemptionPolicy.check` gives the notice there."""

import os
import time

import jax
import numpy as np

import jaxckpt
from children.job import Job
from jaxckpt import _internals


def train(job: Job) -> dict:
    ready = os.path.join(job.args["dir"], f"ready-{job.process_id}")
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    w = jax.make_array_from_callback(
        (64,), sharding, lambda i: np.arange(64.0, dtype=np.float32)[i]
    )
    add = jax.jit(lambda w: w + 1)
    at = [0]  # the step in progress
    check_at = job.args.get("check_at")  # process 1's check() is true from this step on
    policy = jaxckpt.PreemptionPolicy(
        check=lambda: job.process_id == 1 and check_at is not None and at[0] >= check_at
    )
    m = jaxckpt.CheckpointManager(
        job.args["dir"], policy=jaxckpt.SavePolicy(every_steps=10_000), preemption=policy
    )
    start = m.latest_step() or 0
    if start:
        w = m.restore(state={"w": jaxckpt.target_like(w)}).state["w"]
    saved = None
    for step in range(start + 1, start + job.args["steps"]):
        at[0] = step
        w = add(w)  # a training step; it is a collective-free update on every device
        if job.num_processes > 1:
            # the processes in step, as a training step's collectives keep them: neither
            # runs steps ahead of the other's notice, whatever the machine's load (a loaded
            # run agreed on step 34, the notice given at 20, process 0 14 steps ahead)
            _internals.barrier(f"test/preempted_loop/{step}", 60_000)
        if step == start + 5:
            open(ready, "w").close()
        time.sleep(0.01)  # the work of a real step
        if m.should_save(step):
            m.save(step, state={"w": w})
            saved = step
        if m.preempted:
            break
    m.close()
    return {"saved": saved, "preempted": m.preempted, "start": start}

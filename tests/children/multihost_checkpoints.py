"""The jobs of tests/test_multihost.py (run by children.job in every process): save, restore
onto other meshes and process counts, die mid-save, find a corrupt step."""

import contextlib
import os
import signal
import time
from pathlib import Path

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from children.job import Job
from jaxckpt import _internals
from reliability import faults

W = np.arange(64 * 16, dtype=np.float32).reshape(64, 16)
B = np.arange(16, dtype=np.float32)
ABSTRACT = {
    "w": jax.ShapeDtypeStruct(W.shape, W.dtype),
    "b": jax.ShapeDtypeStruct(B.shape, B.dtype),
    "step": 0,
}


def mesh_of(shape, names=("data", "model")):
    auto = (jax.sharding.AxisType.Auto,) * len(shape)
    devices = jax.devices()[: int(np.prod(shape))]
    return jax.make_mesh(shape, names, axis_types=auto, devices=devices)


def specs_of(job: Job):
    """`job.args["specs"]`: the axes of w and b, as lists (`[]` is P())."""
    return {name: P(*axes) for name, axes in job.args["specs"].items()} | {"step": None}


def make_state(mesh):
    def put(x, spec):
        return jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec), lambda i: x[i])

    return {"w": put(W, P("data", "model")), "b": put(B, P("model")), "step": 7}


class Iterator:
    def __init__(self, process, position=None):
        self.process, self.position = process, position

    def get_state(self):
        return {"process": self.process, "position": self.position}

    def set_state(self, state):
        self.position = state["position"]
        assert state["process"] == self.process, state


def check_shards(array, full):
    # Only the shards this process holds: each process reads what its devices need.
    for shard in array.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), full[shard.index])


def save(job: Job) -> dict:
    """Step 5 from a (4, 2) mesh, with rng, data and meta."""
    with jaxckpt.CheckpointManager(job.args["dir"]) as m:
        # jax.random.key made on every host is host-local: jaxckpt converts it.
        m.save(
            5,
            state=make_state(mesh_of((4, 2))),
            rng=jax.random.key(42),
            data=Iterator(job.process_id, 100 + job.process_id),
            meta={"hosts": job.num_processes},
        )
    return {"steps": m.all_steps()}


def save_replicated_leaves_of_two_dtypes(job: Job) -> dict:
    """Step 1: leaves of one shape, replicated over the processes (each packed piece written
    by the least-loaded of them): one float32, then eight int8."""
    mesh = mesh_of((4, 2))

    def put(x):
        return jax.make_array_from_callback(x.shape, NamedSharding(mesh, P()), lambda i: x[i])

    state = {"a": put(np.ones(64, np.float32))}
    state |= {f"b{i}": put(np.full(64, i, np.int8)) for i in range(8)}
    with jaxckpt.CheckpointManager(job.args["dir"]) as m:
        m.save(1, state=state)
    return {"steps": m.all_steps()}


def restore(job: Job, mesh, specs, with_data):
    target = jaxckpt.target_on_mesh(ABSTRACT, mesh, specs)
    it = Iterator(job.process_id)
    with jaxckpt.CheckpointManager(job.args["dir"]) as m:
        restored = m.restore(state=target, data=it if with_data else None)
    check_shards(restored.state["w"], W)
    check_shards(restored.state["b"], B)
    assert restored.state["w"].sharding == target["w"].sharding
    assert restored.state["step"] == 7
    key = np.asarray(jax.random.key_data(jax.random.key(42)))
    np.testing.assert_array_equal(np.asarray(jax.random.key_data(restored.rng)), key)
    assert restored.rng.sharding.is_fully_replicated
    return {"step": restored.step, "meta": restored.meta, "position": it.position}


def restore_without_then_with_data(job: Job) -> dict:
    mesh, specs = mesh_of(tuple(job.args["shape"])), specs_of(job)
    report = restore(job, mesh, specs, with_data=False)
    try:
        restore(job, mesh, specs, with_data=True)
        report["data_error"] = None
    except jaxckpt.errors.DataStateError as e:
        report["data_error"] = str(e)
    return report


def plan_and_restore_onto_2_4(job: Job) -> dict:
    mesh = mesh_of((2, 4))
    specs = {"w": P("model", "data"), "b": P("data"), "step": None}
    with jaxckpt.CheckpointManager(job.args["dir"]) as m:
        plan = m.plan(state=jaxckpt.target_on_mesh(ABSTRACT, mesh, specs))
    report = restore(job, mesh, specs, with_data=True)
    report["plan_reads"] = [p.read_bytes for p in plan.processes]
    return report


def restore_onto_2_4(job: Job) -> dict:
    specs = {"w": P("data", "model"), "b": P("model"), "step": None}
    return restore(job, mesh_of((2, 4)), specs, with_data=False)


def restore_a_corrupt_step(job: Job) -> dict:
    specs = {"w": P("data", "model"), "b": P(), "step": None}
    try:
        restore(job, mesh_of((2, 4)), specs, with_data=False)
        return {"error": None}
    except jaxckpt.errors.CorruptCheckpointError as e:
        return {"error": str(e)}


def dies_during_step_2(job: Job) -> dict:
    """Saves step 1, then step 2, during which process 1 is killed at the moment
    `job.args["kill"]` names: "once_written" (its shards are written, before the barrier
    where every process confirms its part) or "while_committing" (process 0 kills it as it
    commits). The kill is armed before that save, never timed: a kill right after save()
    returned could come before or after the dead process's part was written, which commit
    differently. Returns the survivor's report of its wait(), and where that raised
    nothing (process 1 reached the commit's last barrier before it died), of its next save."""
    scratch = Path(job.args["scratch"])
    (scratch / f"pid{job.process_id}").write_text(str(os.getpid()))

    def wait_until_process_0_saved():
        # Killing process 1 before process 0's save() returned would fail that save instead.
        deadline = time.monotonic() + 60
        while not (scratch / "saved0").exists() and time.monotonic() < deadline:
            time.sleep(0.01)

    def kill_once_written():
        if job.process_id == 1:
            wait_until_process_0_saved()
            os.kill(os.getpid(), signal.SIGKILL)

    def kill_then_commit(before_commit, step_dir):  # on process 0, its step 2 written
        if step_dir.name.startswith("2"):
            wait_until_process_0_saved()
            os.kill(int((scratch / "pid1").read_text()), signal.SIGKILL)
        before_commit(step_dir)

    mesh = mesh_of((4, 2))
    once_written = job.args["kill"] == "once_written"
    store = faults.store() if once_written else faults.store(before_commit=kill_then_commit)
    m = faults.manager(job.args["dir"], timeout_s=5, store=store)
    m.save(1, state=make_state(mesh))
    m.wait()
    if once_written:
        armed = _internals.on_writes_done(kill_once_written)
    else:
        armed = contextlib.nullcontext()
    with armed:
        m.save(2, state=make_state(mesh))
        (scratch / f"saved{job.process_id}").touch()
        t0 = time.monotonic()
        try:
            m.wait()
            report = {"error": None}
        except jaxckpt.errors.SaveError as e:
            report = {"error": str(e), "missing": e.missing_processes, "committed": e.committed}
    report["seconds"] = time.monotonic() - t0
    if report["error"] is None:  # process 1 confirmed the commit before it died
        try:  # the next agreement names it
            m.save(3, state=make_state(mesh))
            m.wait()
        except (jaxckpt.errors.SaveError, jaxckpt.errors.ProcessesMissingError) as e:
            report |= {"next_error": str(e), "missing": e.missing_processes}
    return report


def list_and_restore(directory: str) -> dict:
    """What a process that was not in the job (the test's own) finds in `directory`: the
    committed steps, the latest restored, and whether it is whole."""
    with jaxckpt.CheckpointManager(directory) as m:
        report = {"steps": m.all_steps()}
        restored = m.restore(state={"w": np.zeros_like(W), "b": np.zeros_like(B), "step": 0})
        report["restored"] = restored.step
        report["intact"] = bool(np.array_equal(restored.state["w"], W))
    return report

"""The jobs of tests/test_agreements.py (and reliability.chaos's): a job whose processes
meet the store at uneven times (random delays at every storage seam, each process its own)
saving many steps under retention, then every kept step restored and compared bitwise;
processes making different calls; process 0's decisions and refusals; a restore where one
process reads slower than the others."""

import random
import time

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from children.job import Job
from reliability import faults

# The store's seams a delay is injected at: the listing, the step-folder check, a file
# opened to read, a folder removed, the commit (process 0), and the wait for a save.
SEAMS = ("scan", "step_folder_exists", "open_file", "remove", "before_commit", "wait")


def delayed_store(seed: int, most_s: float) -> type:
    """The persistent store, each seam first waiting a random time of at most `most_s`
    (seeded: each process its own sequence)."""
    rng = random.Random(seed)

    def pause(real, *args, **kwargs):
        time.sleep(rng.uniform(0, most_s))  # (the fault itself: a slow host or listing)
        return real(*args, **kwargs)

    return faults.store(**dict.fromkeys(SEAMS, pause))


def state_at(step: int, mesh) -> dict:
    """The state saved at `step`: a sharded matrix (changing at every step), a frozen
    one above 1 MiB (shared by incremental steps) and a scalar."""
    changing = np.arange(64 * 8, dtype=np.float32).reshape(64, 8) * step
    frozen = np.arange(512 * 1024, dtype=np.float32).reshape(1024, 512)
    sharding = NamedSharding(mesh, P("data", None))

    def put(x):
        return jax.make_array_from_callback(x.shape, sharding, lambda i: x[i])

    return {"changing": put(changing), "frozen": put(frozen), "step": step}


def mesh_of_all():
    devices = np.array(jax.devices())
    return jax.make_mesh(
        (devices.size,), ("data",), axis_types=(jax.sharding.AxisType.Auto,), devices=devices
    )


def saves_under_retention(job: Job) -> dict:
    """`saves` steps saved with `keep_last` (and `keep_every`), this process's seams delayed
    by up to `delay_s` (seed: `seed` + its index); then a reader restores every kept step
    and compares it bitwise with what was saved."""
    a = job.args
    mesh = mesh_of_all()
    store = delayed_store(a["seed"] * 1000 + job.process_id, a["delay_s"])
    retention = jaxckpt.RetentionPolicy(keep_last=a["keep_last"], keep_every=a.get("keep_every"))
    with faults.manager(
        a["dir"],
        retention=retention,
        incremental=a.get("incremental"),
        timeout_s=a.get("timeout_s", 60),
        store=store,
    ) as mngr:
        for step in range(1, a["saves"] + 1):
            mngr.save(step, state=state_at(step, mesh))
    with jaxckpt.CheckpointManager(a["dir"], read_only=True, timeout_s=60) as reader:
        kept = reader.all_steps()
        for step in kept:
            target = jax.tree.map(
                lambda x: (
                    jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                    if isinstance(x, jax.Array)
                    else x
                ),
                state_at(step, mesh),
            )
            restored = reader.restore(step, state=target).state
            want = state_at(step, mesh)
            for name in ("changing", "frozen"):
                for got, expected in zip(
                    restored[name].addressable_shards, want[name].addressable_shards, strict=True
                ):
                    assert np.array_equal(np.asarray(got.data), np.asarray(expected.data)), (
                        step,
                        name,
                    )
            assert restored["step"] == step
    return {"kept": kept}


def disagreeing(job: Job) -> dict:
    """Process 0 deletes step 1 while the others save step 2: each names what each did.
    The manager no longer agrees after: the job ends unclosed, its processes together."""
    mesh = mesh_of_all()
    mngr = jaxckpt.CheckpointManager(job.args["dir"], timeout_s=60)
    mngr.save(1, state=state_at(1, mesh))
    mngr.wait()
    began = time.monotonic()
    try:
        if job.process_id == 0:
            mngr.delete(1)
        else:
            mngr.save(2, state=state_at(2, mesh))
    except jaxckpt.errors.JaxckptError as e:
        error = e
    waited = time.monotonic() - began
    multihost_utils.sync_global_devices("the disagreement reported")  # (ends together)
    cause = error.__cause__ if isinstance(error, jaxckpt.errors.SaveError) else error
    return {
        "error": type(error).__name__,
        "cause": type(cause).__name__,
        "agreements": {str(k): v for k, v in getattr(cause, "agreements", {}).items()},
        "waited_s": waited,
    }


def decided_for_all(job: Job) -> dict:
    """Process 0's decisions reach every process, its failures as the same errors: a step
    that is not there deleted, a step that exists saved again."""
    mesh = mesh_of_all()
    errors = {}
    with jaxckpt.CheckpointManager(job.args["dir"], timeout_s=60) as mngr:
        mngr.save(1, state=state_at(1, mesh))
        mngr.wait()
        for what, call in (
            ("delete", lambda: mngr.delete(7)),
            ("save", lambda: mngr.save(1, state=state_at(1, mesh))),
        ):
            try:
                call()
            except jaxckpt.errors.JaxckptError as e:
                errors[what] = [type(e).__name__, str(e), getattr(e, "step", None)]
        steps = mngr.all_steps()
    return {"errors": errors, "steps": steps}


def uneven_restore(job: Job) -> dict:
    """Step 1 of `leaves` arrays of 2 MiB saved as Orbax arrays, then restored onto a mesh
    whose rows are the processes, each array replicated over them (read once in the job, a
    part each, a batch of one array at a time: an agreement each), process 1 slower at
    every read by `delay_s`: its restore's time, and whether it is bitwise what was saved."""
    a = job.args
    devices = np.array(jax.devices()).reshape(2, -1)  # a row a process
    mesh = jax.sharding.Mesh(devices, ("x", "y"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    saved = NamedSharding(mesh, P("x", "y"))
    rows = np.arange(512 * 1024, dtype=np.float32).reshape(512, 1024)
    state = {
        f"leaf{i}": jax.make_array_from_callback(rows.shape, saved, lambda x, i=i: rows[x] + i)
        for i in range(a["leaves"])
    }
    with jaxckpt.CheckpointManager(a["dir"], timeout_s=a["timeout_s"], incremental=False) as mngr:
        mngr.save(1, state=state)
    slow = job.process_id == 1

    def pause(real, *args, **kwargs):
        if slow:
            time.sleep(a["delay_s"])  # (the fault itself: a slower host's reads)
        return real(*args, **kwargs)

    replicated = NamedSharding(mesh, P(None, "y"))
    target = {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=replicated) for k, v in state.items()
    }
    with faults.manager(
        a["dir"],
        read_only=True,
        timeout_s=a["timeout_s"],
        restore_inflight_bytes=rows.nbytes,
        store=faults.store(read_arrays=pause),
    ) as reader:
        began = time.monotonic()
        restored = reader.restore(1, state=target).state
        took = time.monotonic() - began
    same = all(
        np.array_equal(np.asarray(shard.data), rows[shard.index] + int(k.removeprefix("leaf")))
        for k in state
        for shard in restored[k].addressable_shards
    )
    return {"took_s": took, "same": same}

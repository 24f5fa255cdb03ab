"""The jobs of tests/test_local_multihost.py (run by children.job in every process): a small
training run with a local tier (each process its own directory) and a persistent one, killed
or not, resumed or not, reporting what each process holds at the end.

`job.args`: persistent (the shared directory), local (a folder with `{process}` in it, or a
list of one folder a process: each process's own directory), start (0: from scratch; "latest": restore the latest step first),
stop (the last step to train), kill_after (SIGKILL every process once this step's saves,
copies included, are written on every process), kill_in_local_write (process 1 SIGKILLs itself inside its local write of this step,
before the rename; the others stop after writing theirs), data (restore the iterator too),
replicas (LocalTier's, 1 by default), restore_step (the step to restore, None: the latest).
"""

import os
import signal
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import xxhash
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from children.job import Job
from jaxckpt import _local


class Iterator:
    """Each process reads its own shard of the data: its own position."""

    def __init__(self, process: int):
        self.process, self.position = process, 0

    def advance(self) -> None:
        self.position += self.process + 1

    def get_state(self):
        return {"process": self.process, "position": self.position}

    def set_state(self, state):
        assert state["process"] == self.process, state
        self.position = state["position"]


def mesh():
    auto = (jax.sharding.AxisType.Auto,) * 2
    n = jax.device_count()
    return jax.make_mesh((n // 2, 2), ("data", "model"), axis_types=auto)


def initial(m):
    w = np.arange(64 * 32, dtype=np.float32).reshape(64, 32) / 7
    big = np.linspace(-1, 1, 512 * 1024, dtype=np.float32).reshape(512, 1024)  # 2 MiB
    put = jax.make_array_from_callback
    sharded = NamedSharding(m, P("data", "model"))
    return {
        "w": put(w.shape, sharded, lambda i: w[i]),
        "big": put(big.shape, sharded, lambda i: big[i]),
        "b": put((4,), NamedSharding(m, P()), lambda i: np.zeros(4, np.float32)[i]),
    }


def target(m):
    return jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), initial(m)
    )


@jax.jit
def update(state, key):
    ka, kb = jax.random.split(key)
    w = state["w"] * 0.5 + jax.random.normal(ka, state["w"].shape)
    big = state["big"] * 0.25 + jax.random.uniform(kb, state["big"].shape)
    return {"w": w, "big": big, "b": state["b"] + jnp.mean(w)}  # a reduction over processes


def digest(state) -> dict:
    out = {}
    for name, array in sorted(state.items()):
        h = xxhash.xxh3_64()
        for shard in sorted(array.addressable_shards, key=lambda s: s.device.id):
            h.update(np.asarray(shard.data).tobytes())
        out[name] = h.hexdigest()
    return out


def manager(job: Job) -> jaxckpt.CheckpointManager:
    local = job.args["local"]
    local = (
        local[job.process_id] if isinstance(local, list) else local.format(process=job.process_id)
    )
    return jaxckpt.CheckpointManager(
        job.args["persistent"],
        policy=jaxckpt.SavePolicy(every_steps=10),
        local=jaxckpt.LocalTier(
            local, every_steps=2, keep_last=2, replicas=job.args.get("replicas", 1)
        ),
    )


def arm_kill_in_local_write(job: Job, step: int) -> None:
    """Process 1 dies inside its local write of `step`: its files written, not renamed; once
    process 0 renamed its own part of it into place (the test's machine: both directories
    are on it), since process 0 aborts as soon as JAX's coordinator sees process 1 gone."""
    if job.process_id != 1:
        return
    real = _local._fsync_dir
    other = Path(job.args["local"].format(process=0)) / str(step)

    def dying(path):
        if path.name == f"{step}{_local.TMP_SUFFIX}":
            deadline = time.monotonic() + 60
            while not other.exists() and time.monotonic() < deadline:
                time.sleep(0.02)
            os.kill(os.getpid(), signal.SIGKILL)
        real(path)

    _local._fsync_dir = dying


def train(job: Job) -> dict:
    m_ = mesh()
    data = Iterator(job.process_id)
    report = {}
    kill_in = job.args.get("kill_in_local_write")
    if kill_in is not None:
        arm_kill_in_local_write(job, kill_in)
    with manager(job) as mngr:
        if job.args["start"] == "latest":
            restored = mngr.restore(
                job.args.get("restore_step"),
                state=target(m_),
                rng=jax.random.key(0),
                data=data if job.args["data"] else None,
            )
            state, key, step = restored.state, restored.rng, restored.step
            report.update(restored=step, tier=restored.tier)
            if job.args.get("kill_after") == step:  # right after the restore
                os.kill(os.getpid(), signal.SIGKILL)
        else:
            state, key, step = initial(m_), jax.random.key(1234), 0
        while step < job.args["stop"]:
            step += 1
            state = update(state, jax.random.fold_in(key, step))
            data.advance()
            if mngr.should_save(step):
                mngr.save(step, state=state, rng=key, data=data)
            if step == kill_in:
                mngr.wait()
                os.kill(os.getpid(), signal.SIGKILL)
            if step == job.args.get("kill_after"):
                mngr.wait()  # this process's part written, and its copies received...
                multihost_utils.sync_global_devices("copies")  # ...as every other's
                os.kill(os.getpid(), signal.SIGKILL)
        mngr.wait()
        report.update(
            step=step,
            position=data.position,
            digest=digest(state),
            latest=mngr.latest_step(),
            persistent=mngr.all_steps(),
        )
    return report

"""The job of tests/test_incremental.py's multi-process test (run by children.job in every
process): three incremental saves of a frozen base and changing adapters, a fourth by a new
manager (a restarted job: no base in memory), then a restore of the last onto another mesh;
`compression` in the job's args, the managers'."""

from pathlib import Path

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from children.job import Job
from children.multihost_checkpoints import check_shards, mesh_of

RNG = np.random.default_rng(0)
BASE = {
    "w0": RNG.standard_normal((1024, 512), np.float32),  # 2 MiB: a piece a shard
    "w1": RNG.standard_normal((1024, 512), np.float32),
    "rep": RNG.standard_normal((1024, 512), np.float32),  # replicated over both processes
}
SPECS = {"w0": P("data", "model"), "w1": P("data", "model"), "rep": P()}


def put(x, mesh, spec):
    return jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec), lambda i: x[i])


def save_three_then_restore(job: Job) -> dict:
    directory = Path(job.args["dir"])
    mesh = mesh_of((4, 2))
    base = {k: put(v, mesh, SPECS[k]) for k, v in BASE.items()}
    own = []
    options = {"incremental": True, "compression": job.args.get("compression")}
    with jaxckpt.CheckpointManager(directory, **options) as m:
        for step in range(3):
            adapter = put(np.full((64, 64), step, np.float32), mesh, P("data", "model"))
            # step 1: the same arrays; step 2: new arrays of the same bytes
            frozen = base if step < 2 else {k: v * 1.0 for k, v in base.items()}
            m.save(step, state={"base": frozen, "adapter": adapter})
            m.wait()
            name = f"{job.process_id}-of-{job.num_processes}.bin"
            own.append((directory / str(step) / "packed" / name).stat().st_size)
    with jaxckpt.CheckpointManager(directory, **options) as m:
        frozen = {k: put(v, mesh, SPECS[k]) for k, v in BASE.items()}
        adapter = put(np.full((64, 64), 3, np.float32), mesh, P("data", "model"))
        m.save(3, state={"base": frozen, "adapter": adapter})
        m.wait()
        own.append((directory / "3" / "packed" / name).stat().st_size)
        other = mesh_of((2, 4))
        target = {
            "base": {
                k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(other, SPECS[k]))
                for k, v in BASE.items()
            }
        }
        restored = m.restore(3, state=target, partial=True).state["base"]
    for k, v in BASE.items():
        check_shards(restored[k], v)
        assert restored[k].sharding == target["base"][k].sharding
    return {"own_bytes": own}

"""One process of `scale.py`'s job (`measure`, run by `tests/multihost.run_job` in each
process of the job): saves and restores one state, counting its own I/O.

`job.args`: {"contender": "jaxckpt" | "orbax", "layout": "replicated" | "fsdp" | "mixed",
"mib": ..., "directory": ...}; the layouts and the counters are tests/children/spread.py's
(the spread tests' own). Returns this process's bytes read and written and its read and
write calls (`/proc/self/io`) around `save` + `wait`, and around a restore in a new manager
onto the same mesh, and whether what was restored is bitwise what was saved.
"""

from __future__ import annotations

import time
from typing import Any

DEVICES = 2  # CPU devices per process


def measure(job: Any) -> dict:
    spec = job.args
    import jax
    import numpy as np
    from children.spread import io_counts, layout
    from jax.sharding import NamedSharding

    def counted(fn):
        before = io_counts()
        start = time.perf_counter()
        fn()
        took = time.perf_counter() - start
        after = io_counts()
        return {k: after[k] - before[k] for k in before} | {"seconds": took}

    sharding = NamedSharding(*layout(job.num_processes, spec["layout"]))
    # 3/4 of the bytes in 8 MiB leaves (Orbax arrays), 1/4 in 1 MiB ones (packed):
    # incompressible, the same on every process.
    mib = spec["mib"]
    shapes = [(2048, 1024)] * (mib * 3 // 4 // 8) + [(256, 1024)] * (mib // 4)
    hosts = {
        f"w{i:03d}": np.random.default_rng(i).standard_normal(s, np.float32)
        for i, s in enumerate(shapes)
    }
    state = {
        k: jax.make_array_from_callback(v.shape, sharding, v.__getitem__) for k, v in hosts.items()
    }
    abstract = {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding) for k, v in state.items()
    }
    directory = spec["directory"]
    contender = spec["contender"]

    if contender == "orbax":
        import orbax.checkpoint as ocp

        writer = ocp.CheckpointManager(directory)
        save = counted(
            lambda: (
                writer.save(1, args=ocp.args.StandardSave(state)),
                writer.wait_until_finished(),
            )
        )
        writer.close()
        reader = ocp.CheckpointManager(directory)
        out = {}
        restore = counted(
            lambda: out.update(reader.restore(1, args=ocp.args.StandardRestore(abstract)))
        )
        reader.close()
    else:
        import jaxckpt

        writer = jaxckpt.CheckpointManager(directory)
        save = counted(lambda: (writer.save(1, state=state), writer.wait()))
        writer.close()
        reader = jaxckpt.CheckpointManager(directory)
        out = {}
        restore = counted(lambda: out.update(reader.restore(state=abstract).state))
        reader.close()

    bitwise = all(
        np.array_equal(np.asarray(shard.data), hosts[k][shard.index])
        for k, v in out.items()
        for shard in v.addressable_shards
    ) and set(out) == set(hosts)
    state_bytes = sum(v.nbytes for v in hosts.values())
    return {"save": save, "restore": restore, "bitwise": bitwise, "state_bytes": state_bytes}

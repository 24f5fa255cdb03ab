"""One process of `plan_memory.py`: saves the state ("save") or restores it, all of it or
`params` only, onto a (2, 4) mesh ("restore") and prints `RESULT <json>`: peak RSS above its
baseline and what `plan` predicted.

    python -m benchmarks.plan_memory_worker MODE DIRECTORY PARTIAL(0|1) INFLIGHT(bytes|auto)
        LEAVES ROWS COLS
"""

import json
import os
import resource
import sys

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt


def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main() -> None:
    mode, directory, partial, inflight, leaves, rows, cols = sys.argv[1:]
    partial, shape = partial == "1", (int(rows), int(cols))
    inflight = None if inflight == "auto" else int(inflight)
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", 8)
    auto = (jax.sharding.AxisType.Auto,) * 2
    leaf = jax.ShapeDtypeStruct(shape, jnp.float32)
    abstract = {g: {f"w{i}": leaf for i in range(int(leaves))} for g in ("params", "opt")}
    if mode == "save":
        mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=auto)
        sharding = NamedSharding(mesh, P("data", "model"))
        make = jax.jit(lambda k: jax.random.normal(k, shape), out_shardings=sharding)
        keys = iter(range(100))
        state = jax.tree.map(lambda _: make(jax.random.key(next(keys))), abstract)
        with jaxckpt.CheckpointManager(directory) as m:
            m.save(1, state=state)
        print("RESULT {}")
    else:
        mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=auto)
        if partial:
            abstract = {"params": abstract["params"]}
        target = jaxckpt.target_on_mesh(abstract, mesh, P("model", "data"))
        m = jaxckpt.CheckpointManager(directory, read_only=True, restore_inflight_bytes=inflight)
        plan = m.plan(state=target, partial=partial).processes[0]
        base = rss()
        restored = m.restore(state=target, partial=partial)
        jax.block_until_ready(restored.state)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        report = {
            "peak_above": peak - base,
            "read": plan.read_bytes,
            "held": plan.device_bytes,
            "plan_peak": plan.peak_host_bytes,
        }
        print("RESULT " + json.dumps(report))


if __name__ == "__main__":
    main()

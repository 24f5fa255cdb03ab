"""One process of `restore_memory.py`: saves the state ("save") or restores it onto a (2, 4)
mesh ("restore") and prints `RESULT <json>`: peak RSS above its baseline, bytes decoded,
seconds, and what `plan` predicted.

    python -m benchmarks.restore_memory_worker MODE DIRECTORY PROCESSES PROCESS_ID DEVICES
        PORT LEAVES ROWS COLS VERIFY(0|1) INFLIGHT(bytes|auto)
"""

import json
import os
import resource
import sys
import time

import jax
import jax.numpy as jnp
import tensorstore as ts
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from reliability import launch


def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def decoded():
    for m in ts.experimental_collect_matching_metrics("/tensorstore/kvstore/file/"):
        if m["name"].endswith("bytes_read"):
            return m["values"][0]["value"]
    return 0


def main() -> None:
    mode, directory, processes, process_id, devices, port, leaves, rows, cols, verify, inflight = (
        sys.argv[1:]
    )
    processes, leaves, shape = int(processes), int(leaves), (int(rows), int(cols))
    launch.join_job(devices, processes, int(process_id), port)
    auto = (jax.sharding.AxisType.Auto,) * 2
    abstract = {f"w{i}": jax.ShapeDtypeStruct(shape, jnp.float32) for i in range(leaves)}
    if mode == "save":
        mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=auto)
        sharding = NamedSharding(mesh, P("data", "model"))
        make = jax.jit(lambda k: jax.random.normal(k, shape), out_shardings=sharding)
        state = {name: make(jax.random.key(i)) for i, name in enumerate(abstract)}
        with jaxckpt.CheckpointManager(directory) as m:
            m.save(1, state=state)
        print("RESULT {}")
    else:
        mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=auto)
        target = jaxckpt.target_on_mesh(abstract, mesh, P("model", "data"))
        m = jaxckpt.CheckpointManager(
            directory,
            read_only=True,
            verify_on_restore=verify == "1",
            restore_inflight_bytes=None if inflight == "auto" else int(inflight),
        )
        plan = m.plan(state=target).processes[jax.process_index()]
        base, before, t0 = rss(), decoded(), time.perf_counter()
        restored = m.restore(state=target)
        jax.block_until_ready(restored.state)
        seconds = time.perf_counter() - t0
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        report = {
            "peak_above": peak - base,
            "decoded": decoded() - before,
            "seconds": seconds,
            "plan_read": plan.read_bytes,
            "plan_peak": plan.peak_host_bytes,
        }
        print("RESULT " + json.dumps(report))


if __name__ == "__main__":
    main()

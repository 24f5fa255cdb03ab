"""One process of `restore_memory.py`: writes a state the way one tool writes it ("save"),
or restores it with that tool ("restore") and prints `RESULT <json>`: peak RSS above its
baseline (sampled every 2 ms, and the kernel's high-water mark since the baseline), what it
still holds after, the state's share of this process, seconds, and (jaxckpt) what `plan`
bounded. A save (the process's first) reports the same of itself, from its start until its
step is committed.

    python -m benchmarks.restore_memory_worker MODE TOOL DIRECTORY PROCESSES PROCESS_ID
        DEVICES PORT MIB MESH(same|reshard) BUDGET(MiB|auto)

JAXCKPT_TREE in the environment: jaxckpt imported from that tree. TOOL: jaxckpt (a
`CheckpointManager`; to save: jaxckpt-zstd with `compression="zstd"`, jaxckpt-zstd-arrays
with `incremental=False` too: tensorstore's zstd on Orbax arrays), orbax (plain
`ocp.StandardCheckpointer`, its own checkpoint: zstd, its default) or tensorstore (a zarr3 array per leaf, each device's slice read by
tensorstore and placed, as `jax.make_array_from_callback` does: no checkpoint library).
"""

import json
import os
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from reliability import launch

if tree := os.environ.get("JAXCKPT_TREE"):  # jaxckpt as of another commit (--before)
    sys.path.insert(0, tree)

LEAVES = 16


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Peak:
    """The largest RSS seen by a thread sampling every 2 ms."""

    def __init__(self) -> None:
        self.value, self._stop = rss(), threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self.value = max(self.value, rss())

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.value, rss())


def reset_high_water() -> None:
    """The kernel's high-water mark of this process's RSS counted from here on."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def high_water() -> int:
    """The kernel's high-water mark of this process's RSS since `reset_high_water`."""
    with open("/proc/self/status") as f:
        return next(int(r.split()[1]) * 1024 for r in f if r.startswith("VmHWM:"))


def tensorstore_spec(directory: str, name: str) -> dict:
    return {"driver": "zarr3", "kvstore": {"driver": "file", "path": f"{directory}/{name}"}}


def main() -> None:
    mode, tool, directory, processes, process_id, devices, port, mib, mesh_kind, budget = sys.argv[
        1:
    ]
    processes, mib = int(processes), int(mib)
    launch.join_job(devices, processes, int(process_id), port)
    rows = 1024
    shape = (rows, mib * 2**20 // 4 // LEAVES // rows)
    auto = (jax.sharding.AxisType.Auto,) * 2
    saved_mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=auto)
    abstract = {f"w{i}": jax.ShapeDtypeStruct(shape, jnp.float32) for i in range(LEAVES)}
    if mode == "save":
        sharding = NamedSharding(saved_mesh, P("data", "model"))
        make = jax.jit(lambda k: jax.random.normal(k, shape), out_shardings=sharding)
        state = {name: make(jax.random.key(i)) for i, name in enumerate(abstract)}
        jax.block_until_ready(state)
        import orbax.checkpoint as ocp
        import tensorstore as ts

        import jaxckpt  # (each tool's imports before the baseline)

        reset_high_water()
        base = rss()
        peak = Peak()
        t0 = time.perf_counter()
        if tool.startswith("jaxckpt"):
            options = {
                "jaxckpt": {},
                "jaxckpt-zstd": {"compression": "zstd"},
                "jaxckpt-zstd-arrays": {"compression": "zstd", "incremental": False},
            }[tool]
            with jaxckpt.CheckpointManager(directory, **options) as m:
                m.save(1, state=state)
        elif tool == "orbax":
            with ocp.StandardCheckpointer() as c:
                c.save(f"{directory}/state", state)
        else:
            for name, array in state.items():
                spec = {**tensorstore_spec(directory, name), "metadata": {}}
                t = ts.open(spec, create=True, dtype=ts.float32, shape=shape).result()
                t.write(np.asarray(array)).result()
        seconds = time.perf_counter() - t0
        top = peak.stop()
        share = mib * 2**20 // processes
        report = {"peak_above": top - base, "high_water_above": high_water() - base}
        print("RESULT " + json.dumps(report | {"share": share, "seconds": seconds}))
        return
    mesh = saved_mesh if mesh_kind == "same" else jax.make_mesh((2, 4), ("data", "model"))
    sharding = NamedSharding(mesh, P("data", "model"))
    target = {n: jax.ShapeDtypeStruct(shape, jnp.float32, sharding=sharding) for n in abstract}
    share = mib * 2**20 // processes  # each process's devices hold an equal part
    plan_peak = None
    if tool == "jaxckpt":
        import jaxckpt

        m = jaxckpt.CheckpointManager(
            directory,
            read_only=True,
            restore_inflight_bytes=None if budget == "auto" else int(budget) * 2**20,
        )
        plan_peak = m.plan(state=target).processes[jax.process_index()].peak_host_bytes
        restore = lambda: m.restore(state=target).state  # noqa: E731
    elif tool == "orbax":
        import orbax.checkpoint as ocp

        checkpointer = ocp.StandardCheckpointer()
        restore = lambda: checkpointer.restore(f"{directory}/state", target)  # noqa: E731
    else:
        import tensorstore as ts

        def restore():
            out = {}
            for name in abstract:
                t = ts.open(tensorstore_spec(directory, name)).result()
                out[name] = jax.make_array_from_callback(
                    shape, sharding, lambda index, t=t: t[index].read().result()
                )
            return out

    reset_high_water()
    base = rss()
    peak = Peak()
    t0 = time.perf_counter()
    restored = restore()
    jax.block_until_ready(restored)
    seconds = time.perf_counter() - t0
    top = peak.stop()
    report = {
        "peak_above": top - base,
        "high_water_above": high_water() - base,
        "after_above": rss() - base,
        "share": share,
        "seconds": seconds,
        "plan_peak": plan_peak,
    }
    print("RESULT " + json.dumps(report))


if __name__ == "__main__":
    main()

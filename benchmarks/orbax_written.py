"""Restoring a step that plain Orbax wrote: jaxckpt against Orbax itself, on the same files.

Plain Orbax saves a MaxText-style step (`ocp.CheckpointManager(dir, item_names=("items",))`,
`Composite(items=PyTreeSave(state))`) from a (4, 2) mesh of 8 CPU devices, for two states:
1 GiB in 16 leaves of 64 MiB, and 64 MiB in 4,000 leaves. Each is then restored onto a
(2, 4) mesh, alternately by Orbax (`PyTreeRestore` with the target's restore args) and by
`jaxckpt.CheckpointManager(dir, read_only=True).restore(state=target)`; medians of
`--repeat` runs, in one process (the page cache is warm for both).

    python benchmarks/orbax_written.py [--repeat 5] [--out benchmarks/results/orbax_written.md]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from benchmarks.tables import write_page

STATES = {"1 GiB, 16 leaves": (16, (4096, 4096)), "64 MiB, 4,000 leaves": (4000, (64, 64))}


def mesh_of(shape):
    return jax.make_mesh(shape, ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


def state(count, shape, mesh):
    sharding = NamedSharding(mesh, P("data", "model"))
    layers = {
        f"layer_{i}": {"kernel": jax.device_put(np.full(shape, i, np.float32), sharding)}
        for i in range(count)
    }
    step = jax.device_put(np.int32(7), NamedSharding(mesh, P()))
    return {"params": {"params": layers}, "step": step}


def target(count, shape, mesh):
    kernel = jax.ShapeDtypeStruct(shape, np.float32, sharding=NamedSharding(mesh, P("model")))
    layers = {f"layer_{i}": {"kernel": kernel} for i in range(count)}
    step = jax.ShapeDtypeStruct((), np.int32, sharding=NamedSharding(mesh, P()))
    return {"params": {"params": layers}, "step": step}


def orbax_restore(directory, abstract):
    args = jax.tree.map(
        lambda x: ocp.ArrayRestoreArgs(sharding=x.sharding, global_shape=x.shape, dtype=x.dtype),
        abstract,
    )
    restore = ocp.args.PyTreeRestore(item=abstract, restore_args=args)
    with ocp.CheckpointManager(directory, item_names=("items",)) as m:
        return m.restore(7, args=ocp.args.Composite(items=restore))["items"]


def jaxckpt_restore(directory, abstract):
    with jaxckpt.CheckpointManager(directory, read_only=True) as m:
        return m.restore(state=abstract).state


def timed(fn, *args) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/orbax_written.md"))
    args = parser.parse_args()
    rows = []
    for label, (count, shape) in STATES.items():
        with tempfile.TemporaryDirectory(dir=os.environ.get("JAXCKPT_BENCH_DIR")) as tmp:
            directory = Path(tmp) / "run"
            with ocp.CheckpointManager(directory, item_names=("items",)) as m:
                saved = state(count, shape, mesh_of((4, 2)))
                m.save(7, args=ocp.args.Composite(items=ocp.args.PyTreeSave(saved)))
            del saved
            abstract = target(count, shape, mesh_of((2, 4)))
            times = {"orbax": [], "jaxckpt": []}
            for _ in range(args.repeat):  # alternating, so that both see the same machine
                times["orbax"].append(timed(orbax_restore, directory, abstract))
                times["jaxckpt"].append(timed(jaxckpt_restore, directory, abstract))
            orbax, ours = (statistics.median(times[k]) for k in ("orbax", "jaxckpt"))
            rows.append([label, f"{orbax:.3f} s", f"{ours:.3f} s", f"{ours / orbax:.2f}x"])
            print(label, times, flush=True)
    write_page(
        args.out,
        "Restoring a step that plain Orbax wrote",
        f"`python benchmarks/orbax_written.py --repeat {args.repeat}`: a MaxText-style step "
        "that plain Orbax saved from a (4, 2) mesh of 8 CPU devices, restored onto a (2, 4) "
        "mesh by Orbax itself and by jaxckpt (read-only manager, same target; the step has "
        "no manifest, so nothing is hashed). Medians, alternating runs in one process.",
        ["state", "Orbax restore", "jaxckpt restore", "jaxckpt / Orbax"],
        rows,
    )


if __name__ == "__main__":
    main()

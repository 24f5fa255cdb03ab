"""Plain Orbax under different options, on one state: the evidence for jaxckpt's settings.

    python benchmarks/orbax_options.py [--state adamw|leaves] [--runs 5] VARIANT ...

VARIANT names combine: `default` (Orbax's own: OCDBT, zstd, one data file at a time),
`nozstd` (use_compression=False), `fsN` (ocdbt_target_data_file_size=N MiB), `rcN`
(restore_concurrent_gb=N/1000, Orbax's in-flight limiter). One process, 8 CPU devices, the
variants alternate; prints median save total (until committed) and restore times.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import sys
import tempfile
import time

import jax

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)

import orbax.checkpoint as ocp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

STATES = {"adamw": [(2304, 2304)] * 48, "leaves": [(256, 256)] * 4000}


def handler(variant: str) -> ocp.PyTreeCheckpointHandler:
    options = {}
    if "nozstd" in variant:
        options["use_compression"] = False
    if m := re.search(r"rc(\d+)", variant):
        options["restore_concurrent_gb"] = int(m.group(1)) / 1000
    return ocp.PyTreeCheckpointHandler(**options)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variants", nargs="+")
    parser.add_argument("--state", choices=STATES, default="adamw")
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()

    mesh = jax.make_mesh((4, 2), ("data", "model"))
    sharding = NamedSharding(mesh, P("data", "model"))
    make = jax.jit(lambda k, s: jax.random.normal(k, s), static_argnums=1, out_shardings=sharding)
    state = {f"p{i}": make(jax.random.key(i), s) for i, s in enumerate(STATES[args.state])}
    target = {
        k: ocp.ArrayRestoreArgs(sharding=x.sharding, global_shape=x.shape, dtype=x.dtype)
        for k, x in state.items()
    }
    abstract = {k: jax.ShapeDtypeStruct(x.shape, x.dtype) for k, x in state.items()}
    work = tempfile.mkdtemp(prefix="jaxckpt-orbax-options-")
    try:
        managers = {
            v: ocp.CheckpointManager(
                os.path.join(work, v),
                options=ocp.CheckpointManagerOptions(max_to_keep=1),
                item_handlers={"state": handler(v)},
            )
            for v in args.variants
        }
        times = {v: {"total": [], "restore": []} for v in args.variants}
        step = 0
        for round_ in range(args.runs + 1):
            for v, m in managers.items():
                step += 1
                extra = {}
                if size := re.search(r"fs(\d+)", v):
                    extra["ocdbt_target_data_file_size"] = int(size.group(1)) * 2**20
                t0 = time.perf_counter()
                m.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state, **extra)))
                m.wait_until_finished()
                t1 = time.perf_counter()
                restore = ocp.args.PyTreeRestore(abstract, restore_args=target)
                jax.block_until_ready(m.restore(step, args=ocp.args.Composite(state=restore)))
                t2 = time.perf_counter()
                if round_:
                    times[v]["total"].append(t1 - t0)
                    times[v]["restore"].append(t2 - t1)
        for v, t in times.items():
            print(
                f"{v:24s} save total {statistics.median(t['total']):.3f} s  "
                f"restore {statistics.median(t['restore']):.3f} s"
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

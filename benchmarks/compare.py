"""jaxckpt vs plain Orbax vs raw disk: save blocking time, save total, restore.

    python benchmarks/compare.py [--quick] [--runs 5] [--out BENCHMARKS.md]

Each state runs in a fresh process on 8 CPU devices, (4, 2) mesh. In that process every
contender saves and restores the same state, alternating, one warm-up round, then `--runs`
timed rounds; medians and min-max are reported, and the ratios come from the same run.

Contenders:
* jaxckpt: `CheckpointManager.save` (returns after the device-to-host copy), `wait`, `restore`
  onto the live shardings (`target_like`), checksums verified (the default);
* orbax: plain `ocp.CheckpointManager` with its defaults (async, OCDBT, zstd),
  `StandardSave` / `StandardRestore`;
* raw disk: the same shard bytes written by 8 threads, one file per shard, each fsynced
  (a practical physical limit here); restore reads them back and builds the arrays.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

STATES = {
    # name: (description, leaf shapes)
    "64MiB": ("~64 MiB float32, 16 leaves", [(1024, 1024)] * 16),
    "1GiB-adamw": (
        "~1 GiB: float32 params + AdamW mu and nu (3 x 16 leaves of 21 MiB)",
        [(2304, 2304)] * 48,
    ),
    "1GiB-4000-leaves": ("~1 GiB in 4,000 float32 leaves of 256 KiB", [(256, 256)] * 4000),
}

WORKER = textwrap.dedent(
    """
    import json, os, shutil, sys, time
    from concurrent.futures import ThreadPoolExecutor
    import jax
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", 8)
    import jax.numpy as jnp
    import numpy as np
    import orbax.checkpoint as ocp
    from jax.sharding import NamedSharding, PartitionSpec as P
    import jaxckpt

    shapes, work, runs = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    sharding = NamedSharding(mesh, P("data", "model"))
    make = jax.jit(lambda k, shape: jax.random.normal(k, shape), static_argnums=1, out_shardings=sharding)
    state = {f"p{i}": make(jax.random.key(i), tuple(s)) for i, s in enumerate(shapes)}
    jax.block_until_ready(state)
    target = jaxckpt.target_like(state)

    def du(path):
        files = [os.path.join(r, f) for r, _, fs in os.walk(path) for f in fs]
        return sum(os.path.getsize(f) for f in files), len(files)

    class Jaxckpt:
        def __init__(self):
            self.dir = os.path.join(work, "jaxckpt")
            self.m = jaxckpt.CheckpointManager(self.dir, retention=jaxckpt.RetentionPolicy(keep_last=1))
        def save(self, step):
            self.m.save(step, state=state)
        def wait(self):
            self.m.wait()
        def restore(self, step):
            return self.m.restore(step, state=target).state
        def step_dir(self, step):
            return os.path.join(self.dir, str(step))

    class Orbax:
        def __init__(self):
            self.dir = os.path.join(work, "orbax")
            self.m = ocp.CheckpointManager(self.dir, options=ocp.CheckpointManagerOptions(max_to_keep=1))
        def save(self, step):
            self.m.save(step, args=ocp.args.StandardSave(state))
        def wait(self):
            self.m.wait_until_finished()
        def restore(self, step):
            return self.m.restore(step, args=ocp.args.StandardRestore(target))
        def step_dir(self, step):
            return os.path.join(self.dir, str(step))

    class Raw:
        # One file per (leaf, shard), 8 writer threads, each file fsynced.
        def __init__(self):
            self.dir = os.path.join(work, "raw")
            self.pool = ThreadPoolExecutor(8)
        def _write(self, path, data):
            with open(path, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        def save(self, step):
            d = self.step_dir(step)
            shutil.rmtree(self.dir, ignore_errors=True)
            os.makedirs(d)
            jobs = []
            for name, x in state.items():
                for k, shard in enumerate(x.addressable_shards):
                    if shard.replica_id == 0:
                        jobs.append(self.pool.submit(self._write, os.path.join(d, f"{name}.{k}"), np.asarray(shard.data)))
            for j in jobs:
                j.result()
        def wait(self):
            pass
        def restore(self, step):
            d = self.step_dir(step)
            def read(name, x):
                shards = []
                for k, shard in enumerate(x.addressable_shards):
                    data = np.fromfile(os.path.join(d, f"{name}.{k}"), dtype=np.float32).reshape(shard.data.shape)
                    shards.append(jax.device_put(data, shard.device))
                return jax.make_array_from_single_device_arrays(x.shape, x.sharding, shards)
            return dict(zip(state, self.pool.map(read, state, state.values())))
        def step_dir(self, step):
            return os.path.join(self.dir, str(step))

    contenders = {"jaxckpt": Jaxckpt(), "orbax": Orbax(), "raw": Raw()}
    results = {name: {"blocking": [], "total": [], "restore": []} for name in contenders}
    step = 0
    for round_ in range(runs + 1):  # round 0 is the warm-up
        for name, c in contenders.items():
            step += 1
            t0 = time.perf_counter()
            c.save(step)
            t1 = time.perf_counter()
            c.wait()
            t2 = time.perf_counter()
            restored = c.restore(step)
            jax.block_until_ready(restored)
            t3 = time.perf_counter()
            assert all(np.array_equal(np.asarray(restored[k]), np.asarray(state[k])) for k in list(state)[:2])
            del restored
            if round_:
                results[name]["blocking"].append(t1 - t0)
                results[name]["total"].append(t2 - t0)
                results[name]["restore"].append(t3 - t2)
            bytes_, files = du(c.step_dir(step))
            results[name]["bytes"], results[name]["files"] = bytes_, files
    print("RESULT " + json.dumps(results))
    """
)


def run_state(shapes, runs: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="jaxckpt-compare-") as work:
        proc = subprocess.run(
            [sys.executable, "-c", WORKER, json.dumps(shapes), work, str(runs)],
            capture_output=True,
            text=True,
            timeout=3600,
        )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"benchmark worker failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1][7:])


def fmt(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="only the 64 MiB state (~1 min)")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).resolve().parent.parent / "BENCHMARKS.md"
    )
    args = parser.parse_args()
    names = ["64MiB"] if args.quick else list(STATES)

    lines = [
        "# Benchmarks: jaxckpt vs plain Orbax vs raw disk",
        "",
        f"Regenerated by `python benchmarks/compare.py{' --quick' if args.quick else ''} --runs {args.runs}`. "
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
        "8 CPU devices on a (4, 2) mesh, local disk. Each state runs in a fresh process; the "
        f"contenders alternate, one warm-up round then {args.runs} timed rounds; medians with "
        "(min-max) in seconds. Ratios are of medians from the same run; for time, lower is better.",
        "",
        "| state | contender | save blocking | save total | restore (same mesh) | on disk | files |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    ratio_lines = []
    for name in names:
        description, shapes = STATES[name]
        print(f"running {name}: {description} ...", flush=True)
        result = run_state(shapes, args.runs)
        for contender, r in result.items():
            lines.append(
                f"| {description} | {contender} | {fmt(r['blocking'])} | {fmt(r['total'])} | "
                f"{fmt(r['restore'])} | {r['bytes'] / 2**20:.1f} MiB | {r['files']} |"
            )

        def med(c, k, result=result):
            return statistics.median(result[c][k])

        ratio_lines.append(
            f"| {description} | {med('jaxckpt', 'blocking') / med('orbax', 'blocking'):.2f} | "
            f"{med('jaxckpt', 'total') / med('orbax', 'total'):.2f} | "
            f"{med('raw', 'total') / med('jaxckpt', 'total'):.2f} | "
            f"{med('jaxckpt', 'restore') / med('orbax', 'restore'):.2f} |"
        )
    lines += [
        "",
        "| state | blocking jaxckpt/Orbax | save total jaxckpt/Orbax | save rate jaxckpt/raw disk | restore jaxckpt/Orbax |",
        "| --- | --- | --- | --- | --- |",
        *ratio_lines,
        "",
        "Targets (issue 6): blocking <= 1.0x Orbax; save rate >= 0.6x raw disk; restore <= 1.0x Orbax.",
        "Restore and export memory and speed: [restore memory](benchmarks/results/restore_memory.md), "
        "[safetensors export/import](benchmarks/results/hf_io.md).",
    ]
    text = "\n".join(lines) + "\n"
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

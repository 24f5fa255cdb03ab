"""The live safetensors export against `safetensors.numpy.save_file`, alone and in many
rounds, on any directory: on the disk (what users get, but this machine's disk swings 2-3x
between rounds) and on a tmpfs such as /dev/shm (no disk: the software path alone).

    python benchmarks/export_ab.py [--dir /dev/shm/jaxckpt-export] [--rounds 9] [--mib 1024]

The state: float32 leaves of 21 MiB sharded (4, 2) over 8 CPU devices, like the 1 GiB state
of compare.py. Each round writes every contender into a new path (the previous outputs are
removed and `os.sync()` runs before each, outside the timing); every write ends with fsync.

Contenders:
- `save_safetensors`: jaxckpt's live export from the sharded arrays;
- `save_file (host arrays)`: safetensors' save_file of arrays already gathered to the host;
- `gather + save_file`: what a user would otherwise write, `np.asarray` of each leaf then
  save_file. Each round gathers fresh arrays: jax caches an array's host copy after the
  first `np.asarray`, which would make every later gather free.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time

LEAF_SHAPE = (2048, 2688)  # 21 MiB of float32


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="/tmp/jaxckpt-export-ab", help="where to write")
    parser.add_argument("--rounds", type=int, default=9, help="timed rounds (plus a warm-up)")
    parser.add_argument("--mib", type=int, default=1024, help="size of the state")
    args = parser.parse_args()

    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", 8)
    import numpy as np
    import safetensors.numpy
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxckpt

    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    make = jax.jit(
        lambda key: jax.random.normal(key, LEAF_SHAPE),
        out_shardings=NamedSharding(mesh, P("data", "model")),
    )
    leaves = max(1, args.mib * 2**20 // (4 * LEAF_SHAPE[0] * LEAF_SHAPE[1]))
    state = {f"p{i}": make(jax.random.key(i)) for i in range(leaves)}
    host = {k: np.asarray(v) for k, v in state.items()}
    size = sum(x.nbytes for x in host.values())

    def save_file(tensors, path):
        safetensors.numpy.save_file(tensors, path)
        with open(path, "rb+") as f:
            os.fsync(f.fileno())

    def fresh_copies():  # new device buffers: their host copies are not cached yet
        return jax.block_until_ready({k: v.copy() for k, v in state.items()})

    contenders = {
        "jaxckpt save_safetensors (live state)": (
            lambda: None,
            lambda path, _: jaxckpt.save_safetensors(state, path),
        ),
        "safetensors save_file (host arrays)": (
            lambda: None,
            lambda path, _: save_file(host, path + ".safetensors"),
        ),
        "np.asarray (gather) + safetensors save_file": (
            fresh_copies,
            lambda path, arrays: save_file(
                {k: np.asarray(v) for k, v in arrays.items()}, path + ".safetensors"
            ),
        ),
    }
    times: dict[str, list[float]] = {name: [] for name in contenders}
    try:
        for round_ in range(args.rounds + 1):
            for name, (prepare, write) in contenders.items():
                shutil.rmtree(args.dir, ignore_errors=True)
                os.makedirs(args.dir)
                arrays = prepare()
                os.sync()
                t0 = time.perf_counter()
                write(os.path.join(args.dir, "out"), arrays)
                elapsed = time.perf_counter() - t0
                del arrays
                if round_:  # round 0 warms up
                    times[name].append(elapsed)
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)

    print(f"{size / 2**20:.0f} MiB in {leaves} leaves, {args.rounds} rounds, into {args.dir}")
    print("| contender | median s | min-max s | GB/s | vs save_file (host arrays) |")
    print("| --- | --- | --- | --- | --- |")
    reference = statistics.median(times["safetensors save_file (host arrays)"])
    for name, t in times.items():
        median = statistics.median(t)
        print(
            f"| {name} | {median:.3f} | {min(t):.3f}-{max(t):.3f} | {size / median / 1e9:.2f} "
            f"| {reference / median:.2f}x |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

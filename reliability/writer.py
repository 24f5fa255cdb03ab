"""A writer of `reliability.stress` trials: saves step after step (resuming after the latest)
until it is killed, printing each step once `save` returned. Values are `expected(step)`.
With `incremental` (`reliability.incremental`'s trials) each step also holds a frozen leaf,
the same array every step (`frozen()`), saved incrementally, the last two steps kept
(`incremental-zstd`: each piece a zstd frame).

    python -m reliability.writer DIRECTORY PROCESS_ID NUM_PROCESSES DEVICES PORT N \
        [incremental | incremental-zstd]
"""

import sys

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from reliability import launch


def frozen(n: int) -> np.ndarray:
    return np.arange(n, dtype=np.float32) * 2


def main() -> None:
    directory, pid, nproc, devices, port, n, *mode = sys.argv[1:]
    pid, nproc, n = int(pid), int(nproc), int(n)
    incremental = mode in (["incremental"], ["incremental-zstd"])
    launch.join_job(devices, nproc, pid, port, heartbeat_timeout_seconds=10)
    mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    sharding = NamedSharding(mesh, P("x"))
    options: dict = {}
    if incremental:
        options = {"incremental": True, "retention": jaxckpt.RetentionPolicy(keep_last=2)}
        options["compression"] = "zstd" if mode == ["incremental-zstd"] else None
    m = jaxckpt.CheckpointManager(directory, timeout_s=10, writer_lease_s=2, **options)
    base = jax.make_array_from_callback((n,), sharding, lambda i: frozen(n)[i])
    start = (m.latest_step() or 0) + 1
    for step in range(start, start + 10_000):
        x = jax.make_array_from_callback(
            (n,), sharding, lambda i, step=step: (np.arange(n, dtype=np.float32) + step)[i]
        )
        state = {"x": x, "frozen": base} if incremental else {"x": x}
        m.save(step, state=state, meta={"step": step})
        print(step, flush=True)


if __name__ == "__main__":
    main()

"""A writer (or checker) of `reliability.stress`'s local-tier trials: one process of a
2-process job with a local tier (every step, replicas=1) and a persistent one (every 5th
step). Values are `expected(step)`.

    python -m reliability.local_writer PERSISTENT LOCAL PROCESS_ID NUM_PROCESSES DEVICES PORT N MODE

MODE "write": restores the latest step if there is one, then saves step after step until it
is killed, printing each step once `save` returned. MODE "check": restores the latest step
and prints one JSON line (step, tier, whether its values are exact), then saves the next
step to both tiers, waits for it and prints the steps of both tiers.
"""

import json
import sys

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from reliability import launch


def main() -> None:
    persistent, local, pid, nproc, devices, port, n, mode = sys.argv[1:]
    pid, nproc, n = int(pid), int(nproc), int(n)
    launch.join_job(devices, nproc, pid, port, heartbeat_timeout_seconds=10)
    mesh = jax.make_mesh((jax.device_count(),), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    sharding = NamedSharding(mesh, P("x"))

    def values(step):
        return jax.make_array_from_callback(
            (n,), sharding, lambda i: (np.arange(n, dtype=np.float32) + step)[i]
        )

    m = jaxckpt.CheckpointManager(
        persistent,
        policy=jaxckpt.SavePolicy(every_steps=5),
        local=jaxckpt.LocalTier(local, every_steps=1, keep_last=2, replicas=1),
        timeout_s=10,
        writer_lease_s=2,
    )
    target = {"x": jax.ShapeDtypeStruct((n,), np.float32, sharding=sharding)}
    start = 0
    if m.latest_step() is not None:
        r = m.restore(state=target)
        exact = all(
            np.array_equal(np.asarray(s.data), (np.arange(n, dtype=np.float32) + r.step)[s.index])
            for s in r.state["x"].addressable_shards
        )
        start = r.step
        if mode == "check":
            print(json.dumps({"step": r.step, "tier": r.tier, "exact": exact}), flush=True)
    elif mode == "check":
        print(json.dumps({"step": None, "tier": None, "exact": True}), flush=True)
    if mode == "check":
        step = start + 5 - start % 5  # the next step both tiers save
        assert m.should_save(step)
        m.save(step, state={"x": values(step)})
        m.wait()
        print(json.dumps({"persistent": m.all_steps(), "latest": m.latest_step()}), flush=True)
        m.close()
        return
    total = jax.jit(lambda x: x.sum())
    for step in range(start + 1, start + 10_000):
        x = values(step)
        total(x).block_until_ready()  # a collective, as a training step has: a survivor stops
        if m.should_save(step):
            m.save(step, state={"x": x})
            print(step, flush=True)


if __name__ == "__main__":
    main()

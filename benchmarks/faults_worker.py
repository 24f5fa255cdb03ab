"""One process of benchmarks/faults.py's runs (see there): joins a job of `processes` on
127.0.0.1 (gloo, CPU devices), then saves and restores through the fault proxy the
environment points the store's clients at, and prints one `RESULT <json>` line.

    python -m benchmarks.faults_worker PROCESS_ID PROCESSES DEVICES PORT ARGS_JSON
"""

from __future__ import annotations

import json
import sys
import time

from reliability import launch


def _state(step: int, mib: float, mesh, changing_all: bool):
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    sharding = NamedSharding(mesh, P("data"))
    rows = max(8, int(mib * 2**20 / 4 / 256) // 8 * 8)
    frozen = np.arange(rows * 256, dtype=np.float32).reshape(rows, 256)
    big = frozen + step if changing_all else frozen  # new bytes at each step, or shared
    small = np.full((64, 8), step, np.float32)  # changes at every step
    put = lambda x: jax.make_array_from_callback(x.shape, sharding, lambda i: x[i])  # noqa: E731
    return {"big": put(big), "small": put(small), "step": step}


def main() -> None:
    process_id, processes, devices, port, raw = sys.argv[1:]
    args = json.loads(raw)
    launch.join_job(devices, int(processes), int(process_id), port)
    import jax
    import numpy as np

    import jaxckpt

    mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    errors: list[str] = []
    times: list[float] = []
    committed = 0
    retention = jaxckpt.RetentionPolicy(keep_last=args.get("keep_last"))
    with jaxckpt.CheckpointManager(
        args["dir"], retention=retention, timeout_s=args["timeout_s"]
    ) as mngr:
        for step in range(1, args["saves"] + 1):
            state = _state(step, args["mib"], mesh, args["changing_all"])
            began = time.monotonic()
            try:
                mngr.save(step, state=state)
                mngr.wait()
                committed += 1
                times.append(time.monotonic() - began)
            except jaxckpt.errors.JaxckptError as e:
                errors.append(f"save {step}: {type(e).__name__}: {str(e)[:300]}")
    restored, wrong, corrupt, restore_s = 0, 0, 0, []
    with jaxckpt.CheckpointManager(args["dir"], read_only=True, timeout_s=args["timeout_s"]) as r:
        for step in r.all_steps():
            want = _state(step, args["mib"], mesh, args["changing_all"])
            target = jax.tree.map(
                lambda x: (
                    jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                    if isinstance(x, jax.Array)
                    else x
                ),
                want,
            )
            began = time.monotonic()
            try:
                got = r.restore(step, state=target).state
                restore_s.append(time.monotonic() - began)
                restored += 1
                same = all(
                    np.array_equal(np.asarray(a.data), np.asarray(b.data))
                    for k in ("big", "small")
                    for a, b in zip(
                        got[k].addressable_shards, want[k].addressable_shards, strict=True
                    )
                )
                wrong += not same
            except jaxckpt.errors.CorruptCheckpointError:
                corrupt += 1
            except jaxckpt.errors.JaxckptError as e:
                errors.append(f"restore {step}: {type(e).__name__}: {str(e)[:300]}")
    report = {
        "committed": committed,
        "errors": errors,
        "save_s": times,
        "restored": restored,
        "restore_s": restore_s,
        "wrong": wrong,
        "corrupt": corrupt,
    }
    print("RESULT " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main()

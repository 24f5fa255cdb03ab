"""The local tier against the persistent one, on the same state (issue 19's benchmark).

A state of `--mib` MiB of float32 (256 by default: 16 leaves of 16 MiB and 256 of 64 KiB,
every leaf sharded on a (4, 2) mesh of 8 CPU devices), in one process. Each round, on new
arrays (a jax.Array caches its host copy once read):

* persistent on local disk, and on the GCS emulator (gs://, on 127.0.0.1): `save` blocking,
  until committed (`wait()`), and a restore in a new manager (checksums verified);
* local on a RAM disk (/dev/shm): `save` blocking, until written (`wait()`), and a restore
  in a new manager (`Restored.tier == "local"`, checksums verified);
* a local save while a persistent one to gs:// is in flight: its blocking time, and how long
  until it is written, with the persistent step still uncommitted at that moment (it never
  waits behind it).

Medians of `--repeat` rounds, contenders alternating, `os.sync()` before each timed save.
Writes `benchmarks/results/local_tier.md`.

    python benchmarks/local_tier.py [--repeat 5] [--mib 256]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
from reliability import gcs

os.environ.update(gcs.LOOPBACK_ENV)

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from benchmarks.tables import write_page

ROOT = Path(__file__).resolve().parent.parent
SHM = Path("/dev/shm") if Path("/dev/shm").is_dir() else None


def make_state(mib: int, mesh) -> dict:
    sharding = NamedSharding(mesh, P("data", "model"))
    big = mib * 2**20 * 15 // 16 // 16 // 4  # 16 big leaves: 15/16 of the bytes
    small = 64 * 2**10 // 4  # 64 KiB leaves: the rest
    state = {f"big_{i:02d}": np.full((big // 256, 256), i, np.float32) for i in range(16)}
    count = mib * 2**20 // 16 // (small * 4)
    state |= {f"small_{i:03d}": np.full((small // 64, 64), i, np.float32) for i in range(count)}
    return {k: jax.device_put(v, sharding) for k, v in state.items()}


def fresh(state: dict) -> dict:
    return jax.block_until_ready(jax.tree.map(lambda a: a + 0, state))


def target(state: dict) -> dict:
    return {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) for k, v in state.items()
    }


def timed_save(mngr, step: int, state: dict) -> tuple[float, float]:
    os.sync()
    start = time.perf_counter()
    mngr.save(step, state=state)
    blocked = time.perf_counter() - start
    mngr.wait()
    return blocked, time.perf_counter() - start


def timed_restore(mngr, state: dict, tier: str) -> float:
    start = time.perf_counter()
    restored = mngr.restore(state=target(state))
    jax.block_until_ready(restored.state)
    elapsed = time.perf_counter() - start
    assert restored.tier == tier, restored.tier
    return elapsed


def persistent_round(directory: str, state: dict) -> dict:
    with jaxckpt.CheckpointManager(directory) as m:
        block, save = timed_save(m, 1, fresh(state))
    with jaxckpt.CheckpointManager(directory, read_only=True) as m:
        restore = timed_restore(m, state, "persistent")
    return {"block": block, "save": save, "restore": restore}


def local_round(base: Path, state: dict) -> dict:
    tier = jaxckpt.LocalTier(base / "local", every_steps=1)
    never = jaxckpt.SavePolicy(every_steps=10**9)  # step 1: the local tier alone
    with jaxckpt.CheckpointManager(base / "persistent", policy=never, local=tier) as m:
        assert m.should_save(1)
        block, save = timed_save(m, 1, fresh(state))
        assert m.all_steps() == [] and m.latest_step() == 1
    with jaxckpt.CheckpointManager(base / "persistent", policy=never, local=tier) as m:
        restore = timed_restore(m, state, "local")
    return {"block": block, "save": save, "restore": restore}


def behind_round(bucket: str, base: Path, state: dict) -> dict:
    """A local save (step 3) right after a persistent one to gs:// (step 2) started."""
    tier = jaxckpt.LocalTier(base / "local", every_steps=1)
    every_2 = jaxckpt.SavePolicy(every_steps=2)
    with jaxckpt.CheckpointManager(bucket, policy=every_2, local=tier) as m:
        assert m.should_save(2)
        m.save(2, state=fresh(state))
        assert m.should_save(3)
        second = fresh(state)
        start = time.perf_counter()
        m.save(3, state=second)
        blocked = time.perf_counter() - start
        while not (base / "local" / "3").exists():
            time.sleep(0.002)
        written = time.perf_counter() - start
        uncommitted = m.all_steps() == []
        m.wait()
        committed = time.perf_counter() - start
    return {"block": blocked, "save": written, "persistent": committed, "ahead": uncommitted}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/local_tier.md")
    args = parser.parse_args()
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    state = make_state(args.mib, mesh)
    times: dict[str, list[dict]] = {k: [] for k in ("disk", "gcs", "local", "behind")}
    with tempfile.TemporaryDirectory(prefix="jaxckpt-gcs-") as log_dir:
        server, url = gcs.start(Path(log_dir) / "server.log")
        os.environ.update(gcs.point_at(url))
        try:
            for r in range(args.repeat):
                base = Path(tempfile.mkdtemp(dir=os.environ.get("JAXCKPT_BENCH_DIR")))
                shm = Path(tempfile.mkdtemp(dir=SHM))
                bucket = f"gs://{gcs.BUCKET}/bench-{uuid.uuid4().hex[:8]}"
                try:
                    times["disk"].append(persistent_round(str(base / "disk"), state))
                    times["gcs"].append(persistent_round(f"{bucket}/p", state))
                    times["local"].append(local_round(shm / "a", state))
                    times["behind"].append(behind_round(f"{bucket}/b", shm / "b", state))
                finally:
                    shutil.rmtree(base, ignore_errors=True)
                    shutil.rmtree(shm, ignore_errors=True)
                print(r, {k: v[-1] for k, v in times.items()}, flush=True)
        finally:
            gcs.stop(server)

    def med(kind: str, what: str) -> float:
        return statistics.median(t[what] for t in times[kind])

    rows = [
        [
            "persistent, local disk",
            *(f"{med('disk', w):.3f}" for w in ("block", "save", "restore")),
        ],
        [
            "persistent, gs:// (emulator)",
            *(f"{med('gcs', w):.3f}" for w in ("block", "save", "restore")),
        ],
        [
            "local, RAM disk (/dev/shm)",
            *(f"{med('local', w):.3f}" for w in ("block", "save", "restore")),
        ],
        [
            "local, while a persistent save to gs:// is in flight",
            f"{med('behind', 'block'):.3f}",
            f"{med('behind', 'save'):.3f}",
            "-",
        ],
    ]
    ahead = sum(t["ahead"] for t in times["behind"])
    write_page(
        args.out,
        "The local tier against the persistent one",
        f"`python benchmarks/local_tier.py --repeat {args.repeat} --mib {args.mib}`: "
        f"{args.mib} MiB of float32 (16 leaves of {args.mib * 15 // 256} MiB and the rest in "
        "64 KiB leaves) sharded on a (4, 2) mesh of 8 CPU devices, one process. Seconds, "
        f"medians of {args.repeat} alternating rounds on new arrays; restores in a new manager, "
        "checksums verified. The last row: a local save started right after a persistent save "
        "to gs:// (same state); it was written before that persistent step committed in "
        f"{ahead} of {args.repeat} rounds (the persistent step then took "
        f"{med('behind', 'persistent'):.3f} s from the local save's start).",
        ["tier", "save blocking", "until written / committed", "restore"],
        rows,
    )


if __name__ == "__main__":
    main()

"""The same state saved to and restored from local disk, gs:// and s3://, in one run.

A state of `--mib` MiB of float32 (64 by default: 16 leaves of 1/16 of it, less 256 leaves of
16 KiB, which jaxckpt packs), every leaf sharded on a (4, 2) mesh of 8 CPU devices, one
process. The object stores are real servers on 127.0.0.1: fake-gcs-server (Go, in memory) for
gs:// and moto's S3 server (Python, in memory) for s3://; their speed is the servers', not
GCS's or S3's, so the times compare jaxckpt's work on each store, and the request counts are
what a real store would bill. Each round, contenders alternating, on new arrays:

* a save of one step into a new directory: `save` blocking, until committed (`wait()`), and
  the requests the server logged meanwhile, by kind;
* a restore in a new read-only manager (opening it included: what a restarted job pays),
  checked bitwise, and its requests.

Medians of `--repeat` rounds, ranges (min-max) beside them. Writes
`benchmarks/results/object_stores.md`.

    python benchmarks/object_stores.py [--repeat 5] [--mib 64]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
from reliability import gcs, s3

os.environ.update(gcs.LOOPBACK_ENV)
os.environ.update(s3.LOOPBACK_ENV)

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from benchmarks.tables import write_page

ROOT = Path(__file__).resolve().parent.parent
KINDS = gcs.REQUEST_KINDS  # (s3's are the same)


def make_state(mib: int, mesh) -> dict:
    sharding = NamedSharding(mesh, P("data", "model"))
    small = 16 * 2**10 // 4  # 256 leaves of 16 KiB: packed
    big = (mib * 2**20 - 256 * small * 4) // 16 // 4
    state = {f"big_{i:02d}": np.full((big // 256, 256), i, np.float32) for i in range(16)}
    state |= {f"small_{i:03d}": np.full((small // 64, 64), i, np.float32) for i in range(256)}
    return {k: jax.device_put(v, sharding) for k, v in state.items()}


def fresh(state: dict) -> dict:
    return jax.block_until_ready(jax.tree.map(lambda a: a + 0, state))


@contextlib.contextmanager
def servers(log_dir: Path) -> Iterator[dict]:
    """Both servers, the environment pointed at them; yields {store: (bucket URL, requests
    since a log offset, the log's size now)}."""
    g, g_url = gcs.start(log_dir / "gcs.log", log_level="info")
    try:
        m, m_url = s3.start(log_dir / "s3.log")
        try:
            os.environ.update(gcs.point_at(g_url) | s3.point_at(m_url))
            yield {
                "gs://": (f"gs://{gcs.BUCKET}", log_dir / "gcs.log", gcs.requests),
                "s3://": (f"s3://{s3.BUCKET}", log_dir / "s3.log", s3.requests),
            }
        finally:
            s3.stop(m)
    finally:
        gcs.stop(g)


def one_round(directory: str, state: dict, log: Path | None, parse) -> dict:
    def mark() -> int:
        return log.stat().st_size if log else 0

    def counted(since: int) -> Counter:
        return Counter(kind for kind, _ in parse(log, since)) if log else Counter()

    with jaxckpt.CheckpointManager(directory) as m:
        arrays = fresh(state)
        since = mark()
        start = time.perf_counter()
        m.save(1, state=arrays)
        blocked = time.perf_counter() - start
        m.wait()
        saved = time.perf_counter() - start
        save_requests = counted(since)
    target = {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) for k, v in state.items()
    }
    since = mark()
    start = time.perf_counter()
    with jaxckpt.CheckpointManager(directory, read_only=True) as m:
        restored = jax.block_until_ready(m.restore(state=target).state)
    restore = time.perf_counter() - start
    restore_requests = counted(since)
    for k, v in state.items():
        assert np.asarray(restored[k]).tobytes() == np.asarray(v).tobytes(), k
    return {
        "block": blocked,
        "save": saved,
        "restore": restore,
        "save_requests": save_requests,
        "restore_requests": restore_requests,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/object_stores.md")
    args = parser.parse_args()
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    state = make_state(args.mib, mesh)
    stores = ("local disk", "gs://", "s3://")
    times: dict[str, list[dict]] = {k: [] for k in stores}
    with (
        tempfile.TemporaryDirectory(prefix="jaxckpt-stores-") as log_dir,
        servers(Path(log_dir)) as buckets,
    ):
        for r in range(args.repeat):
            base = Path(tempfile.mkdtemp(dir=os.environ.get("JAXCKPT_BENCH_DIR")))
            try:
                for store in stores[r % 3 :] + stores[: r % 3]:  # each goes first in turn
                    if store == "local disk":
                        got = one_round(str(base / "ckpt"), state, None, None)
                    else:
                        url, log, parse = buckets[store]
                        got = one_round(f"{url}/bench-{uuid.uuid4().hex[:8]}", state, log, parse)
                    times[store].append(got)
            finally:
                shutil.rmtree(base, ignore_errors=True)
            print(
                r,
                {
                    k: {w: round(v[-1][w], 3) for w in ("block", "save", "restore")}
                    for k, v in times.items()
                },
                flush=True,
            )

    def cell(store: str, what: str) -> str:
        values = [t[what] for t in times[store]]
        return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"

    def requests(store: str, what: str) -> str:
        if store == "local disk":
            return "-"
        counts = [t[what] for t in times[store]]
        total = statistics.median(sum(c.values()) for c in counts)
        kinds = ", ".join(
            f"{k} {statistics.median(c[k] for c in counts):g}"
            for k in KINDS
            if any(c[k] for c in counts)
        )
        return f"{total:g} ({kinds})"

    rows = [
        [
            s,
            *(cell(s, w) for w in ("block", "save", "restore")),
            requests(s, "save_requests"),
            requests(s, "restore_requests"),
        ]
        for s in stores
    ]
    write_page(
        args.out,
        "Local disk, gs:// and s3://, the same state",
        f"`python benchmarks/object_stores.py --repeat {args.repeat} --mib {args.mib}`: "
        f"{args.mib} MiB of float32 (16 big leaves and 256 of 16 KiB, packed) sharded on a "
        "(4, 2) mesh of 8 CPU devices, one process, saved as one step into a new directory "
        "and restored by a new read-only manager (its opening included), bitwise checked. "
        f"Seconds, medians of {args.repeat} rounds (range), the stores alternating. gs:// is "
        "fake-gcs-server and s3:// moto's S3 server, both in memory on 127.0.0.1: their times "
        "are the servers' own (moto is Python), so compare the stores by their requests, "
        "which a real store would bill: whole step, by kind, medians.",
        [
            "store",
            "save blocking",
            "until committed",
            "restore",
            "save requests",
            "restore requests",
        ],
        rows,
    )


if __name__ == "__main__":
    main()

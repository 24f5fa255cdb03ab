"""One process of `scale.py`'s job (`measure`, run by `tests/multihost.run_job` in each
process of the job): saves and restores one state, counting its own work.

`job.args`: {"contender": "jaxckpt" | "orbax" | "local", "layout": "replicated" | "fsdp" |
"mixed", "mib": ..., "directory": ..., "store": "gs" | "s3" and "requests_log": its server's
log when `directory` is in a bucket, "local_root": the local tier's folders ("local": jaxckpt with a `LocalTier` saving
every step, one copy of each part on the next process)}; the layouts and the I/O counters
are tests/children/spread.py's (the spread tests' own).

Each phase (a save + wait in a new manager; a restore in a new manager onto the same mesh;
for "local", a second restore after process 0 lost its local folder) is met by every
process between two barriers of the harness, and reports this process's bytes read and
written and its read and write calls (`/proc/self/io`) around the save + wait or the
restore; its collectives and coordination-service calls (`_internals.count_collectives`)
from the manager's making to its close; on gs://, the job's requests to the store by kind
(process 0: the emulator's log between the barriers); for "local", the bytes of this
process's own local part and of the copy it keeps of a peer's. Whether each restore is
bitwise what was saved, and which tier it came from.
"""

from __future__ import annotations

import shutil
import time
from collections import Counter
from pathlib import Path
from typing import Any

from reliability import gcs, s3

DEVICES = 2  # CPU devices per process


def _tree_bytes(root: Path) -> int:
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file()) if root.exists() else 0


def measure(job: Any) -> dict:
    spec = job.args
    import jax
    import numpy as np
    from children.spread import io_counts, layout
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding

    from jaxckpt import _internals

    def counted(fn):
        before = io_counts()
        start = time.perf_counter()
        fn()
        took = time.perf_counter() - start
        after = io_counts()
        return {k: after[k] - before[k] for k in before} | {"seconds": took}

    log = Path(spec["requests_log"]) if spec.get("requests_log") else None
    parse = {"gs": gcs.requests, "s3": s3.requests}.get(spec.get("store", ""))

    def phase(name, run):
        """`run()` (-> its counts) met by every process between two barriers."""
        multihost_utils.sync_global_devices(f"scale:{name}:start")
        since = log.stat().st_size if log else 0
        with _internals.count_collectives() as calls:
            counts = run()
        multihost_utils.sync_global_devices(f"scale:{name}:end")
        counts["calls"] = dict(calls)
        if log and parse and job.process_id == 0:
            counts["requests"] = dict(Counter(k for k, _ in parse(log, since)))
        return counts

    sharding = NamedSharding(*layout(job.num_processes, spec["layout"]))
    # 3/4 of the bytes in 8 MiB leaves (Orbax arrays), 1/4 in 1 MiB ones (packed):
    # incompressible, the same on every process.
    mib = spec["mib"]
    shapes = [(2048, 1024)] * (mib * 3 // 4 // 8) + [(256, 1024)] * (mib // 4)
    hosts = {
        f"w{i:03d}": np.random.default_rng(i).standard_normal(s, np.float32)
        for i, s in enumerate(shapes)
    }
    state = {
        k: jax.make_array_from_callback(v.shape, sharding, v.__getitem__) for k, v in hosts.items()
    }
    abstract = {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding) for k, v in state.items()
    }
    directory = spec["directory"]
    contender = spec["contender"]

    def bitwise(out: dict) -> bool:
        return set(out) == set(hosts) and all(
            np.array_equal(np.asarray(shard.data), hosts[k][shard.index])
            for k, v in out.items()
            for shard in v.addressable_shards
        )

    report: dict[str, Any] = {"state_bytes": sum(v.nbytes for v in hosts.values())}
    if contender == "orbax":
        import orbax.checkpoint as ocp

        def save():
            with ocp.CheckpointManager(directory) as writer:
                return counted(
                    lambda: (
                        writer.save(1, args=ocp.args.StandardSave(state)),
                        writer.wait_until_finished(),
                    )
                )

        def restore():
            out = {}
            with ocp.CheckpointManager(directory) as reader:
                counts = counted(
                    lambda: out.update(reader.restore(1, args=ocp.args.StandardRestore(abstract)))
                )
            return counts | {"bitwise": bitwise(out), "tier": "persistent"}

        report["save"] = phase("save", save)
        report["restore"] = phase("restore", restore)
        return report

    import jaxckpt

    local_dir = None
    options: dict[str, Any] = {}
    if contender == "local":
        local_dir = Path(spec["local_root"]) / f"p{job.process_id}"
        options = {
            "policy": jaxckpt.SavePolicy(every_steps=1000),  # step 1: the local tier alone
            "local": jaxckpt.LocalTier(
                local_dir, every_steps=1, replicas=min(1, job.num_processes - 1)
            ),
        }

    def save():
        with jaxckpt.CheckpointManager(directory, **options) as writer:
            return counted(lambda: (writer.save(1, state=state), writer.wait()))

    def restore():
        got = []
        with jaxckpt.CheckpointManager(directory, **options) as reader:
            counts = counted(lambda: got.append(reader.restore(state=abstract)))
        return counts | {"bitwise": bitwise(got[0].state), "tier": got[0].tier}

    report["save"] = phase("save", save)
    report["restore"] = phase("restore", restore)
    if local_dir is not None:
        report["own_part"] = _tree_bytes(local_dir) - _tree_bytes(local_dir / "replicas")
        report["copy_kept"] = _tree_bytes(local_dir / "replicas")
        if job.num_processes > 1:
            if job.process_id == 0:
                shutil.rmtree(local_dir)  # a host replaced: its part comes from a peer
            report["restore_lost"] = phase("restore_lost", restore)
    return report

"""What retention's delete costs the save that triggers it on gs:// (a GCS emulator on
127.0.0.1): a "rename" of the step folder out of the listing (what local disk does; on
object storage a copy of every object, then a delete) against one tombstone object.

    python benchmarks/gcs_delete.py [--steps 3] [--mib 256]
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from reliability import gcs

os.environ.update(gcs.LOOPBACK_ENV)  # before gcsfs or google-auth is imported


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="deletes timed per way")
    parser.add_argument("--mib", type=int, default=256, help="size of each step")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as log_dir:
        server, url = gcs.start(Path(log_dir) / "server.log")
        os.environ.update(gcs.point_at(url))
        try:
            return run(args.steps, args.mib)
        finally:
            gcs.stop(server)


def run(steps: int, mib: int) -> int:
    import jax

    jax.config.update("jax_platforms", "cpu")
    import numpy as np
    from etils import epath

    import jaxckpt

    logging.getLogger("gcsfs").setLevel(logging.CRITICAL)  # the emulator lacks moveTo
    directory = f"gs://{gcs.BUCKET}/delete-bench"
    leaves = mib // 4
    state = {f"w{i}": np.random.rand(1 << 20).astype(np.float32) for i in range(leaves)}
    with jaxckpt.CheckpointManager(directory) as m:
        for step in range(1, 2 * steps + 1):
            m.save(step, state=state)
    root = epath.Path(directory)
    renamed, tombstoned = [], []
    for step in range(1, steps + 1):
        t0 = time.perf_counter()
        (root / str(step)).rename(root / f"{step}.jaxckpt-deleting")
        renamed.append(time.perf_counter() - t0)
    for step in range(steps + 1, 2 * steps + 1):
        t0 = time.perf_counter()
        (root / f"{step}.jaxckpt-tombstone").write_bytes(b"")
        tombstoned.append(time.perf_counter() - t0)
    print(
        f"{mib} MiB step on the GCS emulator, median of {steps}: rename (copy + delete) "
        f"{statistics.median(renamed) * 1e3:.0f} ms; tombstone "
        f"{statistics.median(tombstoned) * 1e3:.1f} ms"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

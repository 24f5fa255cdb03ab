"""Host memory and bytes read when restoring a ~1 GiB state onto another mesh.

Saves 1 GiB of float32 (16 leaves of 64 MiB) from a (4, 2) mesh of 8 CPU devices, then, each
in a fresh process, restores it onto a (2, 4) mesh: in 1 process with 8 devices, and in 2
processes x 4 devices (real jax.distributed on 127.0.0.1). Every restoring process reports:

* peak RSS above its baseline (taken just before `restore`), from `getrusage` ru_maxrss;
* bytes of chunk data it decoded, from tensorstore's own metric (reads are mmap-based, so
  the kernel's per-process I/O counters do not see them);
* what `CheckpointManager.plan` predicted for it before reading.

Restores verify the step's checksums first (the default); one row shows the cost of that.

    python benchmarks/restore_memory.py [--repeat 3] [--out benchmarks/results/restore_memory.md]

Targets (issue 3): peak <= 1.3x the state size in 1 process; each of 2 processes reads about
half the bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.tables import write_page
from reliability import launch

LEAVES, SHAPE = 16, (4096, 4096)  # 16 x 64 MiB of float32 = 1 GiB
STATE_BYTES = LEAVES * SHAPE[0] * SHAPE[1] * 4


def run(
    mode: str,
    directory: Path,
    processes: int,
    devices: int,
    verify: bool = True,
    inflight: int | None = None,
) -> list[dict]:
    port = launch.free_port()
    procs = [
        launch.start(
            "-m",
            "benchmarks.restore_memory_worker",
            mode,
            directory,
            processes,
            i,
            devices,
            port,
            LEAVES,
            *SHAPE,
            int(verify),
            "auto" if inflight is None else inflight,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(processes)
    ]
    reports = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=600)
            lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
            if p.returncode != 0 or not lines:
                raise SystemExit(f"{mode} worker failed ({p.returncode}):\n{err[-3000:]}")
            reports.append(json.loads(lines[-1][7:]))
    finally:
        for p in procs:
            p.kill()
    return reports


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "restore_memory.md"
    )
    args = parser.parse_args()

    directory = Path(tempfile.mkdtemp(prefix="jaxckpt-bench-"))
    try:
        run("save", directory, processes=1, devices=8)
        rows = []
        for processes, devices, verify, inflight in [
            (1, 8, True, None),
            (1, 8, True, 128 * 2**20),
            (1, 8, False, 128 * 2**20),
            (2, 4, True, 128 * 2**20),
        ]:
            runs = [
                run("restore", directory, processes, devices, verify, inflight)
                for _ in range(args.repeat)
            ]
            for p in range(processes):

                def median(key, p=p, runs=runs):
                    return statistics.median(r[p][key] for r in runs)

                rows.append(
                    {
                        "layout": f"{processes} process(es) x {devices} devices, "
                        + (
                            "restore_inflight_bytes=None (a quarter of host memory)"
                            if inflight is None
                            else f"restore_inflight_bytes={inflight // 2**20} MiB"
                        )
                        + ("" if verify else ", verify_on_restore=False"),
                        "process": p,
                        "peak_ratio": median("peak_above") / STATE_BYTES,
                        "read_ratio": median("decoded") / STATE_BYTES,
                        "plan_read_ratio": median("plan_read") / STATE_BYTES,
                        "plan_peak_ratio": median("plan_peak") / STATE_BYTES,
                        "seconds": median("seconds"),
                        "spread_peak": (
                            min(r[p]["peak_above"] for r in runs) / STATE_BYTES,
                            max(r[p]["peak_above"] for r in runs) / STATE_BYTES,
                        ),
                    }
                )
    finally:
        shutil.rmtree(directory, ignore_errors=True)

    about = (
        f"Medians of {args.repeat} runs, each restore in a fresh process; ratios are to the state size "
        f"({STATE_BYTES / 2**30:.2f} GiB). `python benchmarks/restore_memory.py`. Machine: "
        f"{os.cpu_count()} CPUs, CPU devices (their memory is host memory)."
    )
    header = [
        "layout",
        "process",
        "peak RSS above baseline",
        "(min-max)",
        "bytes read",
        "plan: read",
        "plan: peak",
        "restore time",
    ]
    cells = [
        [
            r["layout"],
            str(r["process"]),
            f"{r['peak_ratio']:.2f}x",
            f"{r['spread_peak'][0]:.2f}-{r['spread_peak'][1]:.2f}x",
            f"{r['read_ratio']:.2f}x",
            f"{r['plan_read_ratio']:.2f}x",
            f"{r['plan_peak_ratio']:.2f}x",
            f"{r['seconds']:.2f} s",
        ]
        for r in rows
    ]
    heading = "Restore memory: 1 GiB state from a (4, 2) mesh onto a (2, 4) mesh"
    write_page(args.out, heading, about, header, cells)
    return 0


if __name__ == "__main__":
    sys.exit(main())

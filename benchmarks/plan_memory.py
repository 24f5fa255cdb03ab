"""`plan`'s peak-host-memory bound against a measured restore, full and partial.

Saves a ~256 MiB state (`params`: 4 leaves of 32 MiB; `opt`: 4 more) from a (4, 2) mesh of 8
CPU devices, then, each in a fresh process, restores it onto a (2, 4) mesh: all of it, or
`params` only (`partial=True`), with the default read budget (128 MiB) and with a 32 MiB
one. Every restoring process reports its peak RSS
above its baseline (taken just before `restore`, from `getrusage` ru_maxrss) and what
`CheckpointManager.plan` predicted before reading.

    python benchmarks/plan_memory.py [--repeat 3] [--out benchmarks/results/plan_memory.md]

Target (issue 52): the bound at or above every measured peak (the restored arrays, 1.25x
the largest batch and 32 MiB), and not far above it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.tables import write_page
from reliability import launch

REPO = Path(__file__).resolve().parent.parent

SHAPE = (2048, 4096)  # 32 MiB of float32 a leaf; --leaves 4 per group, two groups: 256 MiB


def run(mode: str, directory: Path, leaves: int, partial=False, inflight="auto") -> dict:
    worker = "benchmarks.plan_memory_worker"
    args = (mode, directory, int(partial), inflight, leaves, *SHAPE)
    return launch.report("-m", worker, *args, timeout=600)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--leaves", type=int, default=4, help="32 MiB leaves per group")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/results/plan_memory.md")
    parser.add_argument(
        "--inflight", nargs="+", default=["auto", str(32 * 2**20)], help="read budgets"
    )
    args = parser.parse_args()

    directory = Path(tempfile.mkdtemp(prefix="jaxckpt-plan-"))
    rows = []
    try:
        run("save", directory, args.leaves)
        for partial in (False, True):
            for inflight in args.inflight:
                runs = [
                    run("restore", directory, args.leaves, partial, inflight)
                    for _ in range(args.repeat)
                ]
                peak = statistics.median(r["peak_above"] for r in runs)
                rows.append(
                    {
                        "restore": "partial (params)" if partial else "full",
                        "budget": "auto" if inflight == "auto" else f"{int(inflight) >> 20} MiB",
                        "read": runs[0]["read"],
                        "peak": peak,
                        "spread": (
                            min(r["peak_above"] for r in runs),
                            max(r["peak_above"] for r in runs),
                        ),
                        "plan": runs[0]["plan_peak"],
                    }
                )
    finally:
        shutil.rmtree(directory, ignore_errors=True)

    mib = 2**20
    group = args.leaves * SHAPE[0] * SHAPE[1] * 4
    about = (
        f"A {2 * group / mib:.0f} MiB state (params + opt, {args.leaves} leaves of "
        f"{group // args.leaves // mib} MiB each) saved from (4, 2), restored onto (2, 4) on 8 "
        f"CPU devices (their memory is host memory), each restore in a fresh process; medians "
        f"of {args.repeat}. `python benchmarks/plan_memory.py --leaves {args.leaves}`. Machine: {os.cpu_count()} CPUs."
    )
    header = [
        "restore",
        "read budget",
        "bytes read",
        "peak RSS above baseline",
        "(min-max)",
        "plan's bound",
        "bound / measured",
    ]
    cells = [
        [
            r["restore"],
            r["budget"],
            f"{r['read'] / mib:.0f} MiB",
            f"{r['peak'] / mib:.0f} MiB ({r['peak'] / r['read']:.2f}x read)",
            f"{r['spread'][0] / mib:.0f}-{r['spread'][1] / mib:.0f} MiB",
            f"{r['plan'] / mib:.0f} MiB ({r['plan'] / r['read']:.2f}x read)",
            f"{r['plan'] / r['peak']:.2f}",
        ]
        for r in rows
    ]
    heading = "`plan`'s peak host memory bound against measured restores"
    write_page(args.out, heading, about, header, cells)
    return 0


if __name__ == "__main__":
    sys.exit(main())

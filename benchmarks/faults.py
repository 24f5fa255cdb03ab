"""Saves and restores through a store that sheds load, resets connections and is slow, as
a pod's store is every day: real moto (s3://) and fake-gcs-server (gs://) on 127.0.0.1
behind reliability.proxy's fault proxy, jaxckpt in real processes (a job of 1, and of 2 on
gloo) pointed at it.

* The fault run: `--saves` saves (each waited for, `keep_last=3`, incremental: each writes
  what changed) with 10% of requests answered 503 and 10% of connections reset, then every
  kept step restored (verified) by a new reader and compared bitwise. Counted per 100
  saves: commits, errors, steps called corrupt, and the faults the proxy injected (each
  one a request tried again). Target: 100 commits, 0 errors, 0 steps called corrupt.
* The outage run: the first 10 requests answered 503, as a store that is down for a while,
  then two saves: how long the outage lasted, and whether they commit.
* The throttled run: one save of `--mib` MiB of new bytes through the proxy paced to
  2 MB/s, `timeout_s=2` (far below the time the bytes take): the time until committed
  against the bytes over the bandwidth.

Writes `benchmarks/results/faults.md`.

    python benchmarks/faults.py [--saves 100] [--mib 8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.tables import table
from reliability import gcs, launch, s3
from reliability.proxy import FaultProxy, Faults

ROOT = Path(__file__).resolve().parent.parent
STORES = {"s3": s3, "gs": gcs}
RATE = 2_000_000  # bytes/s of the throttled run
OUTAGE = 10  # requests answered 503 in a row: the store down for a while


def run_job(processes: int, env: dict[str, str], args: dict) -> list[dict]:
    """The worker in `processes` processes (8 CPU devices in all); each one's report."""
    return launch.job(
        "benchmarks.faults_worker", processes=processes, args=args, timeout=3600, env=env
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--saves", type=int, default=100)
    parser.add_argument("--mib", type=float, default=8.0, help="the throttled save's new bytes")
    options = parser.parse_args()
    os.environ.update(gcs.LOOPBACK_ENV | s3.LOOPBACK_ENV)
    fault_rows, slow_rows, outage_rows = [], [], []
    with tempfile.TemporaryDirectory() as scratch:
        for name, module in STORES.items():
            proc, url = module.start(Path(scratch) / f"{name}.log")
            try:
                for processes in (1, 2):
                    with FaultProxy(url, Faults(busy=0.1, resets=0.1), seed=processes) as proxy:
                        env = module.point_at(proxy.url)
                        args = {
                            "dir": f"{name}://{module.BUCKET}/faults-{uuid.uuid4().hex}",
                            "saves": options.saves,
                            "keep_last": 3,
                            "timeout_s": 120,
                            "mib": 2.0,
                            "changing_all": False,
                        }
                        began = time.monotonic()
                        reports = run_job(processes, env, args)
                        took = time.monotonic() - began
                        counts = proxy.counts()
                    per = 100 / options.saves
                    first = reports[0]
                    errors = sum(len(r["errors"]) for r in reports)
                    fault_rows.append(
                        [
                            f"{name}://",
                            str(processes),
                            f"{first['committed'] * per:g}",
                            f"{errors * per:g}",
                            f"{sum(r['corrupt'] for r in reports)}",
                            f"{sum(r['wrong'] for r in reports)}",
                            f"{counts.get('busy', 0) * per:.0f}",
                            f"{counts.get('reset', 0) * per:.0f}",
                            f"{(counts.get('passed', 0) + counts.get('busy', 0) + counts.get('reset', 0)) * per:.0f}",
                            f"{statistics.median(first['save_s']):.2f}" if first["save_s"] else "-",
                            f"{took:.0f}",
                        ]
                    )
                    for r in reports:
                        for e in r["errors"][:3]:
                            print("ERROR", name, processes, e)
                with FaultProxy(url, seed=0) as proxy:
                    proxy.outage(OUTAGE)
                    env = module.point_at(proxy.url)
                    args = {
                        "dir": f"{name}://{module.BUCKET}/outage-{uuid.uuid4().hex}",
                        "saves": 2,
                        "timeout_s": 120,
                        "mib": 2.0,
                        "changing_all": False,
                    }
                    (report,) = run_job(1, env, args)
                    outage_rows.append(
                        [
                            f"{name}://",
                            str(proxy.counts().get("outage", 0)),
                            f"{proxy.outage_s():.1f} s",
                            f"{report['committed']} of 2",
                            str(len(report["errors"])),
                            f"{report['restored']} of {report['committed']}",
                        ]
                    )
                with FaultProxy(url, Faults(bytes_per_s=RATE), seed=0) as proxy:
                    env = module.point_at(proxy.url)
                    args = {
                        "dir": f"{name}://{module.BUCKET}/slow-{uuid.uuid4().hex}",
                        "saves": 1,
                        "timeout_s": 2,
                        "mib": options.mib,
                        "changing_all": True,
                    }
                    (report,) = run_job(1, env, args)
                    sent = proxy.counts().get("received", 0)
                floor = sent / RATE
                slow_rows.append(
                    [
                        f"{name}://",
                        f"{options.mib:g} MiB",
                        f"{sent / 1e6:.1f} MB",
                        f"{floor:.1f} s",
                        f"{report['save_s'][0]:.1f} s" if report["save_s"] else "failed",
                        f"{report['save_s'][0] / floor:.2f}x" if report["save_s"] else "-",
                        "yes" if report["committed"] == 1 and not report["errors"] else "no",
                    ]
                )
            finally:
                module.stop(proc)
    lines = [
        "# A store that sheds load, resets and is slow",
        "",
        f"`python benchmarks/faults.py --saves {options.saves} --mib {options.mib:g}`: real moto",
        "(s3://) and fake-gcs-server (gs://) on 127.0.0.1 behind `reliability/proxy.py`, jaxckpt",
        f"in a job of 1 and of 2 processes (8 CPU devices in all). {options.saves} saves a run,",
        "each waited for (`keep_last=3`, incremental: a 2 MiB leaf shared, a small one new at",
        "every step), with 10% of requests answered 503 (S3's SlowDown, GCS's backendError) and",
        "10% of connections reset; then every kept step restored (verified) by a new reader and",
        "compared bitwise. Counts per 100 saves; each 503 and reset is a request jaxckpt tried",
        "again; requests are those the proxy received, the restores' included.",
        "",
        *table(
            [
                "store",
                "processes",
                "commits",
                "errors",
                "steps called corrupt",
                "restored wrong",
                "503s",
                "resets",
                "requests",
                "median save until committed (s)",
                "run (s)",
            ],
            fault_rows,
        ),
        f"A store down for a while: the first {OUTAGE} requests of a run answered 503 (the",
        "manager's opening, the first save), how long that lasted (the proxy's first to last",
        "503), then two saves and their restores.",
        "",
        *table(
            ["store", "503s in a row", "the outage lasted", "committed", "errors", "restored"],
            outage_rows,
        ),
        f"One save of new bytes through the proxy paced to {RATE / 1e6:g} MB/s, `timeout_s=2`:",
        "the time until committed against the bytes the proxy received over that rate.",
        "",
        *table(
            [
                "store",
                "state",
                "bytes sent",
                "bytes / bandwidth",
                "until committed",
                "ratio",
                "committed",
            ],
            slow_rows,
        ),
    ]
    out = ROOT / "benchmarks" / "results" / "faults.md"
    out.write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()

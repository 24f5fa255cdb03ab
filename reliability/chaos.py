"""The stress script's trials of a pod's everyday faults (issue 64), each a real job:

* uneven processes: a job of 2 or 4 processes saving 20 steps under retention
  (`keep_last`, and `keep_every` with 4), each process's store seams (listing, the step
  check, opens, removals, the commit, the wait) delayed at random by up to `DELAY_S`, its
  own seeded sequence; then every kept step restored by a reader and compared bitwise
  (`children.agreements.saves_under_retention`, which tests/test_agreements.py runs too);
* a store shedding load: 20 saves on gs:// and on s3:// (real servers on 127.0.0.1) behind
  `reliability.proxy`, 10% of requests answered 503 and 10% of connections reset; every
  save must commit, every kept step restore bitwise, none be called corrupt
  (`children.flaky_store.saves_through_faults`, as tests/test_flaky_store.py).
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import uuid
from pathlib import Path

from reliability import gcs, launch, s3
from reliability.proxy import FaultProxy, Faults

DELAY_S = 0.2
SAVES = 20
JOB_S = 600  # a job that has not ended by then hangs


def run_job(function: str, processes: int, args: dict, env: dict | None = None) -> list[dict]:
    """`children.<module>.<function>` in a job of `processes` (8 CPU devices in all), as
    tests/multihost.py runs one; each process's report. AssertionError if one fails."""
    module, name = function.rsplit(".", 1)
    return launch.job(
        "children.job", module, name, processes=processes, args=args, timeout=JOB_S, env=env
    )


def uneven_trials(seed: int, trials: int) -> list[tuple[str, int, str]]:
    """Rows for the uneven-processes trials (2 and 4 processes in turn), seeded."""
    if not trials:
        return []
    failures = []
    for i in range(trials):
        processes = (2, 4)[i % 2]
        retention = {"keep_last": 2} | ({"keep_every": 5} if processes == 4 else {})
        with tempfile.TemporaryDirectory(prefix="jaxckpt-uneven-") as tmp:
            args = {"dir": tmp, "saves": SAVES, "seed": seed + i, "delay_s": DELAY_S, **retention}
            want = _kept(SAVES, **retention)
            try:
                reports = run_job("children.agreements.saves_under_retention", processes, args)
                for r in reports:
                    assert r["kept"] == want, f"kept {r['kept']}, expected {want}"
            except (AssertionError, subprocess.TimeoutExpired) as e:
                failures.append(f"seed {seed + i} ({processes} processes): {e}")
        print(f"uneven processes {i + 1}/{trials}: {len(failures)} failures", flush=True)
    fault = (
        f"2 and 4 processes in turn, each one's store seams (listing, step check, opens, "
        f"removals, commit, wait) delayed at random by up to {DELAY_S:g} s, {SAVES} saves "
        "under keep_last=2 (and keep_every=5 with 4)"
    )
    ok = (
        "every save committed; the kept steps are those the policy keeps, and each restores bitwise"
    )
    return [(fault, trials, _result(failures, ok))]


def flaky_trials(trials: int) -> list[tuple[str, int, str]]:
    """Rows for the store-shedding-load trials: `trials` runs of `SAVES` saves on each store."""
    rows = []
    for name, module in (("gs", gcs), ("s3", s3)):
        if not trials:
            continue
        failures, faults = [], 0
        with tempfile.TemporaryDirectory(prefix="jaxckpt-flaky-") as tmp:
            os.environ.update(module.LOOPBACK_ENV)  # (before a client is made: buckets')
            proc, url = module.start(Path(tmp) / "server.log")
            try:
                for i in range(trials):
                    with FaultProxy(url, Faults(busy=0.1, resets=0.1), seed=i) as proxy:
                        args = {
                            "dir": f"{name}://{module.BUCKET}/flaky-{uuid.uuid4().hex[:8]}",
                            "saves": SAVES,
                            "keep_last": 3,
                        }
                        try:  # (every other endpoint kept on loopback: LOOPBACK_ENV)
                            env = module.LOOPBACK_ENV | module.point_at(proxy.url)
                            (report,) = run_job(
                                "children.flaky_store.saves_through_faults", 1, args, env
                            )
                            wanted = list(range(SAVES - 2, SAVES + 1))
                            assert report["kept"] == wanted, report
                            bad = {
                                k: report[k] for k in ("errors", "wrong", "corrupt", "unverified")
                            }
                            assert not any(bad.values()), bad
                        except (AssertionError, subprocess.TimeoutExpired) as e:
                            failures.append(f"trial {i}: {str(e)[:400]}")
                        counts = proxy.counts()
                        faults += counts.get("busy", 0) + counts.get("reset", 0)
            finally:
                module.stop(proc)
        fault = (
            f"{name}:// behind a proxy answering 10% of requests 503 and resetting 10% of "
            f"connections: {SAVES} saves (keep_last=3), then every kept step restored"
        )
        ok = (
            f"every save committed, every kept step restored bitwise and verified, none called "
            f"corrupt; {faults} requests failed by the proxy, each tried again"
        )
        rows.append((fault, trials, _result(failures, ok)))
        print(f"{name}:// shedding load: {len(failures)} failures", flush=True)
    return rows


def _kept(saves: int, **retention: int) -> list[int]:
    from jaxckpt import RetentionPolicy

    steps = range(1, saves + 1)
    return sorted(set(steps) - set(RetentionPolicy(**retention).steps_to_delete(steps)))


def _result(failures: list[str], ok: str) -> str:
    return f"FAILED {len(failures)}: " + "; ".join(failures[:3]) if failures else ok

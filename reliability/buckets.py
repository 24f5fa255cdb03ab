"""The crash stress's trials on object storage (`python -m reliability.stress`), on gs://
(fake-gcs-server) and s3:// (moto's S3 server) alike, each a real server on 127.0.0.1:

* a writer SIGKILLed at a seeded moment of a save loop (`stress.kill_trial`);
* its lease stolen at a seeded moment: overwritten with no condition, as a job that ignores
  the protocol (or an `aws s3 cp` by hand) would. The writer must stop with a LockedError
  naming the thief, every visible step must stay whole, and the next writer takes over once
  the thief's lease runs out;
* each corruption of `faults.REMOTE_CORRUPTIONS` (a byte flipped, a file truncated or
  deleted, ...), named by verify and restore, with a fallback restore of the step before.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from etils import epath

from reliability import gcs, launch, s3, stress

SERVERS = {"gs": gcs, "s3": s3}
# The stolen lease's holder: a 2 s term, never renewed.
THIEF = {
    "host": "thief",
    "pid": 1,
    "since": "2026-01-01T00:00:00+00:00",
    "lease_s": 2,
    "id": "thief",
}


@contextlib.contextmanager
def bucket(store: str) -> Iterator[str]:
    """The store's server for the trials ("gs" or "s3"), with this process's environment
    (which the writers inherit) pointed at it; yields the bucket's URL."""
    server = SERVERS[store]
    os.environ.update(server.LOOPBACK_ENV)
    with tempfile.TemporaryDirectory(prefix=f"jaxckpt-{store}-") as log_dir:
        proc, url = server.start(Path(log_dir) / "server.log")
        os.environ.update(server.point_at(url))
        try:
            yield f"{store}://{server.BUCKET}"
        finally:
            server.stop(proc)


def stolen_lease_trial(seed: int, tally: stress.Tally, url: str) -> None:
    """One seeded theft of a saving writer's lease under the bucket `url` (module doc)."""
    from jaxckpt._layout import LOCK_FILE

    rng = random.Random(seed)
    directory = f"{url}/stolen-{seed}-{uuid.uuid4().hex[:8]}"
    with tempfile.TemporaryFile("w+") as err:
        procs = stress.start_writers(directory, 1, stderr=err)
        with stress.counted(tally, seed, procs):
            first = launch.readline(procs[0], timeout=stress.FIRST_SAVE_S).strip()
            assert first == "1", f"the writer started at step {first!r}"
            time.sleep(rng.uniform(0.0, 1.5))  # the theft's moment: seeded
            (epath.Path(directory) / LOCK_FILE).write_text(json.dumps(THIEF))
            procs[0].wait(timeout=120)  # it stops by itself
            err.seek(0)
            text = err.read()
            assert re.search(r"lost the writer lease .* to host thief pid 1", text), (
                f"the writer exited {procs[0].returncode} without naming the thief: {text[-1500:]}"
            )
            steps, leftover = stress.check(directory)
            tally.visible.append(len(steps))
            tally.leftovers += leftover


def corruptions(url: str) -> dict[str, str]:
    """`faults.REMOTE_CORRUPTIONS`, each on a fresh checkpoint under the bucket `url`."""
    from reliability.faults import REMOTE_CORRUPTIONS

    return {
        name: stress.corruption_trial(
            epath.Path(f"{url}/corrupt-{i}-{uuid.uuid4().hex[:8]}"), corrupt
        )
        for i, (name, corrupt) in enumerate(REMOTE_CORRUPTIONS.items())
    }


def trials(store: str, seed: int, kills: int, thefts: int) -> list[tuple[str, int, str]]:
    """The report's rows for one store: `kills` SIGKILLs, `thefts` stolen leases, and every
    corruption once."""
    killed, stolen = stress.Tally(), stress.Tally()
    name = {"gs": "gs:// (fake-gcs-server)", "s3": "s3:// (moto's S3 server)"}[store]
    with bucket(store) as url:
        for i in range(kills):
            stress.kill_trial(seed + i, 1, killed, bucket=url)
            print(f"{store} kill {i + 1}/{kills}: {len(killed.failures)} failures", flush=True)
        for i in range(thefts):
            stolen_lease_trial(seed + 500 + i, stolen, url)
            print(
                f"{store} stolen lease {i + 1}/{thefts}: {len(stolen.failures)} failures",
                flush=True,
            )
        damaged = corruptions(url)
    failed = [f"{k}: {v}" for k, v in damaged.items() if "FAILED" in v]
    after_theft = stress.kills_text(stolen)
    if not stolen.failures:
        after_theft = f"each writer stopped with LockedError naming the thief; {after_theft}"
    return [
        (
            f"SIGKILL of a writer saving to {name}, random moment",
            killed.trials,
            stress.kills_text(killed),
        ),
        (
            f"{name}: a saving writer's lease overwritten by another job, random moment",
            stolen.trials,
            after_theft,
        ),
        (
            f"{name}: " + ", ".join(damaged),
            len(damaged),
            "FAILED: " + "; ".join(failed)
            if failed
            else "each detected by verify and restore; fallback restored step 1",
        ),
    ]


if __name__ == "__main__":  # one store's rows, alone: python -m reliability.buckets s3
    import sys

    for row in trials(sys.argv[1], 0, int(sys.argv[2]), int(sys.argv[3])):
        print(row)

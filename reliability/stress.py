"""Crash and corruption stress: kill writers at random moments, damage steps, check recovery.

    python -m reliability.stress [--trials 30] [--multihost-trials 6] [--gcs-trials 10]
                                 [--s3-trials 10] [--lease-trials 4]
                                 [--hostile-trials 10] [--local-trials 10]
                                 [--stall-trials 6] [--incremental-trials 10]
                                 [--uneven-trials 4] [--flaky-trials 1] [--seed 0]

Writes RELIABILITY.md (the table below is regenerated from the run). Every trial is seeded:
the same seed gives the same kill moments. After every kill a *new* process-independent
check runs:

* every visible step verifies against its manifest and restores with exactly the bytes that
  were saved for it (values are a function of the step), meta included;
* `latest_step()` is restorable, or nothing was committed yet;
* a new writer starts, saves the next step, and no unfinished save is left: no
  `*.orbax-checkpoint-tmp` folder, and on object storage (gs:// and s3://, real servers on
  127.0.0.1, where Orbax commits with a marker instead of a rename) no step folder without
  `commit_success.txt`. There the new writer first waits out the killed writer's lease (2 s
  here). The object-storage trials (kills, stolen leases, corruptions) are
  `reliability.buckets`'.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from etils import epath

from reliability import launch

REPO = launch.REPO
N = 2 * 1024 * 1024  # 8 MiB of float32 per step: a save takes a noticeable while
FIRST_SAVE_S = 240  # a writer's start-up (jax, gloo, the lock) and first save, bounded


def expected(step: int) -> np.ndarray:
    return np.arange(N, dtype=np.float32) + step


@dataclass
class Tally:
    trials: int = 0
    failures: list[str] = field(default_factory=list)
    visible: list[int] = field(default_factory=list)  # committed steps seen after each kill
    leftovers: int = 0  # kills that left an unfinished save behind (cleaned afterwards)


def start_writers(
    directory: str, processes: int, stderr: Any = subprocess.DEVNULL
) -> list[subprocess.Popen]:
    """`processes` reliability.writer processes saving to `directory`, 8 devices in all."""
    port, devices = launch.free_port(), 8 // processes
    return [
        launch.start(
            "-m",
            "reliability.writer",
            directory,
            i,
            processes,
            devices,
            port,
            N,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
        for i in range(processes)
    ]


def unfinished(directory: epath.Path) -> list[str]:
    """Saves that never committed: Orbax's temporary folders (local disk) or, on object
    storage, step folders without Orbax's commit marker."""
    from jaxckpt._storage import is_remote

    names = [p.name for p in directory.iterdir()]
    tmp = [n for n in names if "orbax-checkpoint-tmp" in n]
    if is_remote(directory):
        tmp += [
            n for n in names if n.isdigit() and not (directory / n / "commit_success.txt").exists()
        ]
    return tmp


def check(directory: str | Path) -> tuple[list[int], bool]:
    """The recovery checks; raises AssertionError. Returns the visible steps and whether an
    unfinished save was left behind."""
    import jaxckpt

    directory = epath.Path(directory)
    leftover = bool(unfinished(directory))
    reports = jaxckpt.verify(directory)
    assert all(r.ok for r in reports), [r for r in reports if not r.ok]
    with jaxckpt.CheckpointManager(directory, timeout_s=60) as m:
        steps = m.all_steps()
        for step in steps:
            restored = m.restore(step, state={"x": np.zeros(N, np.float32)})
            assert np.array_equal(restored.state["x"], expected(step)), f"step {step}: wrong bytes"
            assert restored.meta == {"step": step}
        new = (steps[-1] if steps else 0) + 1
        m.save(new, state={"x": expected(new)}, meta={"step": new})
        m.wait()
        assert m.all_steps() == [*steps, new]
    tmp = unfinished(directory)
    assert not tmp, f"leftovers not cleaned: {tmp}"
    return steps, leftover


@contextlib.contextmanager
def counted(tally: Tally, seed: int, procs: list[subprocess.Popen]) -> Iterator[None]:
    """One trial: counted, its failure (an assertion or a timeout) noted, its children
    killed whatever happened."""
    try:
        yield
    except (AssertionError, TimeoutError, subprocess.TimeoutExpired) as e:
        tally.failures.append(f"seed {seed}: {e}")
    finally:
        for p in procs:
            p.kill()
        tally.trials += 1


def kill_after_first_save(procs: list[subprocess.Popen], victim: int, rng: random.Random) -> str:
    """SIGKILLs `procs[victim]` at a seeded moment after its first save returned, then waits
    for the others (they fail on the dead peer, or stop at their next collective) or ends
    them. Returns the first step the victim printed."""
    first, deadline = "", time.monotonic() + FIRST_SAVE_S
    while not first.isdigit():  # one save started and returned (skip gloo's chatter)
        remaining = max(0.0, deadline - time.monotonic())
        line = launch.readline(procs[victim], timeout=remaining)
        assert line, "the writer exited before its first save"
        first = line.strip()
    time.sleep(rng.uniform(0.0, 1.5))  # the kill moment: seeded, not a wait for a result
    procs[victim].send_signal(signal.SIGKILL)
    for p in procs:
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=30)
    return first


def kill_trial(seed: int, processes: int, tally: Tally, bucket: str | None = None) -> None:
    """One seeded kill, in a fresh local directory or under `bucket` (gs://...)."""
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory(prefix="jaxckpt-stress-") as tmp:
        directory = f"{bucket}/stress-{seed}-{uuid.uuid4().hex[:8]}" if bucket else tmp
        procs = start_writers(directory, processes)
        victim = rng.randrange(processes)
        with counted(tally, seed, procs):
            first = kill_after_first_save(procs, victim, rng)
            assert first == "1", f"the writer started at step {first}"
            steps, leftover = check(directory)
            tally.visible.append(len(steps))
            tally.leftovers += leftover


LOCAL_LOSSES = (
    "none",
    "the killed process's directory wiped",
    "the other's wiped",
    "both wiped",
    "a byte flipped in a part or copy",
)


def local_trial(seed: int, tally: Tally, losses: dict[str, int]) -> None:
    """One seeded kill of a 2-process job saving to a local tier (every step, a copy of each
    part on the other process) and a persistent one (every 5th), then a seeded loss; a new
    job must restore exactly the newest step still whole somewhere (`recoverable`)."""
    rng = random.Random(seed)
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None  # the local tier: a RAM disk
    with tempfile.TemporaryDirectory(prefix="jaxckpt-local-", dir=shm) as tmp:
        persistent, local = f"{tmp}/persistent", [f"{tmp}/local-{i}" for i in (0, 1)]
        procs = start_local_job(persistent, local, "write")
        victim = rng.randrange(2)
        with counted(tally, seed, procs):
            kill_after_first_save(procs, victim, rng)
            loss = rng.choice(LOCAL_LOSSES)
            losses[loss] = losses.get(loss, 0) + 1
            damage_local(rng, loss, victim, [Path(d) for d in local])
            want_step, want_tier = recoverable(Path(persistent), [Path(d) for d in local])
            checkers = start_local_job(persistent, local, "check", stderr=subprocess.PIPE)
            reports = []
            for c in checkers:
                out, err = c.communicate(timeout=FIRST_SAVE_S)
                lines = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
                assert c.returncode == 0 and len(lines) == 2, f"check failed: {err[-1500:]}"
                reports.append(lines)
            for got, after in reports:
                assert got["exact"], f"step {got['step']}: wrong bytes"
                assert (got["step"], got["tier"]) == (want_step, want_tier), (
                    f"{loss}: restored {got['step']} ({got['tier']}), expected {want_step} "
                    f"({want_tier})"
                )
                assert after["latest"] == after["persistent"][-1], after
            left = [p.name for d in local for p in Path(d).rglob("*jaxckpt-tmp")]
            assert not left, f"leftovers not cleaned: {left}"
            tally.visible.append(want_step or 0)


def start_local_job(persistent: str, local: list[str], mode: str, stderr: Any = subprocess.DEVNULL):
    port = launch.free_port()
    return [
        launch.start(
            "-m",
            "reliability.local_writer",
            persistent,
            local[i],
            i,
            2,
            4,
            port,
            N // 4,
            mode,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
        for i in (0, 1)
    ]


def damage_local(rng: random.Random, loss: str, victim: int, local: list[Path]) -> None:
    import shutil

    from reliability.faults import largest_data_file

    wiped = {
        "the killed process's directory wiped": [victim],
        "the other's wiped": [1 - victim],
        "both wiped": [0, 1],
    }.get(loss, [])
    for i in wiped:
        shutil.rmtree(local[i], ignore_errors=True)
    if loss == "a byte flipped in a part or copy":
        folders = [f for d in local for f in [*d.glob("[0-9]*"), *d.glob("replicas/*/[0-9]*")]]
        folders = sorted(f for f in folders if f.is_dir() and "jaxckpt" not in f.name)
        if folders:
            f = largest_data_file(rng.choice(folders))
            data = bytearray(f.read_bytes())
            data[rng.randrange(len(data))] ^= 0x01
            f.write_bytes(bytes(data))


def recoverable(persistent: Path, local: list[Path]) -> tuple[int | None, str | None]:
    """The harness's own oracle: the newest step of which each process's part is whole
    (its manifest verifies) in its own directory or as a copy in the other's, unless the
    persistent tier's newest committed step is newer."""
    from jaxckpt import _integrity

    def whole(folder: Path, step: int) -> bool:
        return folder.is_dir() and _integrity.verify_step(folder, step).ok

    steps = {int(f.name) for d in local if d.is_dir() for f in d.iterdir() if f.name.isdigit()}
    covered = [
        s
        for s in steps
        if all(
            whole(local[o] / str(s), s) or whole(local[1 - o] / "replicas" / str(o) / str(s), s)
            for o in (0, 1)
        )
    ]
    committed = [int(f.name) for f in persistent.iterdir() if f.name.isdigit()]
    best_local, best_persistent = max(covered, default=None), max(committed, default=None)
    if best_local is not None and (best_persistent is None or best_local >= best_persistent):
        return best_local, "local"
    return best_persistent, None if best_persistent is None else "persistent"


def kills_text(t: Tally) -> str:
    """A report's result cell for kill trials."""
    if not t.trials:
        return "not run"
    if t.failures:
        return f"FAILED {len(t.failures)}: " + "; ".join(t.failures[:3])
    return (
        f"all recovered; {t.leftovers} left an unfinished save (cleaned); committed steps "
        f"visible after the kill: {min(t.visible)}-{max(t.visible)}"
    )


def corruption_trials() -> dict[str, str]:
    """Each corruption on a fresh 2-step checkpoint: verify and restore must name it."""
    from reliability.faults import CORRUPTIONS

    results = {}
    for name, corrupt in CORRUPTIONS.items():
        with tempfile.TemporaryDirectory(prefix="jaxckpt-corrupt-") as tmp:
            results[name] = corruption_trial(Path(tmp), corrupt)
    return results


def corruption_trial(d: Any, corrupt: Any) -> str:
    """One corruption (`reliability.faults`) of step 2 of a fresh 2-step checkpoint in `d`
    (a local or an object-storage path): what verify, restore and a fallback restore made
    of it, "detected ..." when each named it."""
    import re

    import jaxckpt
    from jaxckpt import errors

    with jaxckpt.CheckpointManager(d) as m:
        for step in (1, 2):
            m.save(step, state={"x": expected(step)[:65536]}, meta={"step": step})
    pattern = corrupt(d)
    reports = {r.step: r for r in jaxckpt.verify(d)}
    by_verify = not reports[2].ok and any(re.search(pattern, p) for p in reports[2].problems)
    with jaxckpt.CheckpointManager(d, read_only=True) as m:
        try:
            m.restore(2)
            by_restore = False
        except errors.CorruptCheckpointError as e:
            by_restore = bool(re.search(pattern, str(e)))
        fallback = m.restore(fallback=True).step == 1
    if by_verify and by_restore and fallback:
        return "detected by verify and restore; fallback restored step 1"
    return f"FAILED (verify {by_verify}, restore {by_restore}, fallback {fallback})"


def hostile_trials(seed: int, trials: int) -> list[tuple[str, int, str]]:
    """Rows for the shared-directory faults of `reliability.hostile`, seeded."""
    from reliability import hostile

    def row(fault: str, results: list[str | None], ok: str) -> tuple[str, int, str]:
        failures = [r for r in results if r is not None]
        if failures:
            return fault, len(results), f"FAILED {len(failures)}: " + "; ".join(failures[:3])
        return fault, len(results), ok

    if not trials:
        return []
    rows = [
        row(
            "the lock file planted as a symlink to a file outside",
            [hostile.lock_symlink_trial()],
            "the writer is refused (LockedError); the link's target is untouched; readers see "
            "every step",
        ),
    ]
    deleted = []
    for i in range(trials):
        deleted.append(hostile.lock_deletion_trial(seed + 3000 + i))
        print(f"lock deleted {i + 1}/{trials}: {sum(r is not None for r in deleted)} failures")
    rows.append(
        row(
            "the lock file deleted under a writer saving in a loop (random moment), a second "
            "writer commits",
            deleted,
            "the first writer raises LockedError and commits nothing after its last lock "
            "check (a save it was finishing then is committed whole or not at all: the new "
            "writer sets unfinished saves aside before deleting them); every step verifies "
            "and restores",
        )
    )
    rows.append(
        row(
            "a save fails on a directory made immutable (chattr +i); the script dies of it",
            [hostile.exit_after_failed_save("immutable")],
            "SaveError, and the process exits within timeout_s (it used to live 300 s)",
        )
    )
    interrupted = []
    for i in range(trials):
        interrupted.append(hostile.exit_after_failed_save("interrupt", seed + 4000 + i))
        print(f"Ctrl-C {i + 1}/{trials}: {sum(r is not None for r in interrupted)} failures")
    rows.append(
        row(
            "Ctrl-C at a random moment of a save loop; the script dies of it",
            interrupted,
            "KeyboardInterrupt, and the process exits within timeout_s",
        )
    )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=30)
    parser.add_argument("--multihost-trials", type=int, default=6)
    parser.add_argument("--gcs-trials", type=int, default=10)
    parser.add_argument("--s3-trials", type=int, default=10)
    parser.add_argument("--lease-trials", type=int, default=4, help="per object store")
    parser.add_argument("--hostile-trials", type=int, default=10)
    parser.add_argument("--local-trials", type=int, default=10)
    parser.add_argument("--stall-trials", type=int, default=6, help="of processes; of stores")
    parser.add_argument("--incremental-trials", type=int, default=10)
    parser.add_argument("--uneven-trials", type=int, default=4)
    parser.add_argument("--flaky-trials", type=int, default=1, help="per object store")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=REPO / "RELIABILITY.md")
    args = parser.parse_args()

    single, multi = Tally(), Tally()
    for i in range(args.trials):
        kill_trial(args.seed + i, 1, single)
        print(
            f"single-process kill {i + 1}/{args.trials}: {len(single.failures)} failures",
            flush=True,
        )
    for i in range(args.multihost_trials):
        kill_trial(args.seed + 1000 + i, 2, multi)
        print(
            f"2-process kill {i + 1}/{args.multihost_trials}: {len(multi.failures)} failures",
            flush=True,
        )
    from reliability import buckets

    on_buckets = [
        row
        for store, kills, seed in (("gs", args.gcs_trials, 2000), ("s3", args.s3_trials, 3000))
        if kills
        for row in buckets.trials(store, args.seed + seed, kills, args.lease_trials)
    ]
    on_local, losses = Tally(), {}
    for i in range(args.local_trials):
        local_trial(args.seed + 5000 + i, on_local, losses)
        print(
            f"local-tier kill {i + 1}/{args.local_trials}: {len(on_local.failures)} failures",
            flush=True,
        )
    from reliability import stalls

    stall_rows = [
        *stalls.trials(args.seed + 6000, args.stall_trials),
        *stalls.store_trials(args.seed + 7000, args.stall_trials),
    ]
    from reliability import incremental

    incremental_rows = incremental.trials(args.seed + 8000, args.incremental_trials)
    from reliability import chaos

    chaos_rows = [
        *chaos.uneven_trials(args.seed + 9000, args.uneven_trials),
        *chaos.flaky_trials(args.flaky_trials),
    ]
    corruptions = corruption_trials()
    hostile_rows = hostile_trials(args.seed, args.hostile_trials)

    def local_kills(t: Tally) -> str:
        if not t.trials:
            return "not run"
        if t.failures:
            return f"FAILED {len(t.failures)}: " + "; ".join(t.failures[:3])
        return (
            "each restored exactly the newest step still whole in a part or copy (or the "
            "persistent step when newer), with the saved bytes; no leftover; restored steps "
            f"{min(t.visible)}-{max(t.visible)}"
        )

    rows = [
        ("SIGKILL of a writer saving in a loop, random moment", single.trials, kills_text(single)),
        ("SIGKILL of 1 of 2 multi-host writers, random moment", multi.trials, kills_text(multi)),
        *on_buckets,
        (
            "SIGKILL of 1 of 2 processes saving to a local tier (every step, copies on the "
            "other) and a persistent one, random moment, then a seeded loss ("
            + ", ".join(f"{k}: {v}" for k, v in sorted(losses.items()))
            + "); a new job restores",
            on_local.trials,
            local_kills(on_local),
        ),
        *stall_rows,
        *incremental_rows,
        *chaos_rows,
        *((f"corruption: {name}", 1, result) for name, result in corruptions.items()),
        *hostile_rows,
    ]
    text = (
        RELIABILITY_HEAD.format(
            trials=args.trials,
            multi=args.multihost_trials,
            gcs=args.gcs_trials,
            s3=args.s3_trials,
            lease=args.lease_trials,
            hostile=args.hostile_trials,
            local=args.local_trials,
            stall=args.stall_trials,
            incremental=args.incremental_trials,
            uneven=args.uneven_trials,
            flaky=args.flaky_trials,
            seed=args.seed,
        )
        + "\n".join(f"| {a} | {b} | {c} |" for a, b, c in rows)
        + "\n"
        + RELIABILITY_TAIL
    )
    args.out.write_text(text)
    print(text)
    return (
        1
        if single.failures
        or multi.failures
        or on_local.failures
        or any(
            "FAILED" in r for _, _, r in [*on_buckets, *stall_rows, *incremental_rows, *chaos_rows]
        )
        or any("FAILED" in r for r in corruptions.values())
        or any("FAILED" in r for _, _, r in hostile_rows)
        else 0
    )


RELIABILITY_HEAD = """# Reliability report

Regenerated by `python -m reliability.stress --trials {trials} --multihost-trials {multi} --gcs-trials {gcs} --s3-trials {s3} --lease-trials {lease} --hostile-trials {hostile} --local-trials {local} --stall-trials {stall} --incremental-trials {incremental} --uneven-trials {uneven} --flaky-trials {flaky} --seed {seed}`
(seeded: the same seed gives the same kill moments). The same faults run in the test suite in
smaller numbers (`tests/test_atomicity.py`, `tests/test_integrity.py`, `tests/test_async.py`,
`tests/test_multihost.py`, `tests/test_object_storage.py`, `tests/test_hostile.py`, `tests/test_lock.py`,
`tests/test_local_multihost.py`, `tests/test_local_copies.py`, `tests/test_layout.py`,
`tests/test_packed_hostile.py`, `tests/test_stalls.py`, `tests/test_incremental.py`,
`tests/test_agreements.py`, `tests/test_flaky_store.py`).

After every kill, a new process checks: every visible step verifies against its manifest and
restores with exactly the bytes saved for it; `latest_step()` restores; a new writer saves the
next step and no unfinished-save leftover remains. On object storage (gs:// and s3://, real
servers on 127.0.0.1) the new writer first waits out the killed writer's lease (2 s in these
trials) and takes it over.

| fault | trials | result |
| --- | --- | --- |
"""

RELIABILITY_TAIL = """
Also covered by tests (one run each, every `make test`):

| fault | result |
| --- | --- |
| write fails in the background (file size limit: EFBIG, like a full disk) | `SaveError` at the next `save`/`wait`/`close`, naming the step and cause; earlier steps intact and restorable; the manager keeps working |
| a process dies mid-save (2 processes), before confirming its part | the survivor's `SaveError.missing_processes == [1]` within `timeout_s` of its arrival at the commit's barrier; the step never commits |
| a process stopped (SIGSTOP, 2 processes) before its save, before its restore, or once its part is written | the other's `SaveError` or `ProcessesMissingError` names it within `timeout_s` of its arrival at the agreement (6 s + 4 s slack), once per save however many barriers follow; committed steps intact |
| two processes making different calls (one deleting a step while the other saves) | `ProcessesDisagreeError` on both at once, naming each one's agreement; nothing deleted or started |
| a save slower than `timeout_s` at the store's speed (1 MB/s, `timeout_s=1`); a restore where one process reads 3.2 s behind in all, 0.4 s at each agreement (`timeout_s=1.5`) | the save commits; the restore succeeds, bitwise |
| a process dies mid-save (2 processes), after every part was written and confirmed | the survivor's `SaveError` has `committed` true and says the step is whole; the step restores |
| Orbax's save fails in the foreground after the step's background commit started | the `SaveError` is worded once that commit is over: the step committed, and is whole |
| a second writer on the same directory | `LockedError` naming host and pid; readers (`read_only=True`) unaffected |
| a writer dies holding the lock | the next writer takes it over and logs whose it was |
| gs:// and s3://: a second writer; 8 writers racing for the lease; a frozen writer whose lease was taken over | `LockedError` naming the holder; exactly one of 8 wins; the frozen writer raises `LockedError` at its next save and its step never appears |
| gs:// and s3://: retention's deletes stalled | saves commit; the deleted steps are hidden by tombstones from every reader until their objects are gone |
| a process SIGSTOPped once a step's arrays are written, before its commit, then SIGKILLed | the step is not visible; the leftover is cleaned by the next writer |
| 23 hostile plants (links and FIFOs in a step, a linked step folder, stray `²`/`00002` folders, garbage, deep or newer-format jaxckpt.json, malformed manifest entries, a leaf the arrays lack, a lock that is a link, FIFO or hard link), each fed to 17 entry points (manager, verify, export, every CLI command) | only `JaxckptError`s (one-line CLI errors); nothing outside the directory read or written; step 1 intact |
| the lock file deleted during a save, before its commit | the commit is refused (`SaveError` from `LockedError`); the step never appears |
| the lock file deleted, and a new writer removing the old one's unfinished save | that save's `SaveError` names the lost lock (`LockedError`), not the missing file |
| the lock file deleted after a commit, before retention | nothing is deleted (`LockedError`); every step stays |
| another job's retention deletes the step being restored | `restore()` restores the new latest step; `restore(step)` raises `StepNotFoundError` saying it was deleted |
| a second SIGTERM while the main thread is blocked in `restore()` or `wait()` | the process dies of SIGTERM (the first one is only the preemption notice) |
| local tier, 2 and 4 processes: every process killed after a local step; one killed mid local save; a directory wiped, or moved to a new path; a file, or a file and its copy, corrupted; no copies kept; a restart on another process count | the newest step whole in a part or copy (a lost part fetched from its copy), else the persistent step; the continuation bitwise equal to an uninterrupted run's, data positions included |
| local tier's peer protocol: unsigned or wrongly signed requests, a captured put replayed, a put of an older step, links in the local directory, file paths out of the copy's folder, bytes changed on the way, malformed or oversized headers; a peer stopped (SIGSTOP) while copies go to it | refused, nothing rolled back, nothing read or written outside the local directory, and the listener keeps serving; saves never wait for the stopped peer, and `wait()` names it |
"""


if __name__ == "__main__":
    sys.exit(main())

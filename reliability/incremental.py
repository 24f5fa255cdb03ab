"""Incremental steps under faults (`reliability.stress`'s rows for them, issue 53).

* A writer saving in a loop with `incremental=True` and `keep_last=2` (each step an 8 MiB
  frozen leaf, the same array every step, and 8 MiB that change: every later step refers to
  the newest full save for the frozen bytes, which retention retires rather than deletes) is SIGKILLed
  at a seeded moment: mid-save, mid-commit or mid-retention. A new process then checks that
  every visible step verifies and restores exactly, that a new writer saves the next step,
  and that no step is kept that no kept step shares bytes with, nor any gone that one does.
  Every other trial's writer compresses (`compression="zstd"`), and so does its checker.
* A shared file damaged: a byte of the frozen bytes flipped in the step that holds them;
  verify names the file for that step and for the step that uses it, and a restore of
  either names it; and a writer restarted after it writes those bytes again (issue 65).
* A kept step's `shares.json` missing, emptied, swollen or nested deep: retention follows
  the step's index, and verify names the summary (issue 65).
* How far one damaged file reaches: 12 saves with `full_save_every=4` and `keep_last=5`,
  then, in a copy each, a byte of each step's own data file flipped: at most 4 steps fail
  to verify, and `fallback=True` restores a kept step bitwise (issue 65).
"""

from __future__ import annotations

import json
import random
import re
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from reliability import launch
from reliability.stress import N, Tally, counted, expected, kill_after_first_save, unfinished
from reliability.writer import frozen


def trials(seed: int, kills: int) -> list[tuple[str, int, str]]:
    """The rows: `kills` seeded kill trials, and the damaged shared file."""
    if not kills:
        return []
    tally = Tally()
    for i in range(kills):
        kill_trial(seed + i, tally)
        print(f"incremental kill {i + 1}/{kills}: {len(tally.failures)} failures", flush=True)
    if tally.failures:
        result = f"FAILED {len(tally.failures)}: " + "; ".join(tally.failures[:3])
    else:
        result = (
            "all recovered: every visible step verifies and restores its bytes, the steps "
            "they share bytes with are there, none kept that no step shares; a new writer "
            f"saves; committed steps visible: {min(tally.visible)}-{max(tally.visible)}"
        )
    return [
        (
            "SIGKILL of an incremental writer (keep_last=2, a frozen leaf shared with the "
            "first step; every other one zstd) saving in a loop, random moment: mid-save, "
            "mid-commit or mid-retention",
            tally.trials,
            result,
        ),
        ("corruption: a byte of a file an incremental step shares", 1, shared_file_trial()),
        (
            "a kept step's shares.json, summarising which steps it reads: "
            + ", ".join(SUMMARIES)
            + "; then a restarted writer saves a step that shares nothing, under keep_last=2 "
            "(step 2 alone reads step 1's bytes)",
            len(SUMMARIES),
            summaries_trial(),
        ),
        (
            "a byte of the frozen bytes flipped, then a restarted writer saves: its save "
            "would refer to them",
            1,
            restarted_after_damage_trial(),
        ),
        (
            f"one damaged file: {REACH_SAVES} saves (full_save_every={REACH_EVERY}, "
            f"keep_last={REACH_KEEP}), a byte of each step's own data file flipped in turn",
            REACH_SAVES,
            reach_trial(),
        ),
    ]


def kill_trial(seed: int, tally: Tally) -> None:
    rng = random.Random(seed)
    compression = "zstd" if seed % 2 else None
    with tempfile.TemporaryDirectory(prefix="jaxckpt-incremental-") as directory:
        port = launch.free_port()
        procs = [
            launch.start(
                "-m",
                "reliability.writer",
                directory,
                0,
                1,
                8,
                port,
                N,
                "incremental-zstd" if compression else "incremental",
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
        ]
        with counted(tally, seed, procs):
            kill_after_first_save(procs, 0, rng)
            tally.visible.append(len(check(Path(directory), compression)))


def _state(step: int) -> dict:
    return {"x": expected(step), "frozen": frozen(N)}


def check(directory: Path, compression: str | None = None) -> list[int]:
    """The recovery checks (AssertionError); the steps visible after the kill."""
    import jaxckpt
    from jaxckpt import _incremental

    reports = jaxckpt.verify(directory)
    assert all(r.ok for r in reports), [r for r in reports if not r.ok]
    policy = jaxckpt.RetentionPolicy(keep_last=2)
    with jaxckpt.CheckpointManager(
        directory, timeout_s=60, incremental=True, retention=policy, compression=compression
    ) as m:
        steps = m.all_steps()
        target = {k: np.zeros_like(v) for k, v in _state(0).items()}
        for step in steps:
            got = m.restore(step, state=target)
            for name, want in _state(step).items():
                assert np.array_equal(got.state[name], want), f"step {step}: wrong {name}"
        new = (steps[-1] if steps else 0) + 1
        m.save(new, state=_state(new), meta={"step": new})
        m.wait()
        m.save(new + 1, state=_state(new + 1), meta={"step": new + 1})
        m.wait()  # (retention after the first save: the newest two kept)
        kept = m.all_steps()
    assert kept[-2:] == [new, new + 1], kept
    assert not unfinished(directory), f"leftovers not cleaned: {unfinished(directory)}"
    shared = set().union(*(_incremental.read_shares(directory / str(s)) or () for s in kept))
    retired = {
        int(p.name.split(".")[0]) for p in directory.iterdir() if p.name.endswith("-retired")
    }
    assert retired <= shared, f"retired steps no kept step shares: {sorted(retired - shared)}"
    gone = [s for s in shared if not (directory / str(s)).is_dir()]
    assert not gone, f"steps shared by kept steps are gone: {gone}"
    return steps


def _two_steps(d: Path) -> np.ndarray:
    """Steps 1 and 2 of a frozen 2 MiB leaf (shared: a leaf of at most 1 MiB is written at
    every save) and a small one: step 2 reads the frozen bytes from step 1's file. The
    frozen leaf."""
    import jaxckpt

    base = frozen(2**19)
    with jaxckpt.CheckpointManager(d, incremental=True) as m:
        for step in (1, 2):
            m.save(step, state={"x": expected(step)[:4096], "frozen": base})
            m.wait()
    return base


def _flip(data: Path, at: int) -> None:
    """The byte at `at` of the file `data` flipped."""
    with open(data, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x01]))


def _flip_frozen(d: Path) -> None:
    """A byte of the frozen bytes in step 1's file flipped."""
    index = json.loads((d / "1" / "packed" / "0-of-1.json").read_text())
    _flip(
        d / "1" / "packed" / "0-of-1.bin", index["leaves"]["state"]["frozen"]["pieces"][0][0] + 100
    )


def shared_file_trial() -> str:
    import jaxckpt
    from jaxckpt import errors

    with tempfile.TemporaryDirectory(prefix="jaxckpt-incremental-") as tmp:
        d = Path(tmp)
        _two_steps(d)
        _flip_frozen(d)
        reports = {r.step: r for r in jaxckpt.verify(d)}
        own = any("packed/0-of-1.bin" in p for p in reports[1].problems)
        shared = any(
            re.search("shared with step 1.*1/packed/0-of-1.bin", p) for p in reports[2].problems
        )
        named = 0
        with jaxckpt.CheckpointManager(d, read_only=True, verify_on_restore=False) as m:
            for step in (1, 2):
                try:
                    m.restore(step)
                except errors.CorruptCheckpointError as e:
                    named += "packed/0-of-1.bin" in str(e)
    if own and shared and named == 2:
        return "detected by verify for the step that holds it and the step that uses it; each restore names it"
    return f"FAILED (verify: own {own}, shared {shared}; restores naming it: {named} of 2)"


SUMMARIES = ("missing", "emptied", "swollen to 1.5 GiB", "nested 100,000 deep")


def _summary(d: Path, kind: str) -> None:
    import os

    shares = d / "jaxckpt" / "shares.json"
    if kind == "missing":
        shares.unlink()
    elif kind == "emptied":
        shares.write_text(json.dumps({"steps": []}))
    elif kind.startswith("swollen"):
        os.truncate(shares, 3 * 2**29)  # sparse
    else:
        shares.write_text('{"steps": ' + "[" * 100_000 + "]" * 100_000 + "}")


def summaries_trial() -> str:
    """Each damaged summary of step 2 (which reads step 1's frozen bytes): retention after
    step 3 (which shares nothing) with keep_last=2 must retire step 1, not delete it; step 2
    restores bitwise, and verify names the summary."""
    import jaxckpt

    failures = []
    for kind in SUMMARIES:
        with tempfile.TemporaryDirectory(prefix="jaxckpt-incremental-") as tmp:
            d = Path(tmp)
            base = _two_steps(d)
            _summary(d / "2", kind)
            keep = jaxckpt.RetentionPolicy(keep_last=2)
            with jaxckpt.CheckpointManager(d, incremental=True, retention=keep) as m:
                m.save(3, state={"x": expected(3)[:4096], "frozen": base + 1})
                m.wait()
                kept = m.all_steps()
            try:
                with jaxckpt.CheckpointManager(d, read_only=True, verify_on_restore=False) as m:
                    got = m.restore(2, state={"x": np.zeros(4096, np.float32), "frozen": base})
                exact = np.array_equal(got.state["frozen"], base)
            except jaxckpt.errors.JaxckptError as e:
                exact = False
                failures.append(f"{kind}: step 2 did not restore ({type(e).__name__}: {e})")
            named = any(
                "shares.json" in p for r in jaxckpt.verify(d) if r.step == 2 for p in r.problems
            )
            if not (kept == [2, 3] and (d / "1").is_dir() and exact and named):
                failures.append(
                    f"{kind}: kept {kept}, step 1 {'kept' if (d / '1').is_dir() else 'deleted'}, "
                    f"step 2 bitwise {exact}, verify named the summary {named}"
                )
    if failures:
        return f"FAILED {len(failures)}: " + "; ".join(failures[:3])
    return (
        "retention follows each step's index: step 1 retired, step 2 restores bitwise; "
        "verify names the summary (missing, disagreeing with the index, unreadable)"
    )


def restarted_after_damage_trial() -> str:
    """Step 1 holds the frozen bytes, step 2 refers to them; a byte of them is flipped; a
    new writer saves step 3: it must write those bytes again (it reads back what it would
    refer to) and restore bitwise, with verify finding step 3 clean."""
    import jaxckpt

    with tempfile.TemporaryDirectory(prefix="jaxckpt-incremental-") as tmp:
        d = Path(tmp)
        base = _two_steps(d)
        _flip_frozen(d)
        with jaxckpt.CheckpointManager(d, incremental=True) as m:
            m.save(3, state={"x": expected(3)[:4096], "frozen": base})
        try:
            with jaxckpt.CheckpointManager(d, read_only=True) as m:
                got = m.restore(3, state={"x": np.zeros(4096, np.float32), "frozen": base})
            exact = np.array_equal(got.state["frozen"], base)
        except jaxckpt.errors.JaxckptError as e:
            return f"FAILED: step 3 did not restore ({type(e).__name__}: {e})"
        clean = {r.step: r.ok for r in jaxckpt.verify(d)}.get(3)
    if exact and clean:
        return "the new writer wrote the damaged bytes again: step 3 verifies and restores bitwise"
    return f"FAILED (step 3 bitwise {exact}, verifies {clean})"


REACH_SAVES, REACH_EVERY, REACH_KEEP = 12, 4, 5


def reach_trial() -> str:
    """`REACH_SAVES` saves of a frozen 2 MiB leaf and a changing one; then, for each step on
    disk (kept or retired), in a copy of the directory, a byte in the middle of its own data
    file flipped: the steps that no longer verify must be at most `REACH_EVERY`, and a
    restore with fallback=True must return a kept step, bitwise."""
    import shutil

    import jaxckpt

    worst, failures = 0, []
    with tempfile.TemporaryDirectory(prefix="jaxckpt-incremental-") as tmp:
        d = Path(tmp) / "ckpt"
        base = frozen(2**19)
        keep = jaxckpt.RetentionPolicy(keep_last=REACH_KEEP)
        with jaxckpt.CheckpointManager(d, full_save_every=REACH_EVERY, retention=keep) as m:
            for step in range(1, REACH_SAVES + 1):
                m.save(step, state={"x": expected(step)[:4096], "frozen": base})
            m.wait()
            kept = m.all_steps()
        on_disk = sorted({int(p.name.split(".")[0]) for p in d.iterdir() if p.name[0].isdigit()})
        target = {"x": np.zeros(4096, np.float32), "frozen": base}
        for step in on_disk:
            copy = Path(tmp) / f"copy-{step}"
            shutil.copytree(d, copy, symlinks=True)
            data = copy / str(step) / "packed" / "0-of-1.bin"
            _flip(data, data.stat().st_size // 2)
            damaged = [r.step for r in jaxckpt.verify(copy) if not r.ok]
            worst = max(worst, len(damaged))
            try:
                with jaxckpt.CheckpointManager(copy, read_only=True) as m:
                    got = m.restore(state=target, fallback=True)
                exact = got.step in kept and all(
                    np.array_equal(got.state[k], v)
                    for k, v in {"x": expected(got.step)[:4096], "frozen": base}.items()
                )
            except jaxckpt.errors.JaxckptError as e:
                exact = False
                damaged.append(f"no fallback: {type(e).__name__}")
            if len(damaged) > REACH_EVERY or not exact:
                failures.append(f"step {step}'s file damaged: {damaged}, fallback bitwise {exact}")
            shutil.rmtree(copy)
    if failures:
        return f"FAILED {len(failures)}: " + "; ".join(failures[:3])
    return (
        f"at most {worst} steps (of {len(on_disk)} on disk) fail to verify, never more than "
        f"{REACH_EVERY}; fallback=True restores a kept step bitwise every time"
    )

"""Incremental steps under faults (`reliability.stress`'s rows for them, issue 53).

* A writer saving in a loop with `incremental=True` and `keep_last=2` (each step an 8 MiB
  frozen leaf, the same array every step, and 8 MiB that change: every later step refers to
  the first for the frozen bytes, which retention retires rather than deletes) is SIGKILLed
  at a seeded moment: mid-save, mid-commit or mid-retention. A new process then checks that
  every visible step verifies and restores exactly, that a new writer saves the next step,
  and that no step is kept that no kept step shares bytes with, nor any gone that one does.
  Every other trial's writer compresses (`compression="zstd"`), and so does its checker.
* A shared file damaged: a byte of the frozen bytes flipped in the step that holds them;
  verify names the file for that step and for the step that uses it, and a restore of
  either names it.
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
    shared = set().union(*(_incremental.read_shares(directory / str(s)) for s in kept))
    retired = {
        int(p.name.split(".")[0]) for p in directory.iterdir() if p.name.endswith("-retired")
    }
    assert retired <= shared, f"retired steps no kept step shares: {sorted(retired - shared)}"
    gone = [s for s in shared if not (directory / str(s)).is_dir()]
    assert not gone, f"steps shared by kept steps are gone: {gone}"
    return steps


def shared_file_trial() -> str:
    import jaxckpt
    from jaxckpt import errors

    with tempfile.TemporaryDirectory(prefix="jaxckpt-incremental-") as tmp:
        d = Path(tmp)
        base = frozen(2**19)  # 2 MiB: shared (a leaf of at most 1 MiB is written each save)
        with jaxckpt.CheckpointManager(d, incremental=True) as m:
            for step in (1, 2):
                m.save(step, state={"x": expected(step)[:4096], "frozen": base})
                m.wait()
        index = json.loads((d / "1" / "packed" / "0-of-1.json").read_text())
        at = index["leaves"]["state"]["frozen"]["pieces"][0][0] + 100  # the frozen bytes
        data = d / "1" / "packed" / "0-of-1.bin"
        raw = bytearray(data.read_bytes())
        raw[at] ^= 0x01
        data.write_bytes(bytes(raw))
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

"""Faults from a shared directory: the lock file planted as a link, deleted under a live
writer, and a save that fails on a directory that turned immutable (or is interrupted).

Each trial runs real jaxckpt in real child processes and returns None when every guarantee
held, or the text of the one that did not. `reliability.stress` runs them seeded and counts
them into RELIABILITY.md; the test suite runs one of each.
"""

from __future__ import annotations

import contextlib
import random
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from reliability import launch
from reliability.stress import FIRST_SAVE_S, check, expected, start_writers

LOCK = ".jaxckpt-writer.lock"


@contextlib.contextmanager
def _immutable_cleared(directory: Path) -> Iterator[None]:
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(directory)], check=False, timeout=30)


def exit_after_failed_save(how: str, seed: int = 0, timeout_s: int = 10) -> str | None:
    """A process whose save fails on a directory made immutable ("immutable"), or that gets
    a Ctrl-C at a seeded moment of a save loop ("interrupt"), must exit within `timeout_s`
    of it. None, or what went wrong."""
    with tempfile.TemporaryDirectory(prefix="jaxckpt-exit-") as tmp:
        directory = Path(tmp) / "ckpt"
        with _immutable_cleared(directory):
            proc = launch.start(
                "-m",
                "reliability.failing_save",
                directory,
                how,
                timeout_s,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            try:
                try:
                    first = launch.readline(proc, timeout=FIRST_SAVE_S).strip()
                except TimeoutError as e:
                    return f"{how}: {e}"
                if first != "saving":
                    try:
                        _, err = proc.communicate(timeout=60)
                    except subprocess.TimeoutExpired:
                        return f"{how}: the writer printed {first!r}, not 'saving', and ran on"
                    return f"{how}: the writer failed before the save: {err[-500:]}"
                if how == "interrupt":
                    time.sleep(random.Random(seed).uniform(0.0, 0.5))  # seeded moment
                    proc.send_signal(signal.SIGINT)
                start = time.monotonic()
                try:
                    _, err = proc.communicate(timeout=timeout_s + 60)
                except subprocess.TimeoutExpired:
                    return f"{how}: the process still ran {timeout_s + 60} s after the failure"
            finally:
                proc.kill()
            seconds = time.monotonic() - start
            wanted = "SaveError" if how == "immutable" else "KeyboardInterrupt"
            if wanted not in err:
                return f"{how}: exit {proc.returncode} without {wanted}: {err[-500:]}"
            if seconds > timeout_s:
                return f"{how}: the process exited {seconds:.0f} s after the failure"
            return None


def lock_symlink_trial() -> str | None:
    """The lock path planted as a link to a file outside: the writer is refused, the file is
    untouched, readers still see every step."""
    import jaxckpt
    from jaxckpt import errors

    with tempfile.TemporaryDirectory(prefix="jaxckpt-lock-") as tmp:
        directory, precious = Path(tmp) / "ckpt", Path(tmp) / "precious"
        with jaxckpt.CheckpointManager(directory) as m:
            m.save(1, state={"x": expected(1)}, meta={"step": 1})
        precious.write_text("keep me")
        (directory / LOCK).unlink()
        (directory / LOCK).symlink_to(precious)
        try:
            jaxckpt.CheckpointManager(directory).close()
            return "a writer opened through a symlinked lock file"
        except errors.LockedError:
            pass
        if precious.read_text() != "keep me":
            return "the symlinked lock's target was written"
        if jaxckpt.CheckpointManager(directory, read_only=True).all_steps() != [1]:
            return "the steps changed"
    return None


def lock_deletion_trial(seed: int) -> str | None:
    """A writer saves in a loop; at a seeded moment its lock file is deleted and a second
    writer takes the directory and commits a step. The first writer must raise LockedError
    and commit nothing it had not already checked its lock for (at most the one save past
    that check); every visible step then verifies and restores exactly."""
    import jaxckpt

    rng = random.Random(seed)
    with tempfile.TemporaryDirectory(prefix="jaxckpt-lockdel-") as tmp:
        directory, log = Path(tmp) / "ckpt", Path(tmp) / "writer.log"
        with log.open("w") as stderr:  # a file: a pipe nobody reads could stall the writer
            (writer,) = start_writers(str(directory), 1, stderr=stderr)
        try:
            first = launch.readline(writer, timeout=FIRST_SAVE_S).strip()
            if first != "1":
                return f"the writer did not start: {first!r}"
            time.sleep(rng.uniform(0.0, 1.5))  # the moment: seeded, not a wait for a result
            (directory / LOCK).unlink()
            taken = 1_000_000
            with jaxckpt.CheckpointManager(directory, timeout_s=60) as second:
                before = second.all_steps()
                second.save(taken, state={"x": expected(taken)}, meta={"step": taken})
            try:
                writer.wait(timeout=120)
            except subprocess.TimeoutExpired:
                return "the first writer kept running after losing its lock"
            err = log.read_text()
            if "LockedError" not in err:
                return f"the first writer did not raise LockedError: {err[-300:]}"
            with jaxckpt.CheckpointManager(directory, read_only=True) as reader:
                after = reader.all_steps()
            late = [s for s in after if s not in before and s != taken]
            if len(late) > 1 or (late and late[0] != max(before, default=0) + 1):
                return f"the first writer committed {late} after losing its lock ({err[-300:]})"
            steps, _ = check(directory)
            if taken not in steps:
                return f"the second writer's step {taken} is gone: {steps}"
        except Exception as e:  # a failure of the trial, reported in its row
            return f"seed {seed}: {type(e).__name__}: {e}"
        finally:
            writer.kill()
    return None

"""One writer per checkpoint directory: an advisory lock the kernel drops when its holder dies.

The writer (process 0 of a job) holds `flock` on `<directory>/.jaxckpt-writer.lock`, whose
text names the holder (host, pid, since). A second writer is refused with that name. A lock
left by a dead process is free again (the kernel released it with the process); the next
writer takes it over and logs whose it was. Readers (restore with `read_only=True`, verify,
export, inspect) take no lock.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import logging
import os
import socket
from pathlib import Path

from jaxckpt.errors import LockedError

log = logging.getLogger("jaxckpt")
LOCK_FILE = ".jaxckpt-writer.lock"


class WriterLock:
    def __init__(self, directory: str | os.PathLike):
        self.path = Path(directory) / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _describe(os.pread(fd, 4096, 0))
            os.close(fd)
            raise LockedError(
                f"{self.path.parent} is being written by {holder}; one writer per directory. "
                "Stop that job first, or open this one with read_only=True to restore."
            ) from None
        previous = os.pread(fd, 4096, 0)
        if previous.strip():
            log.warning("taking over the writer lock of %s, which is gone", _describe(previous))
        me = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "since": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.ftruncate(self._fd, 0)  # a clean release leaves no holder behind
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def _describe(raw: bytes) -> str:
    try:
        who = json.loads(raw)
        return f"host {who['host']} pid {who['pid']} (since {who['since']})"
    except (ValueError, KeyError, TypeError):
        return "another process"

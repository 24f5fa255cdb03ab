"""One writer per checkpoint directory.

Local disk: an advisory `flock` on `<directory>/.jaxckpt-writer.lock`, which the kernel drops
when its holder dies. The file's text names the holder (host, pid, since); a second writer is
refused with that name, and a lock left by a dead process is free again at once.

Object storage (gs://, s3://) has no locks, so the writer holds a *lease*: the same object,
created only if absent and rewritten only if unchanged since the holder's last write
(conditions the server decides, atomically: GCS `ifGenerationMatch`, S3 `If-None-Match: *`
and `If-Match: <ETag>`; `_leases.lease_object`), renewed by a thread every quarter of its
term. A second writer is refused while the lease is renewed. A lease left unrenewed
for its whole term (its holder died or froze) is taken over by the next writer, judged by
the server's clock, so host clocks do not matter. A writer that lost its lease (it froze
for longer than the term and another took over) finds out before its next save starts and
before any save of its commits, and raises `LockedError`; it never commits after that.

Readers (restore with `read_only=True`, verify, export, inspect) take no lock. Only
process 0 of a job holds it.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import getpass
import json
import logging
import os
import socket
import stat
import threading
import time
import uuid
from pathlib import Path
from typing import Any, NamedTuple

from jaxckpt._layout import LOCK_FILE
from jaxckpt._leases import Conflict, lease_object
from jaxckpt._storage import file_kind, is_remote
from jaxckpt._store_time import ATTEMPTS, give_up_s
from jaxckpt.errors import LockedError, NotWritableError

log = logging.getLogger("jaxckpt")


def writer_lock(directory: str | os.PathLike, lease_s: float) -> WriterLock | ObjectLease | None:
    """The lock for `directory`'s kind of storage; None (with a warning) where none exists."""
    text = str(directory)
    if not is_remote(text):
        return WriterLock(directory)
    if lease_object(text) is not None:
        return ObjectLease(text, lease_s)
    log.warning("no writer lock on %s: two jobs writing there are not stopped", text)
    return None


class WriterLock:
    """The lock on local disk (see the module's docstring).

    The lock file is opened without following a symlink and must be a regular file with
    one link, so a lock path planted as a link to another file never makes jaxckpt write
    there. A lock path deleted or replaced under a live writer (`rm` of the file or of the
    whole directory) would let a second writer lock a new file: `check` compares the path
    with the locked inode before each save and each commit, and a writer that lost it
    raises `LockedError` from then on.
    """

    def __init__(self, directory: str | os.PathLike):
        self.path = Path(directory) / LOCK_FILE
        self._fd: int | None = None
        self._lost: str | None = None

    def acquire(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
        except OSError as e:
            if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
                raise _not_writable(self.path.parent, e) from None
            if e.filename != str(self.path):
                raise
            raise _not_a_lock_file(
                self.path, f"it cannot be opened without following links ({e.strerror})"
            ) from None
        what = os.fstat(fd)
        if not stat.S_ISREG(what.st_mode) or what.st_nlink != 1:
            os.close(fd)
            raise _not_a_lock_file(self.path, _kind(what))
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _describe(os.pread(fd, 4096, 0))
            os.close(fd)
            raise _refused(self.path.parent, holder) from None
        except BaseException:
            os.close(fd)
            raise
        previous = os.pread(fd, 4096, 0)
        if previous.strip():
            log.warning("taking over the writer lock of %s, which is gone", _describe(previous))
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(_me()).encode(), 0)
        self._fd = fd

    def check(self, *, confirm: bool = False) -> None:
        """Raises `LockedError` once the lock path no longer names the locked file."""
        if self._lost is None and self._fd is not None:
            held = os.fstat(self._fd)
            try:
                now = os.lstat(self.path)
                if (now.st_dev, now.st_ino) != (held.st_dev, held.st_ino):
                    self._lost = f"{self.path} was replaced by another file"
            except OSError as e:
                self._lost = f"{self.path} was removed ({e.strerror})"
        if self._lost is not None:
            raise LockedError(
                f"this job lost the writer lock on {self.path.parent}: {self._lost} while it "
                "held it, so another job may be writing there now. It writes nothing more "
                "there; stop one of the two jobs, check the directory, then start one writer."
            )

    def release(self) -> None:
        if self._fd is not None:
            if self._lost is None:
                os.ftruncate(self._fd, 0)  # a clean release leaves no holder behind
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


class ObjectLease:
    """The writer lock on object storage (see the module's docstring)."""

    def __init__(self, directory: str, lease_s: float):
        self.directory = directory.rstrip("/")
        self.path = f"{self.directory}/{LOCK_FILE}"
        self.lease_s = float(lease_s)
        self._me = {**_me(), "lease_s": self.lease_s, "id": uuid.uuid4().hex}
        found = lease_object(self.path)
        if found is None:
            raise ValueError(f"no conditional writes on {self.path}")
        self._object = found
        self._version: Any = None  # the store's version of our last accepted write
        self._renewed = 0.0  # time.monotonic() at the sending of the last write accepted
        self._lost: str | None = None
        self._mutex = threading.Lock()
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    def acquire(self) -> None:
        for _ in range(3):  # a lease released or taken over meanwhile: look again
            try:
                self._write(None)
                break
            except Conflict:
                if self._take_over_if_expired():
                    break
        else:
            raise LockedError(f"could not take the writer lease {self.path}: it keeps changing")
        self._renewer = threading.Thread(target=self._renew, name="jaxckpt-lease", daemon=True)
        self._renewer.start()

    def check(self, *, confirm: bool = False) -> None:
        """Raises `LockedError` if the lease was lost. `confirm`: ask the server even when
        the last renewal is recent (before a commit); otherwise only once it is overdue."""
        if self._lost is None and (confirm or time.monotonic() - self._renewed > self.lease_s):
            self._confirm()
        if self._lost is not None:
            raise LockedError(
                f"this job lost the writer lease on {self.directory} to "
                f"{self._lost}: it was not renewed for {self.lease_s:g} s (was this process "
                "stopped?). It writes nothing more there; stop one of the two jobs."
            )

    def release(self) -> None:
        """Stops the renewals and deletes the lease, waiting for a store that does not
        answer at most two thirds of the give-up time in all: a third for a renewal in
        flight (the renewer is a daemon thread; its request ends by itself), one attempt of
        a third for the delete. A lease left behind expires by itself after its term."""
        if self._renewer is None:
            return
        self._stop.set()
        self._renewer.join(give_up_s() / ATTEMPTS)
        self._renewer = None
        if self._lost is None:
            try:  # only our own lease: a newer version is someone else's
                self._object.delete(self._version, once=True)
            except (Conflict, OSError) as e:
                log.warning(
                    "could not release the writer lease %s (the next writer takes it over "
                    "once %g s have passed since its last renewal): %s",
                    self.path,
                    self.lease_s,
                    e,
                )

    def _confirm(self) -> None:
        """Asks the server whether the lease is still ours; records who has it if not."""
        with self._mutex:  # never between a renewal's write and its new version
            current = self._object.current()
            if current is not None and current[0] == self._version:
                return
            # Whoever holds it now (it may be renewed again meanwhile: no condition here).
            raw = None if current is None else self._object.fetch()
            self._lost = "nobody" if raw is None else _describe(raw)

    def _write(self, version: Any) -> None:
        """Our lease written: created (`version` None) or replaced if still at `version`."""
        with self._mutex:
            # Each write's bytes differ (its count): an S3 version is the ETag, a hash of them.
            self._me["writes"] = self._me.get("writes", 0) + 1
            data = json.dumps(self._me).encode()
            # The term runs from the request's sending, not its answer: a writer frozen while
            # the request was on its way (the server took it, then another writer took the
            # lease over) must find its renewal overdue when it wakes, not fresh.
            sent = time.monotonic()
            if version is None:
                self._version = self._object.create(data)
            else:
                self._version = self._object.replace(data, version)
            self._renewed = sent

    def _take_over_if_expired(self) -> bool:
        """Takes the lease over once its holder lets it expire, waiting for that at most
        the rest of its term. Raises LockedError if the holder renews it meanwhile (a live
        writer); False if it was released or changed hands meanwhile (look again)."""
        current = self._object.current()
        if current is None:
            return False
        version, updated = current
        raw = self._object.fetch(version)
        if raw is None:
            return False
        holder = Holder.of(raw)
        if holder.id == self._me["id"]:  # our own create, retried by the client
            self._version, self._renewed = version, time.monotonic()
            return True
        # A holder that names no term we can trust is given ours (the writers of one
        # directory share it): waited out, taken over if not renewed meanwhile.
        term = self.lease_s if holder.lease_s is None else holder.lease_s
        # At least this long (times in whole seconds, as on S3, err by up to one either way).
        idle = (self._object.server_now() - updated).total_seconds()
        idle -= self._object.clock_resolution_s
        if idle < term:
            # A live holder renews every term/4; a dead one lets the lease run out.
            log.info(
                "waiting up to %.0f s for the writer lease of %s (not renewed for %.0f s)",
                term - idle,
                _describe(raw),
                idle,
            )
            deadline = time.monotonic() + term - idle
            while (left := deadline - time.monotonic()) > 0:
                time.sleep(min(left, term / 16, 1.0))
                now = self._object.current()
                if now is None:
                    return False
                if now[0] != version:
                    raise _refused(self.directory, f"{_describe(raw)}, which holds its lease")
        try:
            self._write(version)
        except Conflict:
            return False
        log.warning(
            "took over the writer lease of %s, which was not renewed for %.0f s",
            _describe(raw),
            max(idle, term),
        )
        return True

    def _renew(self) -> None:
        while not self._stop.wait(self.lease_s / 4):
            if (version := self._version) is None:  # (never: it starts once taken)
                return  # no unconditional write: it would overwrite another writer's lease
            try:
                self._write(version)
            except Conflict:
                self._confirm()  # records who has it now
                return
            except OSError as e:  # transient: the next renewal tries again
                log.warning("could not renew the writer lease %s: %s", self.path, e)


def _me() -> dict[str, Any]:
    """How a lock names its holder (`_describe` reads it back)."""
    since = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    return {"host": socket.gethostname(), "pid": os.getpid(), "since": since}


def _refused(directory: Any, holder: str) -> LockedError:
    return LockedError(
        f"{directory} is being written by {holder}; one writer per directory. Stop that job "
        "first, or open this one with read_only=True to restore."
    )


def _not_writable(directory: Path, e: OSError) -> NotWritableError:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid {os.getuid()}"
    return NotWritableError(
        f"cannot save in {directory}: {e.strerror} ({e.filename}), as user {user}. Choose a "
        "directory this user can write (one under your home, say), or have this one made "
        "writable for it; to only read steps there, pass read_only=True"
    )


def _not_a_lock_file(path: Path, what: str) -> LockedError:
    return LockedError(
        f"{path} is not a lock file jaxckpt can use: {what}. jaxckpt never writes through "
        "a link; remove it (rm, not rm -r) if nothing else needs it, then start again."
    )


def _kind(st: os.stat_result) -> str:
    if stat.S_ISREG(st.st_mode):
        return f"a regular file with {st.st_nlink} hard links (one of them elsewhere)"
    return file_kind(st.st_mode)


class Holder(NamedTuple):
    """What a lock's text (as `_me` and `ObjectLease` write it) says of its holder, every
    field checked here, the one place a lock or a lease is read: a field missing or not
    what jaxckpt writes is None (the name: "another process"), and so is every field of
    a text that is not a JSON object. Whatever another process or a damaged object left
    there, nothing read from it fails a writer's start, makes it take over a renewed
    lease at once or wait for ever."""

    id: str | None  # the lease's writer (`ObjectLease`): a uuid4 in hex
    lease_s: float | None  # its term: seconds, above 0 and at most MAX_LEASE_S
    name: str  # "host H pid P (since S)", or "another process"

    @classmethod
    def of(cls, raw: bytes) -> Holder:
        try:
            found = json.loads(raw)
        except (ValueError, RecursionError):  # (UnicodeDecodeError too; nested too deep)
            found = None
        who: dict[str, Any] = found if isinstance(found, dict) else {}
        host, pid, since = who.get("host"), who.get("pid"), who.get("since")
        named = _text(host) and isinstance(pid, int) and not isinstance(pid, bool) and _text(since)
        term: Any = who.get("lease_s")
        return cls(
            id=who["id"] if _text(who.get("id")) else None,
            lease_s=float(term) if _seconds(term) else None,
            name=f"host {host} pid {pid} (since {since})" if named else "another process",
        )


MAX_LEASE_S = 7 * 24 * 3600.0  # the longest term a writer may hold its lease for


def _seconds(value: Any) -> bool:
    """A term: a number above 0 and at most MAX_LEASE_S (JSON's NaN and Infinity, an
    integer too large for a float, a bool, text: not one; compared, never converted)."""
    number = isinstance(value, int | float) and not isinstance(value, bool)
    return number and 0 < value <= MAX_LEASE_S


def _text(value: Any) -> bool:
    """A field jaxckpt writes as a short string (a host name, a time, an id)."""
    return isinstance(value, str) and 0 < len(value) <= 255


def _describe(raw: bytes) -> str:
    return Holder.of(raw).name

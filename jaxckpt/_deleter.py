"""Deletions in the background, off the save's blocking path, on process 0 of a writer: a
deleted step's files, unfinished saves' leftovers and deletions an earlier writer never
finished. One thread; a failure is logged, and the next writer tries again.

A step leaves the listing before its files go: on local disk its folder is renamed to
`<step>.jaxckpt-deleting` (which no listing reads); on object storage one
`<step>.jaxckpt-tombstone` object hides it until its objects, and then the tombstone, are
deleted. A step a kept one shares bytes with is retired instead (`retire`), and deleted
once none does (`free`).
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable

from etils import epath

from jaxckpt import _layout, _listing
from jaxckpt._storage import is_remote
from jaxckpt._store_errors import storage_error

log = logging.getLogger("jaxckpt")
_DELETED = "a deleted step's files"


class Deleter:
    """The background deletions of one directory; each folder or object deleted through
    `remove` (the store's, a seam a faulty store slows or fails; `Deleter.remove` itself
    unless given)."""

    def __init__(
        self, directory: epath.Path, remove: Callable[[epath.Path, str], bool] | None = None
    ):
        self.directory = directory
        self._remove = remove or self.remove
        self._pool = concurrent.futures.ThreadPoolExecutor(1, "jaxckpt-delete")
        self._closing = self._unanswered = False  # (`close`, `remove`)
        self._leftovers: list[concurrent.futures.Future] = []

    def resume(self, listing: _listing.Listing) -> None:
        """What a listing at start-up found left: saves that never committed (a killed
        process; on object storage, those above the newest committed step, as any other was
        there when a writer started after it), and deletions that never finished."""
        self._leftovers = [self._pool.submit(self._discard, n) for n in listing.unfinished]
        for name in listing.deleting:
            if name.endswith(_layout.TOMBSTONE_SUFFIX):
                step = _layout.step_of(name.removesuffix(_layout.TOMBSTONE_SUFFIX))
                if step is not None:
                    self._pool.submit(self._remove_tombstoned, step)
            else:
                self._pool.submit(self._remove, self.directory / name, _DELETED)

    def leftovers_removed(self) -> None:
        """Waits until the unfinished saves found at start-up are removed (or failed)."""
        concurrent.futures.wait(self._leftovers)

    def delete(self, step: int) -> None:
        """Takes a committed step jaxckpt wrote out of the listing now (see the module's
        docstring); its files go in the background."""
        if is_remote(self.directory):
            (self.directory / f"{step}{_layout.TOMBSTONE_SUFFIX}").write_bytes(b"")
            self._pool.submit(self._remove_tombstoned, step)
        else:
            doomed = self.directory / f"{step}{_layout.DELETING_SUFFIX}"
            (self.directory / str(step)).rename(doomed)
            self._pool.submit(self._remove, doomed, _DELETED)

    def retire(self, step: int) -> None:
        """Takes a committed step out of the listing now and keeps its files: a kept step
        shares its bytes (`jaxckpt._incremental`; `free` deletes it once none does)."""
        (self.directory / f"{step}{_layout.RETIRED_SUFFIX}").write_bytes(b"")

    def free(self, step: int) -> None:
        """Deletes a retired step (as `delete`), then its mark: a kill between the two
        leaves a mark without a step, which the next `free` removes."""
        if (self.directory / str(step)).exists():
            self.delete(step)
        (self.directory / f"{step}{_layout.RETIRED_SUFFIX}").unlink(missing_ok=True)

    def close(self) -> None:
        """Waits for the deletions under way; once one meets a store that fails (does not
        answer, ...), the others are left to the next writer (`remove`): the one in flight
        ends within the store's give-up time."""
        self._closing = True
        self._pool.shutdown(wait=True)

    def _discard(self, name: str) -> None:
        """An unfinished save's leftovers. On local disk the folder is renamed aside first:
        a writer that lost its lock (its lock file deleted) may still be finishing that
        save, and its rename to `<step>` then either wins (a whole step) or fails, never
        committing a folder half deleted under it."""
        doomed = self.directory / name
        if not is_remote(self.directory):
            try:
                doomed = doomed.rename(self.directory / f"{name}{_layout.DELETING_SUFFIX}")
            except FileNotFoundError:
                return  # committed (or removed) by whoever was still writing it
            except OSError as e:
                log.warning("could not set aside an unfinished save, %s: %s", doomed, e)
                return
        self._remove(doomed, "an unfinished save's leftovers")

    def _remove_tombstoned(self, step: int) -> None:
        """The step's objects, then its tombstone (kept, and retried later, on failure)."""
        if self._remove(self.directory / str(step), _DELETED):
            self._remove(self.directory / f"{step}{_layout.TOMBSTONE_SUFFIX}", _DELETED)

    def remove(self, path: epath.Path, what: str = _DELETED) -> bool:
        """Deletes a folder or object, in the deleter's thread; a failure is logged (the
        next writer retries it). Once the store failed one while the store closes, none
        more is tried (`close`)."""
        if self._closing and self._unanswered:
            log.warning("left %s, %s, to the next writer: the store failed", what, path)
            return False
        try:
            if path.is_dir():
                path.rmtree()
            else:
                path.unlink(missing_ok=True)
            return True
        except Exception as e:
            self._unanswered = self._unanswered or storage_error(self.directory, e) is not None
            log.warning("could not remove %s, %s (retried by the next writer): %s", what, path, e)
            return False

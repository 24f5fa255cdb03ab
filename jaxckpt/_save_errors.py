"""A failed save, worded (`SaveError`): which processes did not come, which steps are
committed, and the real cause where another one hides it (a store that does not answer, a
lock another writer took over). Worded once nothing of the step is still running: Orbax may
fail in the foreground after it started the step's commit in the background (a barrier with
a dead process), and that commit can still land."""

from __future__ import annotations

import logging

from jaxckpt import _internals, _orbax, _store_errors, _store_time
from jaxckpt._lock import ObjectLease, WriterLock
from jaxckpt.errors import LockedError, SaveError

log = logging.getLogger("jaxckpt")


def save_error(
    store: _orbax.OrbaxStore,
    lock: WriterLock | ObjectLease | None,
    step: int,
    error: Exception,
    *,
    background: bool,
) -> SaveError:
    """The SaveError for `step` of `store`, which failed with `error`. A store that does
    not answer the listing is given up on after a third of the give-up time: the error then
    names the steps as last listed."""
    missing = getattr(error, "missing_processes", None) or _internals.missing_processes(error)
    if not background:
        try:
            store.wait()  # bounded: each barrier in it waits for what is left of timeout_s
        except Exception as late:
            missing = sorted({*missing, *_internals.missing_processes(late)})
    # A store that failed the save (did not answer, ...) named as StorageError does.
    error = _store_errors.storage_error(store.directory, error, f"saving step {step}") or error
    unlisted = None
    try:
        # One listing, and bounded (a third of the give-up time, in all): the store may be
        # what failed the save, and an error path never waits on it long.
        with _store_time.within(_store_time.give_up_s() / _store_time.ATTEMPTS):
            committed = store.steps()
    except Exception as e:  # the steps as last listed, then
        log.warning("could not list %s after the failed save: %s", store.directory, e)
        committed, unlisted = list(store.listed), e
    if lock is not None and unlisted is None:
        try:  # a writer that took over may have removed the step's files: the real cause
            lock.check()
        except LockedError as lost:
            error = lost
    return SaveError(
        step, error, committed, background=background, missing=missing, unlisted=unlisted
    )

"""Orbax's save machinery as jaxckpt meets it: its manager's background commit, its per-host
array metadata, the event and the barrier of a save whose writes are done."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath


def wait_for_background_commit(mngr: ocp.CheckpointManager) -> None:
    """Waits for a step's commit that Orbax runs in the background. `wait_until_finished`
    waits only for the manager's finalize thread, which its save starts last: when that save
    failed after starting the commit (a barrier meeting a dead process), only the manager's
    checkpointer knows of the commit still running."""
    mngr._checkpointer.wait_until_finished()


def forget_failed_save(mngr: ocp.CheckpointManager) -> None:
    """Once a failed save's error is raised (jaxckpt raises it as SaveError), Orbax's manager
    no longer raises it again from each later wait, `close` among them, until a new save:
    its finalize thread, which has ended, is let go."""
    mngr._finalize_thread.set(None)


def array_metadata_store() -> Any:
    """Orbax's default store of per-host ArrayMetadata (PRNG key impls among them), which an
    `ArrayHandler` built by hand has only when given it."""
    from orbax.checkpoint._src.metadata import array_metadata_store

    return array_metadata_store.Store()


def key_impls(item_dir: epath.Path) -> dict[str, str]:
    """The PRNG impl of each typed-key leaf of a plain Orbax pytree item, by leaf name:
    Orbax records it in the item's per-process ArrayMetadata (`array_metadatas/`), not in
    its tree metadata, which has the key data's uint32 shape only."""
    if not (item_dir / "array_metadatas").exists():
        return {}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # whatever loop the caller runs
        found = pool.submit(asyncio.run, array_metadata_store().read(item_dir)).result()
    per_process = found.values() if isinstance(found, dict) else [found or []]
    return {
        m.param_name: m.ext_metadata["random_key_impl"]
        for metas in per_process
        for m in metas
        if (m.ext_metadata or {}).get("random_key_impl")
    }


# Recorded (jax.monitoring) in Orbax's background save once this process's arrays of a step
# are written, before the barrier between processes and the commit.
WRITES_DONE_EVENT = "/jax/checkpoint/write/async/commit_duration_sec"


@contextlib.contextmanager
def on_writes_done(callback: Callable[[], None]) -> Iterator[None]:
    """Calls `callback()` in the background save each time this process's arrays of a step
    are written, before its commit: where tests and reliability trials kill, freeze or
    fail a writer, at that moment for sure rather than by timing."""

    def listener(event: str, duration_secs: float, **kwargs: str | int) -> None:
        if event == WRITES_DONE_EVENT:
            callback()

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


# The barrier of Orbax's background save that every process reaches once its own files of
# a step are written, before process 0 finalizes and commits the step.
WRITE_BARRIER = "async_write_complete"


def barrier_after_writes(
    hook: Callable[[], None], limit_ms: Callable[[], int | None]
) -> Callable[..., None]:
    """A `barrier_sync_fn` for Orbax's async options: Orbax's own barrier between the job's
    processes (`ocp.multihost.get_barrier_sync_fn`), calling `hook()` first at the barrier
    of a save whose writes are done (`WRITE_BARRIER`), on every process. Each waits at most
    `limit_ms()` (None: Orbax's timeout), what is left of the save's deadline: Orbax gives
    each barrier the whole timeout, so that two in a row, after a process stopped, waited
    twice as long. Orbax meets it only in a job of several processes."""

    def barrier(*, key: str, timeout_ms: int) -> None:
        if WRITE_BARRIER in key:
            hook()
        limit = limit_ms()
        timeout_ms = timeout_ms if limit is None else min(timeout_ms, limit)
        ocp.multihost.get_barrier_sync_fn()(key=key, timeout_ms=timeout_ms)

    return barrier

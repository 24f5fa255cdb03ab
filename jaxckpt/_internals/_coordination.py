"""JAX's coordination service below its public API: the job's key-value store and barriers,
the collectives counted, the processes a failed barrier names, the coordinator's route."""

from __future__ import annotations

import contextlib
import functools
import re
import socket
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import jax


def _coordination() -> Any:
    """The job's client of JAX's coordination service (`jax.distributed.initialize`'s),
    whose key-value store carries Orbax's barriers."""
    from jax._src import distributed

    return distributed.global_state.client


def publish(key: str, value: str) -> None:
    """Sets `key` in the job's key-value store (replacing what a failed save left there)."""
    _coordination().key_value_set(key, value, allow_overwrite=True)


def take(prefix: str) -> list[str]:
    """The values set below `prefix/` in the job's key-value store, which are deleted."""
    client = _coordination()
    found = client.key_value_dir_get(prefix + "/")
    client.key_value_delete(prefix)
    return [value for _, value in found]


def published(prefix: str) -> dict[str, str]:
    """The keys set below `prefix/` in the job's key-value store, and their values."""
    return dict(_coordination().key_value_dir_get(prefix + "/"))


def wait_for(key: str, timeout_ms: int) -> str | None:
    """`key`'s value in the job's key-value store, once set; None if it is not set within
    `timeout_ms` (JAX's DEADLINE_EXCEEDED)."""
    try:
        return str(_coordination().blocking_key_value_get(key, max(int(timeout_ms), 1)))
    except jax.errors.JaxRuntimeError as e:
        if "DEADLINE_EXCEEDED" in str(e):
            return None
        raise


def delete(key: str) -> None:
    """Deletes `key` (and the keys below `key/`) from the job's key-value store."""
    _coordination().key_value_delete(key)


def barrier(name: str, timeout_ms: int) -> None:
    """Waits until every process of the job reached the barrier `name` (each name once in a
    job), at most `timeout_ms`: then raises JAX's error, which `missing_processes` reads.
    A process that arrives at a barrier that already timed out gets the error at once."""
    _coordination().wait_at_barrier(name, max(int(timeout_ms), 1))


# What `count_collectives` counts: the collectives of JAX's multihost_utils (jaxckpt's and
# Orbax's, found as module attributes at each call) and the calls on the job's client of
# JAX's coordination service (Orbax's barriers, its key-value signals, jaxckpt's digests).
COLLECTIVES = (
    "process_allgather",
    "broadcast_one_to_all",
    "sync_global_devices",
    "reached_preemption_sync_point",
)
CLIENT_CALLS = (
    "wait_at_barrier",
    "key_value_set",
    "key_value_set_bytes",
    "blocking_key_value_get",
    "blocking_key_value_get_bytes",
    "key_value_try_get",
    "key_value_dir_get",
    "key_value_delete",
    "key_value_increment",
)


@contextlib.contextmanager
def count_collectives() -> Iterator[Counter[str]]:
    """Counts, by name, this process's collectives and coordination-service calls while the
    block runs, on every thread (benchmarks/scale.py's counts per save and per restore). A
    collective is counted once, not again for the collectives it makes itself
    (`sync_global_devices` gathers with `process_allgather`). Orbax objects built before the
    block that keep the client (a manager's barrier function) are not counted."""
    from jax._src import distributed
    from jax.experimental import multihost_utils

    counts: Counter[str] = Counter()
    inside = threading.local()

    def counted(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            depth = getattr(inside, "depth", 0)
            if depth == 0:
                counts[name] += 1
            inside.depth = depth + 1
            try:
                return fn(*args, **kwargs)
            finally:
                inside.depth = depth

        return call

    originals = {name: getattr(multihost_utils, name) for name in COLLECTIVES}
    client = distributed.global_state.client
    for name, fn in originals.items():
        setattr(multihost_utils, name, counted(name, fn))
    if client is not None:
        distributed.global_state.client = _CountingClient(client, counted)
    try:
        yield counts
    finally:
        for name, fn in originals.items():
            setattr(multihost_utils, name, fn)
        distributed.global_state.client = client


class _CountingClient:
    """The coordination-service client, each of `CLIENT_CALLS` counted; the rest as it is."""

    def __init__(self, client: Any, counted: Callable[..., Any]) -> None:
        self._client = client
        for name in CLIENT_CALLS:
            setattr(self, name, counted(name, getattr(client, name)))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


def missing_processes(error: BaseException) -> list[int]:
    """The processes a multi-host barrier waited for in vain, as JAX's coordination service
    names them: after the barrier timeout, or after a dead task's heartbeat timeout."""
    text = str(error)
    found = re.search(r"timed out task names:\s*([\d\s,]+)", text)
    tasks = re.findall(r"\d+", found.group(1)) if found else []
    tasks += re.findall(r"Task (\d+) heartbeat timeout", text)
    return sorted({int(t) for t in tasks})


def coordinator_route() -> str:
    """This host's address towards JAX's coordinator (`jax.distributed.initialize`'s): the
    address its peers reach it at (127.0.0.1 in a job on one machine). No packet is sent:
    a UDP socket's connect only picks the route."""
    from jax._src import distributed

    address = distributed.global_state.coordinator_address
    if not address:
        return "127.0.0.1"
    host, _, port = address.rpartition(":")
    family, kind, proto, _, where = socket.getaddrinfo(
        host.strip("[]"), int(port), type=socket.SOCK_DGRAM
    )[0]
    with socket.socket(family, kind, proto) as s:
        s.connect(where)
        return s.getsockname()[0]

"""Every private Orbax or JAX name jaxckpt uses, and every text of theirs it reads that they
do not promise, is in this package and nowhere else: tests/test_orbax_boundary.py fails by
name when an upgrade removes one (the log texts are checked by tests/test_cli_messages.py,
the text of JAX's coordination-service errors where a real process dies, in
tests/test_multihost.py). Everything else talks to Orbax and JAX through their public API,
and to this package through the names below.

- `_saves`: Orbax's manager and handlers as a save meets them (its background commit, its
  per-host array metadata, the event and the barrier after a save's writes);
- `_arrays`: JAX's arrays (single-device buffers, batched placement, zero-copy host buffers);
- `_coordination`: JAX's coordination service (key-value store, barriers, counts);
- `_wraps`: Orbax's functions wrapped process-wide, all by `install()`, which
  `jaxckpt._orbax.OrbaxStore` alone calls.
"""

from jaxckpt._internals._arrays import device_buffers, host_buffer, put_batched
from jaxckpt._internals._coordination import (
    CLIENT_CALLS,
    COLLECTIVES,
    barrier,
    coordinator_route,
    count_collectives,
    delete,
    missing_processes,
    publish,
    published,
    take,
    wait_for,
)
from jaxckpt._internals._saves import (
    WRITE_BARRIER,
    WRITES_DONE_EVENT,
    array_metadata_store,
    barrier_after_writes,
    forget_failed_save,
    key_impls,
    on_writes_done,
    wait_for_background_commit,
)
from jaxckpt._internals._wraps import install, own, writers_held

__all__ = [
    "CLIENT_CALLS",
    "COLLECTIVES",
    "WRITES_DONE_EVENT",
    "WRITE_BARRIER",
    "array_metadata_store",
    "barrier",
    "barrier_after_writes",
    "coordinator_route",
    "count_collectives",
    "delete",
    "device_buffers",
    "forget_failed_save",
    "host_buffer",
    "install",
    "key_impls",
    "missing_processes",
    "on_writes_done",
    "own",
    "publish",
    "published",
    "put_batched",
    "take",
    "wait_for",
    "wait_for_background_commit",
    "writers_held",
]

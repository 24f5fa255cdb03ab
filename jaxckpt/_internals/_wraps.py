"""Orbax's functions jaxckpt wraps, process-wide: all of them by `install`, once, from the
one place that calls it (`jaxckpt._orbax.OrbaxStore`, before its first save or read). Each
wrap changes only what happens below jaxckpt's own directories, or changes nothing a
caller can see (`aligned_reads`)."""

from __future__ import annotations

import contextlib
import functools
import logging
import re
import threading
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
from etils import epath

from jaxckpt._internals._arrays import host_buffer

log = logging.getLogger("jaxckpt")
_installed = False


def install() -> None:
    """Every wrap below, once in the process."""
    global _installed
    if _installed:
        return
    logging.getLogger("absl").addFilter(_demote_orbax_noise)
    _checksums()
    _wakes()
    _object_kvstores()
    _aligned_reads()
    _installed = True


def own(directory: epath.Path) -> None:
    """`directory` is one jaxckpt writes: arrays below it get per-chunk checksums, and a
    save's failed folder creation below it wakes its writers."""
    _OWN.add(str(directory).rstrip("/") + "/")


# Orbax logs through absl's logger: two warnings for every read-only manager, and a
# traceback per thread for a save that failed in the background, which jaxckpt raises
# itself as SaveError by the next save/wait/close. These known messages go to the debug
# log (`logging.getLogger("jaxckpt.orbax").setLevel(logging.DEBUG)` shows them); every
# other Orbax message passes unchanged.
_ORBAX_NOISE = re.compile(
    r"CheckpointManagerOptions\.read_only=True, setting save_interval_steps=0"
    r"|Given directory is read only="
    r"|Failed to run \d+ Handler Commit operations or the Commit callback in background"
    r"|_SignalingThread\.run\(\) raised an exception"
    r"|Save Finalize thread \(\w+\) failed"
    r"|Checkpointer failed: one or more items may not be finalized"
)
_orbax_debug_log = log.getChild("orbax")


def _demote_orbax_noise(record: logging.LogRecord) -> bool:
    """A filter on absl's logger: the known messages above are handed to jaxckpt.orbax's
    handlers at DEBUG level (if enabled there) instead of absl's; all else passes."""
    try:
        noise = bool(_ORBAX_NOISE.search(record.getMessage()))
    except Exception:  # a record whose arguments do not format: not ours to judge
        return True
    if not noise:
        return True
    if _orbax_debug_log.isEnabledFor(logging.DEBUG):
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        _orbax_debug_log.handle(record)
    return False


# jaxckpt's own persistent directories (`own`), below which Orbax writes arrays with a
# CRC-32C on every chunk (`_checksums`: a restore then reads each byte once, tensorstore
# checking every chunk it decodes, instead of hashing the files beside) and wakes a save's
# writers when its folders cannot be made (`_wakes`).
_OWN: set[str] = set()


def _is_own(path: Any) -> bool:
    return (str(path).rstrip("/") + "/").startswith(tuple(_OWN))


CHUNK_CHECKSUM = {"name": "crc32c"}


def _checksums() -> None:
    """Orbax's zarr3 arrays saved below an `own` directory carry a CRC-32C per chunk
    (the zarr3 `crc32c` codec, last in each chunk's codecs: plain Orbax and tensorstore
    read them as they are). Orbax builds every array's spec in one function and offers no
    option for the chunks' codecs (only its shard index gets a checksum): that function is
    wrapped, and changes only the specs of arrays below such a directory."""
    from orbax.checkpoint._src.serialization import tensorstore_utils

    build = tensorstore_utils.build_array_write_spec

    @functools.wraps(build)
    def with_checksums(info: Any, *args: Any, **kwargs: Any) -> Any:
        spec = build(info, *args, **kwargs)
        if _is_own(info.parent_dir):
            _add_chunk_checksum(spec.json)
        return spec

    tensorstore_utils.build_array_write_spec = with_checksums


def _add_chunk_checksum(tspec: dict[str, Any]) -> None:
    """A CRC-32C last in the chunk codecs of a zarr3 write spec (a `cast` spec: its base's)."""
    while tspec.get("driver") == "cast":
        tspec = tspec["base"]
    for codec in tspec.get("metadata", {}).get("codecs", []):
        if codec.get("name") == "sharding_indexed":
            codecs = codec["configuration"]["codecs"]
            if CHUNK_CHECKSUM not in codecs:
                codecs.append(dict(CHUNK_CHECKSUM))


class WritersHeld:
    """`writers_held`'s hold: `parked` is set once a save's folder creation waits for it."""

    def __init__(self) -> None:
        self.released, self.parked = threading.Event(), threading.Event()


_HELD = threading.local()  # the hold of the save whose blocking part runs in this thread


@contextlib.contextmanager
def writers_held() -> Iterator[WritersHeld]:
    """A save below a directory `wake_on_failed_creation` wrapped, started in this block in
    this thread, makes its folders (and so starts its writers, which wait for them) once the
    block exits: the save's background then never competes with its blocking part.

    On two cores, the writers' threads (their event loops, then tensorstore's copies) took
    the GIL and the CPU from the blocking part as soon as the folders existed: the blocking
    time of the 1 GiB AdamW state was ~2.5x the main thread's own CPU time (32 ms of 12.6;
    15.5 ms held), which is what a save's blocking time is made of on the host."""
    hold = WritersHeld()
    _HELD.value = hold
    try:
        yield hold
    finally:
        _HELD.value = None
        hold.released.set()


def _wakes() -> None:
    """A save below an `own` directory whose step or item folders cannot be made wakes every thread
    that waits for them, which then fails at once, instead of after Orbax's 300 s; a save
    started in `writers_held` makes them once the hold is released.

    Orbax makes a step's folders in a background thread (off the save's blocking path, which
    jaxckpt's save returns from sooner for it). Each writer thread of the save, and the
    item folders' creation, waits for the folders' "created" signal first, for Orbax's
    coordination timeout (300 s), and a failed creation never sends it: those (non-daemon)
    threads kept a process alive five minutes after a failed save. Orbax makes every step's
    and item's folders in one coroutine (`atomicity._create_paths`), started by
    `atomicity.create_all_async`, which knows the signals: both are wrapped once, and a
    failure below such a directory sends its signals before it is raised. The writers then
    fail on the missing folders, and the creation's own error is the save's."""
    from orbax.checkpoint._src.futures import future, synchronization
    from orbax.checkpoint._src.path import atomicity

    create_all_async = atomicity.create_all_async
    create_paths = atomicity._create_paths
    signals_now = threading.local()  # the signals of the create_all_async call in progress

    @functools.wraps(create_all_async)
    def creating(paths: Any, completion_signals: Any, *args: Any, **kwargs: Any) -> Any:
        ours = any(_is_own(p.get_final()) for p in paths)
        signals_now.value = completion_signals if ours else None
        try:
            return create_all_async(paths, completion_signals, *args, **kwargs)
        finally:
            signals_now.value = None

    @functools.wraps(create_paths)
    def create_or_wake(*args: Any, **kwargs: Any) -> Any:
        signals = getattr(signals_now, "value", None)
        operation = synchronization.OperationIdGenerator.get_current_operation_id()
        hold = getattr(_HELD, "value", None) if signals else None

        async def run() -> Any:  # in a thread of its own, on an event loop of its own
            try:
                if hold is not None:
                    hold.parked.set()
                    hold.released.wait()
                return await create_paths(*args, **kwargs)
            except BaseException:
                if signals:
                    future.set_signals(signals, operation_id=operation)
                raise

        return run()

    atomicity.create_all_async = creating
    atomicity._create_paths = create_or_wake


def _object_kvstores() -> None:
    """Orbax reads and writes gs:// and s3:// directories through tensorstore kvstores that
    give up on a store that does not answer (`_store_errors.tensorstore_context`), and
    s3:// ones through tensorstore's s3 driver, from now on.

    Orbax builds the kvstore spec of every folder it reads or writes in one function, which
    knows only gs:// and local paths (google/orbax#359): an s3:// path was refused as a
    relative local one. That function is wrapped once: an s3:// directory's spec is built
    as the gs:// one of the same bucket and key (OCDBT over an object store: no file locks,
    Orbax's read coalescing), then each GCS driver in it becomes `_storage.s3_kvstore`'s;
    each driver of a store gets the context of its attempts. (tensorstore tried a request
    32 times, up to 32 s apart, and curl had no limit: a frozen store held a restore for
    ever.)"""
    from orbax.checkpoint._src.serialization import tensorstore_utils

    build = tensorstore_utils.build_kvstore_tspec

    @functools.wraps(build)
    def bounded(directory: Any, *args: Any, **kwargs: Any) -> Any:
        text = str(directory)
        if text.startswith("s3://"):
            spec = build(f"gs://{text.removeprefix('s3://')}", *args, **kwargs)
            return _with_context(_gcs_to_s3(spec))
        return _with_context(build(directory, *args, **kwargs))

    tensorstore_utils.build_kvstore_tspec = bounded


def _gcs_to_s3(spec: Any) -> Any:
    """A kvstore spec with each of its GCS drivers (`{"driver": "gcs", "bucket", "path"}`)
    replaced by the s3 one of the same bucket and path."""
    from jaxckpt._storage import s3_kvstore

    if isinstance(spec, list):
        return [_gcs_to_s3(s) for s in spec]
    if not isinstance(spec, dict):
        if isinstance(spec, str) and spec.startswith("gs://"):
            raise ValueError(f"an Orbax kvstore spec names {spec!r}: no s3:// for it")
        return spec
    if spec.get("driver") in ("gcs", "gcs_grpc"):
        return s3_kvstore(f"s3://{spec['bucket']}/{spec.get('path', '')}")
    return {key: _gcs_to_s3(value) for key, value in spec.items()}


def _with_context(spec: Any) -> Any:
    """A kvstore spec with each gcs or s3 driver in it given the context of its attempts
    (`_store_errors.tensorstore_context`; one the spec has already is kept)."""
    from jaxckpt._store_errors import tensorstore_context

    if isinstance(spec, list):
        return [_with_context(s) for s in spec]
    if not isinstance(spec, dict):
        return spec
    spec = {key: _with_context(value) for key, value in spec.items()}
    if spec.get("driver") in ("gcs", "s3") and "context" not in spec:
        spec["context"] = tensorstore_context("s3" if spec["driver"] == "s3" else "gs")
    return spec


def _aligned_reads() -> None:
    """Orbax reads each shard of an array into a host buffer of its own, `np.zeros` in
    `serialization._read_shard`, which `jax.device_put` then copies onto a CPU device (its
    address is 16-byte aligned, not `_arrays.CPU_ALIGNMENT`): a restore held each shard
    twice, and its staging was freed memory the allocator kept. Where the devices are CPU
    devices the wrap reads it into a `_arrays.host_buffer` instead, which becomes the
    device's buffer: a restore reads each byte once into its final place. (On an
    accelerator the buffer is staging, copied onto the device: Orbax's own, reused from the
    heap.) It reads as Orbax's does; a shard Orbax casts goes through Orbax's."""
    import tensorstore as ts
    from orbax.checkpoint._src.serialization import serialization

    read_shard = serialization._read_shard

    @functools.wraps(read_shard)
    async def aligned(
        t: Any,
        *,
        new_shard_shape: Any,
        dtype: Any,
        requested_domain: Any,
        restricted_domain: Any,
    ) -> np.ndarray:
        stored = t.dtype.numpy_dtype
        if jax.default_backend() != "cpu" or (dtype is not None and np.dtype(dtype) != stored):
            return await read_shard(
                t,
                new_shard_shape=new_shard_shape,
                dtype=dtype,
                requested_domain=requested_domain,
                restricted_domain=restricted_domain,
            )
        out = host_buffer(tuple(new_shard_shape), stored)
        if tuple(restricted_domain.shape) != out.shape:  # stored smaller: the rest is zeros
            out.fill(0)
        where = ts.array(out)[ts.d[:].translate_to[requested_domain.origin]][restricted_domain]
        await where.write(t[restricted_domain])
        return out

    serialization._read_shard = aligned

"""Every private Orbax or JAX name jaxckpt uses, and every text of theirs it reads that they
do not promise, is here and nowhere else: tests/test_orbax_boundary.py fails by name when an
upgrade removes one (the text of JAX's coordination-service errors where a real process
dies is checked in tests/test_multihost.py). Everything else talks to Orbax and JAX
through their public API; the messages Orbax logs that jaxckpt demotes are
`_orbax_log`'s, which matches them only.

In four parts: Orbax's handlers and async save as a save meets them; JAX's arrays (single-device
buffers, batched placement, zero-copy placement on CPU); JAX's coordination service (key-value
store, barriers, counts); and Orbax's functions wrapped, all by `install()`, once, which
`jaxckpt._orbax.OrbaxStore` alone calls. Each wrap changes only what happens below a
directory jaxckpt has open (`hold`), and calls Orbax's own function as it is for every
other: a user's own Orbax saves and restores in the same process (an eval checkpoint, a
data iterator's) run as they run without jaxckpt.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import re
import socket
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from jaxckpt import _orbax_log
from jaxckpt._host_buffers import host_buffer
from jaxckpt._retries import with_store_context
from jaxckpt._s3_endpoint import gcs_to_s3

# --- Orbax's saves ---------------------------------------------------------------------


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
    hook: Callable[[], None], limit_ms: Callable[[], int | None], failed: Callable[[], None]
) -> Callable[..., None]:
    """A `barrier_sync_fn` for Orbax's async options: Orbax's own barrier between the job's
    processes (`ocp.multihost.get_barrier_sync_fn`), calling `hook()` first at the barrier
    of a save whose writes are done (`WRITE_BARRIER`), on every process. Each waits at most
    `limit_ms()` from this process's arrival (None: Orbax's timeout, which counts from the
    start of the background save, this process's own writes included); `failed()` is
    called when one times out, before its error is raised. Orbax meets it only in a job of
    several processes."""

    def barrier(*, key: str, timeout_ms: int) -> None:
        if WRITE_BARRIER in key:
            hook()
        limit = limit_ms()
        timeout_ms = timeout_ms if limit is None else min(timeout_ms, limit)
        try:
            ocp.multihost.get_barrier_sync_fn()(key=key, timeout_ms=timeout_ms)
        except Exception:
            failed()
            raise

    return barrier


# --- JAX's arrays --------------------------------------------------------------------


def device_buffers(array: jax.Array) -> list[jax.Array]:
    """An array's addressable single-device arrays, in the order of `addressable_shards`,
    in one call: `addressable_shards` builds a Shard (its index, its replica id) for each,
    and `addressable_data(i)` all of them for each i; at thousands of small leaves either
    doubled the save's blocking time."""
    # (jax.Array is abstract: its one implementation, jax's ArrayImpl, holds `_arrays`)
    return array._arrays  # type: ignore[attr-defined]


def put_batched(hosts: list[np.ndarray], sharding: jax.sharding.Sharding) -> list[jax.Array]:
    """Host arrays of canonical dtypes onto one sharding of this process's devices: the
    per-array step of `jax.device_put(hosts, sharding)` without its per-array checks and
    abstractions, which were ~40% of placing thousands of small leaves."""
    from jax._src.interpreters import pxla

    out = []
    for host in hosts:
        devices, slices = _device_slices(sharding, host.shape)
        aval = _aval(host.shape, host.dtype)
        out.append(pxla.batched_device_put(aval, sharding, [host[i] for i in slices], devices))
    return out


@functools.lru_cache(maxsize=1024)
def _device_slices(sharding: jax.sharding.Sharding, shape: tuple[int, ...]) -> tuple:
    """This process's devices of `sharding` and the index of each one's shard of `shape`
    (the caller must not change the list)."""
    indices = sharding.addressable_devices_indices_map(shape)
    return list(indices), tuple(indices.values())


@functools.lru_cache(maxsize=1024)
def _aval(shape: tuple[int, ...], dtype: np.dtype) -> Any:
    from jax._src import core

    return core.ShapedArray(shape, dtype)


# --- JAX's coordination service --------------------------------------------------------


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
    names them: after the barrier timeout, or after a dead task's heartbeat timeout (in
    `error` or the errors it was raised from: Orbax raises its own TimeoutError from JAX's)."""
    chain: list[BaseException] = []
    found_error: BaseException | None = error
    while found_error is not None and found_error not in chain:
        chain.append(found_error)
        found_error = found_error.__cause__ or found_error.__context__
    text = " ".join(map(str, chain))
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


# --- Orbax's functions wrapped, below jaxckpt's open directories only -------------------

_installed = False


def install() -> None:
    """Every wrap below, once in the process."""
    global _installed
    if _installed:
        return

    _orbax_log.demote_noise(_names_open)
    _checksums()
    _wakes()
    _object_kvstores()
    _aligned_reads()
    _installed = True


def hold(directory: Any, *, written: bool) -> Callable[[], None]:
    """`directory` is open in jaxckpt (a manager's, a reader's) until the returned function
    is called: below it Orbax's kvstores on object storage are bounded and s3:// ones made
    (`_object_kvstores`), and a shard is read into its device's own buffer on CPU
    (`_aligned_reads`); if `written`, arrays written below it get per-chunk checksums
    (`_checksums`) and a save's failed folder creation wakes its writers (`_wakes`)."""
    key = str(directory).rstrip("/") + "/"
    held = [_OPEN] + ([_WRITTEN] if written else [])
    with _HELD_LOCK:
        for counts in held:
            counts[key] += 1

    def release() -> None:
        with _HELD_LOCK:
            for counts in held:
                counts[key] -= 1
                if counts[key] <= 0:
                    del counts[key]
        held.clear()  # (once)

    return release


# The directories open in jaxckpt, and of those the ones it writes, each counted by the
# stores that hold it (`hold`). Below a written one Orbax writes arrays with a CRC-32C on
# every chunk (a restore then reads each byte once, tensorstore checking every chunk it
# decodes, instead of hashing the files beside).
_OPEN: Counter[str] = Counter()
_WRITTEN: Counter[str] = Counter()
_HELD_LOCK = threading.Lock()


def _held(counts: Counter[str]) -> tuple[str, ...]:
    """The directories `counts` holds now (read under the lock: a store opens or closes in
    another thread)."""
    with _HELD_LOCK:
        return tuple(counts)


def _below(path: Any, counts: Counter[str]) -> bool:
    return (str(path).rstrip("/") + "/").startswith(_held(counts))


def _names_open(text: str) -> bool:
    """Whether `text` (a message of Orbax's) names a path below a directory jaxckpt has open."""
    return any(directory in text for directory in _held(_OPEN))


def _is_own(path: Any) -> bool:
    return _below(path, _WRITTEN)


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
    """Orbax reads and writes gs:// and s3:// directories jaxckpt has open through
    tensorstore kvstores that try a store that fails for a moment again, for a time
    (`_retries.with_store_context`), and s3:// ones through tensorstore's s3 driver.

    Orbax builds the kvstore spec of every folder it reads or writes in one function, which
    knows only gs:// and local paths (google/orbax#359): an s3:// path was refused as a
    relative local one. That function is wrapped once: an s3:// directory's spec is built
    as the gs:// one of the same bucket and key (OCDBT over an object store: no file locks,
    Orbax's read coalescing), then each GCS driver in it becomes `_s3_endpoint.s3_kvstore`'s;
    each driver of a store gets the context of its attempts. (tensorstore tried a request
    32 times, up to 32 s apart, and curl had no limit: a frozen store held a restore for
    ever.)"""
    from orbax.checkpoint._src.serialization import tensorstore_utils

    build = tensorstore_utils.build_kvstore_tspec

    @functools.wraps(build)
    def bounded(directory: Any, *args: Any, **kwargs: Any) -> Any:
        text = str(directory)
        if not _below(text, _OPEN):
            return build(directory, *args, **kwargs)
        if text.startswith("s3://"):
            spec = build(f"gs://{text.removeprefix('s3://')}", *args, **kwargs)
            return with_store_context(gcs_to_s3(spec))
        return with_store_context(build(directory, *args, **kwargs))

    tensorstore_utils.build_kvstore_tspec = bounded


def _aligned_reads() -> None:
    """Orbax reads each shard of an array into a host buffer of its own, `np.zeros` in
    `serialization._read_shard`, which `jax.device_put` then copies onto a CPU device (its
    address is 16-byte aligned, not `CPU_ALIGNMENT`): a restore held each shard
    twice, and its staging was freed memory the allocator kept. Where the devices are CPU
    devices the wrap reads it into a `host_buffer` instead, which becomes the
    device's buffer: a restore reads each byte once into its final place. (On an
    accelerator the buffer is staging, copied onto the device: Orbax's own, reused from the
    heap.) It reads as Orbax's does; a shard Orbax casts, or one of a directory jaxckpt
    does not have open, goes through Orbax's."""
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
        if (
            jax.default_backend() != "cpu"
            or (dtype is not None and np.dtype(dtype) != stored)
            or not _below(_store_url(t), _OPEN)
        ):
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


_SCHEMES = {"file": "", "gcs": "gs://", "s3": "s3://"}  # tensorstore's drivers, as URLs


def _store_url(t: Any) -> str:
    """Where the tensorstore `t` reads: its kvstore's (an OCDBT one's, its base's) path or
    URL, as jaxckpt names a directory (`/tmp/run/`, `gs://b/run/`); "" for another kind of
    store. (Its spec, not its `url`: an s3 driver with an endpoint has none.)"""
    kvstore = t.kvstore
    while kvstore is not None and kvstore.base is not None:
        kvstore = kvstore.base
    spec = {} if kvstore is None else kvstore.spec().to_json()
    scheme = _SCHEMES.get(str(spec.get("driver")))
    if scheme is None:
        return ""
    bucket = f"{spec['bucket']}/" if "bucket" in spec else ""
    return f"{scheme}{bucket}{spec.get('path', '')}"


# --- end of Orbax's and JAX's internals -------------------------------------------------

"""Small leaves packed per process (format 2): the one owner of the packed files, and
their writing (`jaxckpt._packed_read` reads them).

Orbax and tensorstore write each leaf as an array of its own, and each array costs a few
milliseconds to save and to restore whatever its size (BENCHMARKS.md, leaf-count sweep).
A leaf of at most MAX_LEAF_BYTES is instead copied off the devices with the rest and
written, with every other small leaf this process holds, into one file of bytes:

    <step>/packed/<i>-of-<n>.bin     process i's pieces, back to back
    <step>/packed/<i>-of-<n>.json    their index: {"format": 2, "bytes": size, "leaves":
                                     {item: {name: {"dtype": ..., "shape": [...],
                                      "pieces": [[offset, [[start, stop], ...], xxh3],
                                                 ...]}}}}
    <step>/packed/index.json         in a job of several processes: every process's index
                                     ({"format": 2, "indexes": [index of 0, ...]}),
                                     written by process 0 at the commit, read instead

A piece is one distinct shard of a leaf, written once in the job by the least-loaded of the
processes holding it (all choose alike: N replicas write ~1/N each), or the whole leaf
where this process holds all of it; with the XXH3-64 of its bytes, checked as it is read
(format 1: none). A reader takes the pieces that overlap what its devices need, from any
process's file: a step restores onto any mesh and process count, as Orbax's arrays do.
Files are written in the save's background, inside the step's temporary folder, so Orbax's
commit and jaxckpt's manifest cover them.

Format 3 (an incremental step, `jaxckpt._incremental`): every leaf is packed, each digest is
an XXH3-128 (the manifest's hash), a process's pieces spread over up to MAX_FILES files
(`<i>-of-<n>.bin`, `<i>-of-<n>.<k>.bin`), and a piece whose bytes the newest committed step
already holds is not written again: its entry names where they are, `[offset, bounds,
xxh3-128, owner step, file]`, the step whose packed folder holds them (always the one that
wrote them: a reference never leads to another reference; a piece in another of the step's
own files names the step itself). With `compression="zstd"` the index says `"codec":
"zstd"` and each piece is one zstd frame of its bytes (`jaxckpt._codec`), its offset
`[offset, stored bytes]`; its digest is of the raw bytes, so what is unchanged does not
depend on the codec, and a step refers only to pieces stored as its own are.

A reader trusts no claim of an index until it is checked against the index itself and the
files' real sizes, before it allocates or reads anything of a leaf's size (an index may
claim TiBs for a file of KiBs, and `diff` reads without verifying the manifest first):
each piece lies within its file, which holds at least the bytes its index claims; no two
pieces of a file share a byte; and a leaf's pieces are each one cell of the grid their
bounds cut, no cell twice, with the leaf's volume together: they hold each element once.
So a leaf's bytes are at most its files' real bytes. All of it costs O(pieces log pieces).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import itertools
import json
import math
import queue
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol, Self, TypeVar

import jax
import numpy as np
import xxhash
from etils import epath

from jaxckpt import _codec
from jaxckpt._integrity import hasher
from jaxckpt._layout import PACKED, PACKED_INDEX, packed_files
from jaxckpt._plan import holders
from jaxckpt._storage import file_sizes, is_remote, read_small, write_file
from jaxckpt._tiling import bounds_of, within
from jaxckpt._tree import dtype_name

MAX_LEAF_BYTES = 2**20  # a leaf of at most this many bytes (all shards) is packed
INDEX_FORMAT = 2  # format 1 (read too): pieces without digests
INCREMENTAL_FORMAT = 3  # every leaf packed, XXH3-128 digests, pieces shared with earlier steps


def piece_digest(data: Any, version: int) -> str:
    """A piece's digest in an index of `version`: XXH3-64 (format 2), XXH3-128 (format 3,
    the manifest's own hash: what decides that a piece is unchanged is no weaker)."""
    if version >= INCREMENTAL_FORMAT:
        return xxhash.xxh3_128_hexdigest(data)
    return xxhash.xxh3_64_hexdigest(data)


def is_small(value: Any) -> bool:
    """Whether a leaf to save is packed rather than written as an array of its own."""
    return value.size * value.dtype.itemsize <= MAX_LEAF_BYTES  # (jax's nbytes: ~1 us)


# --- saving --------------------------------------------------------------------------------


@dataclasses.dataclass
class HostPieces:
    """This process's pieces of the leaves it packs, on the host: what the background
    writes. `leaves`: (item, name, dtype, shape, [bounds, ...], value) each, `value` the
    jax.Array saved (None: a NumPy leaf, or not kept); `chunks` hold the pieces' bytes in
    order: a piece's array, or (shape, dtype, plan, shards) for a leaf this process holds
    whole in shards, assembled into one piece in the background; none for a leaf whose
    every piece the newest committed step holds (`same`: (item, name) of those, the same
    jax.Array object as that step saved). (Few objects a leaf: each one made while the
    save blocks is one more for Python's next garbage collection to walk.)"""

    leaves: list[tuple]
    chunks: list[Any]
    same: frozenset[tuple[str, str]] = frozenset()


def index_json(
    version: int,
    leaves: Iterable[tuple],
    entries: Iterable[list],
    size: int,
    codec: str | None = None,
) -> str:
    """An index of `version`: `leaves` as in `HostPieces.leaves`, `entries` each piece's
    entry in order past its bounds (`[offset, digest]`, or `[offset, digest, owner, file]`
    for one in another data file; a compressed piece's offset is `[offset, stored bytes]`,
    under `"codec"`). Made as text, leaf by leaf: as a dict and lists a leaf, at thousands
    of leaves it set off the garbage collector's full passes in the save's background
    (35 ms made 330 ms), holding the GIL the training step needs."""
    found = iter(entries)
    items: dict[str, list[str]] = {}
    for item, name, dtype, shape, pieces, _ in leaves:
        text = ",".join(_piece_json(bounds, next(found)) for bounds in pieces)
        items.setdefault(item, []).append(
            f'{json.dumps(name)}:{{"dtype":"{dtype_name(dtype)}",'
            f'"shape":[{",".join(map(str, shape))}],"pieces":[{text}]}}'
        )
    body = ",".join(f"{json.dumps(item)}:{{{','.join(e)}}}" for item, e in items.items())
    tag = f'"codec":"{codec}",' if codec else ""
    return f'{{"format":{version},{tag}"bytes":{size},"leaves":{{{body}}}}}'


def _piece_json(bounds: Bounds, entry: list) -> str:
    offset, digest, *owner = entry
    at = ",".join(f"[{a},{b}]" for a, b in bounds)
    tail = f',{owner[0]},"{owner[1]}"' if owner else ""
    place = f"[{offset[0]},{offset[1]}]" if isinstance(offset, list) else offset
    return f'[{place},[{at}],"{digest}"{tail}]'


def _whole(chunk: Any) -> np.ndarray:
    if isinstance(chunk, np.ndarray):
        return chunk
    shape, dtype, plan, shards = chunk
    parts = ((bounds, shard) for (_, bounds), shard in zip(plan, shards, strict=True))
    return filled(shape, dtype, parts)


def filled(shape: tuple[int, ...], dtype: np.dtype, parts: Iterable[tuple]) -> np.ndarray:
    """An array of `shape` with each (bounds, values) part in its place (the rest unset)."""
    host = np.empty(shape, dtype)
    for bounds, values in parts:
        host[_slices(bounds)] = values
    return host


Bounds = tuple[tuple[int, int], ...]


class EarlierPieces(Protocol):
    """The pieces an incremental save writes against (`_incremental.SavedPieces` is one):
    where each of the earlier step's pieces is, and the base this save makes."""

    def entry(self, item: str, name: str, bounds: Bounds) -> list: ...

    def held(
        self, item: str, name: str, dtype: np.dtype, shape: tuple[int, ...], bounds: Bounds
    ) -> list | None: ...

    def next(self, step: int, data_file: str, leaves: Iterable[tuple], entries: list) -> Self: ...


B = TypeVar("B", bound=EarlierPieces)


@functools.lru_cache(maxsize=4096)
def _slices(bounds: Bounds) -> tuple[slice, ...]:
    """The index of the region `bounds` (the same few a save's thousands of leaves share)."""
    return tuple(slice(a, b) for a, b in bounds)


@dataclasses.dataclass(frozen=True)
class _Plan:
    """What `_piece_plan` works out once per (sharding, shape, dtype)."""

    everything: list[tuple[int, Bounds]]  # each distinct shard here: (position, bounds)
    own: list[tuple[int, Bounds]]  # of those, the ones only this process holds
    # those several hold, a large one cut in as many (`_cut`): (position, or (position,
    # index within that shard), or None where not held here; bounds, bytes, holders)
    shared: list[tuple]
    alone: np.ndarray  # the bytes of the shards each process alone holds
    here: bool  # fully addressable: this process holds all of it
    whole: bool  # held here in more than one piece: assembled into one
    nbytes: int  # the leaf's


_PIECE_PLANS: dict[tuple, _Plan] = {}


def _piece_plan(value: jax.Array, local: bool, loads: np.ndarray) -> tuple[list, _Plan]:
    """Which of the array's addressable shards this process writes, by position, with the
    bounds of each: with `local` the first it holds of each distinct shard; otherwise those
    it alone holds, and of those several hold the ones it is the `_writer` of (`loads`: the
    bytes each process writes, counted alike by all). Cached per sharding, shape and dtype,
    so that a leaf costs the save's blocking path only its shards held by several."""
    key = (value.sharding, value.shape, value.dtype)
    plan = _PIECE_PLANS.get(key)
    if plan is None:
        plan = _PIECE_PLANS[key] = _new_plan(value, len(loads))
        if len(_PIECE_PLANS) > 1024:
            _PIECE_PLANS.clear()
    if local or plan.here:
        return plan.everything, plan
    loads += plan.alone
    me = jax.process_index()
    mine = [(at, box) for at, box, n, among in plan.shared if _writer(loads, n, among) == me]
    return plan.own + mine, plan


def _new_plan(value: jax.Array, processes: int) -> _Plan:
    mine: dict[Bounds, int] = {}
    for i, shard in enumerate(value.addressable_shards):
        mine.setdefault(bounds_of(shard.index, value.shape), i)
    everything = [(i, bounds) for bounds, i in mine.items()]
    shape, itemsize = value.shape, np.dtype(value.dtype).itemsize
    nbytes = math.prod(shape) * itemsize
    if value.is_fully_addressable:
        whole = len(everything) > 1 or everything[0][1] != _all(shape)
        return _Plan(everything, [], [], np.zeros(0, np.int64), True, whole, nbytes)
    alone, own, shared = np.zeros(processes, np.int64), [], list[tuple[Any, ...]]()
    for bounds, holding in holders(value.sharding, value.shape).items():  # all of them
        if len(holding) > 1:
            at = mine.get(bounds)
            for cut in _cut(bounds, len(holding)) if nbytes > MAX_LEAF_BYTES else [bounds]:
                part = at if at is None or cut == bounds else (at, within(cut, bounds))
                size = math.prod(b - a for a, b in cut) * itemsize
                shared.append((part, cut, size, np.array(holding)))
            continue
        alone[holding[0]] += math.prod(b - a for a, b in bounds) * itemsize
        if holding[0] == jax.process_index():
            own.append((mine[bounds], bounds))
    return _Plan(everything, own, shared, alone, False, False, nbytes)


def _cut(bounds: Bounds, parts: int) -> list[Bounds]:
    """A large shard several processes hold, as `parts` runs of its first dimension longer
    than one (each contiguous in its memory): each its own piece, which the holders share
    out (`_writer`), so that a leaf replicated over processes is written by all of them,
    a part each, as Orbax's replica-parallel writes do."""
    axis = next((d for d, (a, b) in enumerate(bounds) if b - a > 1), None)
    if axis is None:
        return [bounds]
    a, b = bounds[axis]
    n = min(parts, b - a)
    edges = [a + (b - a) * k // n for k in range(n + 1)]
    return [(*bounds[:axis], (lo, hi), *bounds[axis + 1 :]) for lo, hi in itertools.pairwise(edges)]


def _host(buffers_of: Sequence[Any], at: Any) -> Any:
    """A piece's bytes on the host: its shard's (at a position), or part of it."""
    if isinstance(at, tuple):
        return np.asarray(buffers_of[at[0]])[at[1]]
    return np.asarray(buffers_of[at])


def to_host(
    items: Mapping[str, Mapping[str, Any]],
    buffers: Callable[[jax.Array], Sequence[Any]],
    *,
    local: bool = False,
    same: Callable[[str, str, jax.Array, list[Bounds]], bool] | None = None,
) -> HostPieces:
    """Copies this process's pieces of the leaves to pack (`{item: {name: value}}`) to the
    host: the part of a save that blocks the training step, so only each shard's copy
    happens here (`buffers(array)`: its addressable single-device arrays, in the order of
    `addressable_shards`; on CPU devices a copy shares their memory, which XLA then never
    donates). A jax.Array this process holds whole is one piece (assembled in the
    background); of one spread over processes, and of a NumPy leaf (the same on every
    process), what it is the `_writer` of. With `local` (the local tier), every distinct
    shard this process holds, and every NumPy leaf.
    `same(item, name, value, bounds)`: whether the newest committed step saved this very
    array, with these pieces (an incremental save: they are not copied, that step holds
    them; large leaves are a piece a distinct shard, none assembled)."""
    if jax.default_backend() != "cpu":  # start every copy before waiting on one (CPU
        for item, arrays in items.items():  # devices' memory is the host's: nothing to start)
            for name, value in arrays.items():
                if isinstance(value, jax.Array) and not (same and same(item, name, value, [])):
                    value.copy_to_host_async()
    leaves, chunks, unchanged = list[tuple](), list[Any](), set[tuple[str, str]]()
    me, loads = jax.process_index(), np.zeros(jax.process_count(), np.int64)
    for item, arrays in items.items():
        for name, value in arrays.items():
            shape, dtype = value.shape, np.dtype(value.dtype)
            if isinstance(value, jax.Array):
                plan, about = _piece_plan(value, local, loads)
                if not plan:
                    continue
                # An incremental step assembles no large leaf (a piece a distinct shard: a
                # save holds no second copy of it, and a shard unchanged is one piece).
                whole = about.whole and (same is None or about.nbytes <= MAX_LEAF_BYTES)
                pieces = [_all(shape)] if whole else [bounds for _, bounds in plan]
                if same is not None and same(item, name, value, pieces):
                    unchanged.add((item, name))
                    leaves.append((item, name, dtype, shape, pieces, value))
                    continue
                buffers_of = buffers(value)
                shards = [_host(buffers_of, at) for at, _ in plan]
                if whole:
                    chunks.append((shape, dtype, plan, shards))
                    leaves.append((item, name, dtype, shape, [_all(shape)], value))
                    continue
                chunks.extend(shards)
            elif local or _writer(loads, value.nbytes) == me:
                chunks.append(np.ascontiguousarray(value))
                pieces = [_all(shape)]
                value = None
            else:
                continue
            leaves.append((item, name, dtype, shape, pieces, value))
    return HostPieces(leaves, chunks, frozenset(unchanged))


def _writer(loads: np.ndarray, nbytes: int, among: np.ndarray | None = None) -> int:
    """Of the processes `among` (None: all), the first with the fewest bytes in `loads`,
    which writes `nbytes` more (counted in `loads`): every process chooses alike."""
    writer = int(np.argmin(loads)) if among is None else int(among[np.argmin(loads[among])])
    loads[writer] += nbytes
    return writer


@functools.lru_cache(maxsize=256)
def _all(shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """The bounds of a whole array of `shape`."""
    return tuple((0, n) for n in shape)


def write(
    folder: epath.Path,
    pieces: HostPieces,
    base: B | None = None,
    step: int | None = None,
    codec: str | None = None,
) -> tuple[dict[str, tuple[int, str]], B | None]:
    """This process's files in the step's packed folder (in the save's background): the
    pieces streamed in order, each leaf assembled only as its turn comes, so that the host
    holds at most one leaf beyond what the save copied off the devices. Returns the size
    and manifest digest of each file (`_integrity.hasher`), made as it was written, by its
    path in the step (`packed/<name>`), as the manifest names it.

    With a `base` (an incremental save of step `step`: format 3) a piece the base holds
    (the same array, or bytes of the same XXH3-128) is not written: its entry names where
    the base's step holds it; also returns the base this step makes for the next. Its
    pieces go to up to MAX_FILES files, written at once (`_Files`), each piece compressed
    as it is written with `codec` ("zstd", `_codec`; format 3 only)."""
    version = INDEX_FORMAT if base is None else INCREMENTAL_FORMAT
    assert codec is None or base is not None
    data, index = packed_files(jax.process_index(), jax.process_count())
    entries: list[list] = []
    wanted = sum(_nbytes(c) for c in pieces.chunks)
    split, most = (
        (REMOTE_SPLIT_BYTES, REMOTE_MAX_FILES) if is_remote(folder) else (SPLIT_BYTES, MAX_FILES)
    )
    count = 1 if base is None else min(max(wanted // split, 1), most)
    with _Files(folder, data, count, codec) as files:
        chunks = iter(pieces.chunks)
        for item, name, dtype, shape, bounds_list, _ in pieces.leaves:
            if base is not None and (item, name) in pieces.same:
                entries.extend(base.entry(item, name, b) for b in bounds_list)
                continue
            for bounds in bounds_list:
                chunk = _bytes(next(chunks))
                digest = piece_digest(chunk, version)  # releases the GIL, as writing does
                held = None if base is None else base.held(item, name, dtype, shape, bounds)
                if held is not None and held[1] == digest:
                    entries.append(held)
                    continue
                offset, file = files.add(chunk)
                entries.append([offset, digest] if file == data else [offset, digest, step, file])
    written = files.written
    size = written[f"{PACKED}/{data}"][0]
    text = index_json(version, pieces.leaves, entries, size, codec).encode()
    written[f"{PACKED}/{index}"] = _write(folder, index, [text])
    if base is None or step is None:
        return written, None
    return written, base.next(step, data, pieces.leaves, entries)


SPLIT_BYTES = 64 * 2**20  # an incremental step's pieces: a file for each this many bytes,
MAX_FILES = 4  # up to this many (a new file's blocks are slow to come: written at once,
# 501 MiB of pieces took 0.36-0.93 s in 4 files, 1.0-1.65 s in one, on this VM's ext4);
REMOTE_SPLIT_BYTES, REMOTE_MAX_FILES = 16 * 2**20, 16  # on object storage, an upload a file


class _Files:
    """This process's data files of a step: `<i>-of-<n>.bin`, then `<i>-of-<n>.<k>.bin`;
    each piece `add`ed to the one given the fewest bytes, each file written by a thread
    of its own (started with its first piece: no file is empty) from a short queue, which
    compresses each piece as it writes it with `codec`."""

    def __init__(self, folder: epath.Path, first: str, count: int, codec: str | None = None):
        stem = first.removesuffix(".bin")
        self.names = [first] + [f"{stem}.{k}.bin" for k in range(1, count)]
        self.sizes = [0] * count  # the raw bytes given each
        self.written: dict[str, tuple[int, str]] = {}
        self._folder = folder
        self._codec = codec
        self._queues: list[queue.Queue] = [queue.Queue(maxsize=4) for _ in range(count)]
        self._pool = concurrent.futures.ThreadPoolExecutor(count, "jaxckpt-packed")
        self._writes: list[concurrent.futures.Future | None] = [None] * count

    def add(self, chunk: np.ndarray) -> tuple[int | list[int], str]:
        """Queues a piece's bytes; returns where they go: the offset, or for a compressed
        piece `[offset, stored bytes]` (filled in as it is written: read it once the files
        are closed), and the file."""
        k = self.sizes.index(min(self.sizes))
        if self._writes[k] is None:
            self._writes[k] = self._pool.submit(self._write, k)
        place: int | list[int] = self.sizes[k] if self._codec is None else [0, 0]
        self._put(k, (chunk, place))
        self.sizes[k] += chunk.nbytes
        return place, self.names[k]

    def _write(self, k: int) -> tuple[int, str]:
        def queued() -> Iterator[Any]:
            at = 0  # (of a file of compressed pieces)
            while (got := self._queues[k].get()) is not None:
                chunk, place = got
                if not isinstance(place, list):
                    yield chunk
                    continue
                place[0] = at
                for part in _codec.compressed(chunk):
                    at += len(part)
                    yield part
                place[1] = at - place[0]

        return _write(self._folder, self.names[k], queued())

    def _put(self, k: int, item: Any) -> None:
        while True:  # a writer that failed takes no more: its error, raised here
            try:
                return self._queues[k].put(item, timeout=1)
            except queue.Full:
                if (write := self._writes[k]) is not None and write.done():
                    write.result()

    def __enter__(self) -> _Files:
        return self

    def __exit__(self, *failed: Any) -> None:
        try:
            if self._writes[0] is None:  # the first file always: the index names its size
                self._writes[0] = self._pool.submit(self._write, 0)
            for k, write in enumerate(self._writes):
                if write is not None:
                    self._put(k, None)
                    if failed[0] is None:
                        self.written[f"{PACKED}/{self.names[k]}"] = write.result()
        finally:
            self._pool.shutdown(wait=True)


def _nbytes(chunk: Any) -> int:
    if isinstance(chunk, np.ndarray):
        return chunk.nbytes
    shape, dtype, *_ = chunk
    return math.prod(shape) * np.dtype(dtype).itemsize


def merge(folder: epath.Path, processes: int) -> list[Any]:
    """On process 0 of a job of several, once every process's files of the step are
    written (before the manifest, which covers it): every process's index in one file,
    which a reader reads instead of each process's (O(1) requests, not O(N), on each).
    A process's index missing is null there (its leaves are found incomplete). Returns
    the indexes."""
    present = file_sizes(folder)
    names = [packed_files(p, processes)[1] for p in range(processes)]

    def load(name: str) -> Any:
        if name not in present:
            return None
        return json.loads(read_small(folder, name, present[name]))

    with concurrent.futures.ThreadPoolExecutor(16, "jaxckpt-packed-merge") as pool:
        indexes = list(pool.map(load, names))
    formats = {d["format"] for d in indexes if type(d) is dict and "format" in d}
    doc = {"format": max(formats, default=INDEX_FORMAT), "indexes": indexes}
    _write(folder, PACKED_INDEX, [json.dumps(doc).encode()])
    return indexes


def _write(folder: epath.Path, name: str, chunks: Iterable[Any]) -> tuple[int, str]:
    """One file of `chunks`; returns its size and manifest digest (it is never read back to
    be hashed)."""
    whole = hasher()
    return write_file(folder, name, chunks, whole), whole.hexdigest()


def _bytes(chunk: Any) -> np.ndarray:
    return _whole(chunk).reshape(-1).view(np.uint8)

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
import json
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np
import xxhash
from etils import epath

from jaxckpt._integrity import hasher
from jaxckpt._layout import PACKED, PACKED_INDEX, packed_files
from jaxckpt._plan import holders
from jaxckpt._storage import file_sizes, read_small, write_file
from jaxckpt._tiling import bounds_of
from jaxckpt._tree import dtype_name

MAX_LEAF_BYTES = 2**20  # a leaf of at most this many bytes (all shards) is packed
INDEX_FORMAT = 2  # format 1 (read too): pieces without digests


def is_small(value: Any) -> bool:
    """Whether a leaf to save is packed rather than written as an array of its own."""
    return value.size * value.dtype.itemsize <= MAX_LEAF_BYTES  # (jax's nbytes: ~1 us)


# --- saving --------------------------------------------------------------------------------


@dataclasses.dataclass
class HostPieces:
    """This process's pieces of the small leaves, on the host: what the background writes.
    `leaves`: (item, name, dtype, shape, [(offset, bounds), ...]) each; a chunk is a
    piece's array, or (shape, dtype, plan, shards) for a leaf this process holds whole in
    shards, assembled into one piece in the background. (Few objects a leaf: each one
    made while the save blocks is one more for Python's next garbage collection to walk.)"""

    leaves: list[tuple]
    chunks: list[Any]
    size: int

    def index_json(self, digests: Iterable[str]) -> str:
        """The index, `digests` those of the chunks as written, in order. Made as text, leaf
        by leaf: as a dict and lists a leaf, at thousands of leaves it set off the garbage
        collector's full passes in the save's background (35 ms made 330 ms), holding the
        GIL the training step needs."""
        found = iter(digests)
        items: dict[str, list[str]] = {}
        for item, name, dtype, shape, pieces in self.leaves:
            text = ",".join(
                f'[{offset},[{",".join(f"[{a},{b}]" for a, b in bounds)}],"{next(found)}"]'
                for offset, bounds in pieces
            )
            items.setdefault(item, []).append(
                f'{json.dumps(name)}:{{"dtype":"{dtype_name(dtype)}",'
                f'"shape":[{",".join(map(str, shape))}],"pieces":[{text}]}}'
            )
        leaves = ",".join(f"{json.dumps(item)}:{{{','.join(e)}}}" for item, e in items.items())
        return f'{{"format":{INDEX_FORMAT},"bytes":{self.size},"leaves":{{{leaves}}}}}'


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


@functools.lru_cache(maxsize=4096)
def _slices(bounds: Bounds) -> tuple[slice, ...]:
    """The index of the region `bounds` (the same few a save's thousands of leaves share)."""
    return tuple(slice(a, b) for a, b in bounds)


@dataclasses.dataclass(frozen=True)
class _Plan:
    """What `_piece_plan` works out once per (sharding, shape, dtype)."""

    everything: list[tuple[int, Bounds]]  # each distinct shard here: (position, bounds)
    own: list[tuple[int, Bounds]]  # of those, the ones only this process holds
    shared: list[tuple]  # those several hold: (position or None, bounds, bytes, holders)
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
        size = math.prod(b - a for a, b in bounds) * itemsize
        if len(holding) > 1:
            shared.append((mine.get(bounds), bounds, size, np.array(holding)))
            continue
        alone[holding[0]] += size
        if holding[0] == jax.process_index():
            own.append((mine[bounds], bounds))
    return _Plan(everything, own, shared, alone, False, False, nbytes)


def to_host(
    items: Mapping[str, Mapping[str, Any]],
    buffers: Callable[[jax.Array], Sequence[Any]],
    *,
    local: bool = False,
) -> HostPieces:
    """Copies this process's pieces of the small leaves (`{item: {name: value}}`) to the
    host: the part of a save that blocks the training step, so only each shard's copy
    happens here (`buffers(array)`: its addressable single-device arrays, in the order of
    `addressable_shards`; on CPU devices a copy shares their memory, which XLA then never
    donates). A jax.Array this process holds whole is one piece (assembled in the
    background); of one spread over processes, and of a NumPy leaf (the same on every
    process), what it is the `_writer` of. With `local` (the local tier), every distinct
    shard this process holds, and every NumPy leaf."""
    if jax.default_backend() != "cpu":  # start every copy before waiting on one (CPU
        for arrays in items.values():  # devices' memory is the host's: nothing to start)
            for value in arrays.values():
                if isinstance(value, jax.Array):
                    value.copy_to_host_async()
    leaves, chunks, offset = list[tuple](), list[Any](), 0
    me, loads = jax.process_index(), np.zeros(jax.process_count(), np.int64)
    for item, arrays in items.items():
        for name, value in arrays.items():
            shape, dtype = value.shape, np.dtype(value.dtype)
            if isinstance(value, jax.Array):
                plan, about = _piece_plan(value, local, loads)
                if not plan:
                    continue
                buffers_of = buffers(value)
                shards = [np.asarray(buffers_of[i]) for i, _ in plan]
                if about.whole:
                    chunks.append((shape, dtype, plan, shards))
                    leaves.append((item, name, dtype, shape, [(offset, _all(shape))]))
                    offset += about.nbytes
                    continue
                chunks.extend(shards)
                pieces = []
                for (_, bounds), shard in zip(plan, shards, strict=True):
                    pieces.append((offset, bounds))
                    offset += shard.nbytes
            elif local or _writer(loads, value.nbytes) == me:
                chunks.append(np.ascontiguousarray(value))
                pieces = [(offset, _all(shape))]
                offset += value.nbytes
            else:
                continue
            leaves.append((item, name, dtype, shape, pieces))
    return HostPieces(leaves, chunks, offset)


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


def write(folder: epath.Path, pieces: HostPieces) -> dict[str, tuple[int, str]]:
    """This process's files in the step's packed folder (in the save's background): the
    pieces streamed in order, each leaf assembled only as its turn comes, so that the host
    holds at most one leaf beyond what the save copied off the devices. Returns the size
    and manifest digest of each file (`_integrity.hasher`), made as it was written, by its
    path in the step (`packed/<name>`), as the manifest names it."""
    data, index = packed_files(jax.process_index(), jax.process_count())
    digests: list[str] = []
    written = {f"{PACKED}/{data}": _write(folder, data, pieces.chunks, digests)}
    index_json = pieces.index_json(digests).encode()
    return written | {f"{PACKED}/{index}": _write(folder, index, [index_json], [])}


def merge(folder: epath.Path, processes: int) -> None:
    """On process 0 of a job of several, once every process's files of the step are
    written (before the manifest, which covers it): every process's index in one file,
    which a reader reads instead of each process's (O(1) requests, not O(N), on each).
    A process's index missing is null there (its leaves are found incomplete)."""
    present = file_sizes(folder)
    names = [packed_files(p, processes)[1] for p in range(processes)]

    def load(name: str) -> Any:
        if name not in present:
            return None
        return json.loads(read_small(folder, name, present[name]))

    with concurrent.futures.ThreadPoolExecutor(16, "jaxckpt-packed-merge") as pool:
        indexes = list(pool.map(load, names))
    doc = {"format": INDEX_FORMAT, "indexes": indexes}
    _write(folder, PACKED_INDEX, [json.dumps(doc).encode()], [])


def _write(
    folder: epath.Path, name: str, chunks: Iterable[Any], digests: list[str]
) -> tuple[int, str]:
    """One file of `chunks`, the XXH3-64 of each appended to `digests` as it is written;
    returns the file's size and manifest digest (it is never read back to be hashed)."""

    def digested() -> Iterator[Any]:
        for chunk in chunks:
            data = _bytes(chunk)
            digests.append(xxhash.xxh3_64_hexdigest(data))  # releases the GIL, as writing does
            yield data

    whole = hasher()
    return write_file(folder, name, digested(), whole), whole.hexdigest()


def _bytes(chunk: Any) -> Any:
    return chunk if isinstance(chunk, bytes) else _whole(chunk).reshape(-1).view(np.uint8)

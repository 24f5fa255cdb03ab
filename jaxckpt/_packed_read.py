"""Reading a step's packed leaves (`jaxckpt._packed` owns the format and writes them):
each process's index checked against itself and the files' real sizes before anything of a
leaf's size is allocated or read, then any leaf's pieces read back onto any sharding."""

from __future__ import annotations

import concurrent.futures
import itertools
import json
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from etils import epath

from jaxckpt import _codec
from jaxckpt._damage import Damaged, Incomplete
from jaxckpt._host_buffers import host_buffer
from jaxckpt._layout import INFO_PATH, PACKED, PACKED_INDEX, packed_files
from jaxckpt._packed import INCREMENTAL_FORMAT, INDEX_FORMAT, filled, piece_digest
from jaxckpt._packed_index import Bounds, Piece, is_compressed, leaf_entry
from jaxckpt._storage import SizeError, file_sizes, is_remote, open_inside, read_small
from jaxckpt._tiling import bounds_of, check_held, check_tiling, overlaps, regions_of, within
from jaxckpt._tree import ReadRequest
from jaxckpt.errors import ShardingError

_MERGE_GAP = 2**20  # pieces fewer bytes apart than this are read in one request
DECODERS = min(4, os.cpu_count() or 1)  # threads decoding a leaf's frames (`read_sharded`)


class PackedStep:
    """The packed leaves of one step: every process's index, read and checked once.
    ValueError (naming the file and what is wrong in it) for an index that is not what
    jaxckpt writes, or that does not cover each leaf it lists."""

    def __init__(
        self,
        folder: epath.Path,
        processes: int,
        parts: Sequence[int] | None = None,
        opener: Callable[..., Any] = open_inside,
    ):
        """`parts`: the processes whose files are there (None: every process's). A folder of
        some processes' parts (the local tier's) serves only what those parts hold: each
        region a reader's devices need within one of their pieces (`holds`). `opener`:
        how a file `(folder, name, size=)` is opened to read (`open_inside`; a store's own)."""
        self.folder = folder
        # An incremental step's pieces in earlier steps' folders: in the same directory.
        self.directory = folder.parent.parent
        self.step = _step_number(folder.parent.name)
        self._claims: dict[tuple, int] = {}  # each earlier step's file: the bytes claimed
        self._owner_sizes: dict[int, dict[str, int]] = {}  # each earlier step's files, listed
        self._open = opener
        self.processes = processes
        self._partial = parts is not None
        self._sizes: dict[int, int] = {}  # each process's file: the bytes its index claims
        self._sized: set[tuple] = set()  # the files (`Piece.source`) found that long
        self._leaves: dict[str, dict[str, tuple[np.dtype, tuple[int, ...], list[Piece]]]] = {}
        try:  # one listing: which files are there and how long (no request for each)
            self._present = file_sizes(folder)
        except FileNotFoundError:
            self._present = {}
        indexes = self._indexes(processes, parts)
        for p, doc, where in indexes:
            self._add(p, doc, where)
        if not indexes:
            raise Damaged(f"{PACKED}/ holds no process's index of packed leaves")

    def _indexes(self, processes: int, parts: Sequence[int] | None) -> list[tuple]:
        """Each process's index, with where it was: from the merged index (`merge`) when
        every process's is wanted, it is there and it saves a read (a one-process step,
        whose own index is there, never reads a stray one), one read whatever the process
        count; else each from its own file (a process's missing: its leaves are found incomplete)."""
        several = processes > 1 or packed_files(0, 1)[1] not in self._present
        if parts is None and several and PACKED_INDEX in self._present:
            doc = self._load(PACKED_INDEX)
            ok = type(doc) is dict and doc.get("format") in (INDEX_FORMAT, INCREMENTAL_FORMAT)
            indexes = doc["indexes"] if ok and "indexes" in doc else None
            if type(indexes) is not list or len(indexes) != processes:
                raise Damaged(
                    f"{PACKED}/{PACKED_INDEX} is not an index of {processes} processes' "
                    "packed leaves"
                )
            where = f"{PACKED}/{PACKED_INDEX}: process"
            return [(p, d, f"{where} {p}'s") for p, d in enumerate(indexes) if d is not None]
        found = []
        for p in range(processes) if parts is None else parts:
            rel = packed_files(p, processes)[1]
            if rel in self._present:
                found.append((p, self._load(rel), f"{PACKED}/{rel}"))
        return found

    def _load(self, rel: str) -> Any:
        try:
            return json.loads(read_small(self.folder, rel, self._present[rel], opener=self._open))
        except (SizeError, ValueError, RecursionError) as e:  # (a store's failure: its own)
            raise Damaged(f"{PACKED}/{rel} is unreadable: {e}") from None

    def _add(self, process: int, doc: Any, where: str) -> None:
        compressed = is_compressed(doc, where)
        self._sizes[process] = doc["bytes"]
        spans: dict[tuple, list[tuple[int, int]]] = {}  # the bytes of each piece, by file
        for item, leaves in doc["leaves"].items():
            if not isinstance(leaves, dict):
                raise Damaged(f"{where}: item {item!r} is not an object of leaves")
            known = self._leaves.setdefault(item, {})
            for name, entry in leaves.items():
                dtype, shape, pieces = leaf_entry(
                    entry,
                    process,
                    doc["bytes"],
                    doc["format"],
                    f"{where}: {name!r}",
                    self.step,
                    compressed,
                )
                for p in pieces:
                    if p.size:
                        spans.setdefault(p.source(), []).append((p.offset, p.size))
                        if p.owner is not None:
                            self._claims[p.source()] = max(
                                self._claims.get(p.source(), 0), p.offset + p.size
                            )
                if name in known:
                    if known[name][:2] != (dtype, shape):
                        raise Damaged(f"{where}: {name!r} differs from another process's")
                    known[name][2].extend(pieces)
                else:
                    known[name] = (dtype, shape, pieces)
        for found in spans.values():
            found.sort()
            for (start, nbytes), (after, _) in itertools.pairwise(found):
                if after < start + nbytes:  # one byte read as two elements: a leaf of copies
                    raise Damaged(f"{where}: two pieces overlap at byte {after} of a file")

    def read(self, item: str, requests: Mapping[str, ReadRequest]) -> dict[str, np.ndarray]:
        """The leaves `requests` names, on the host: each whole, or where this process's
        devices need part of it, with that part filled (the rest is never to be read)."""
        wanted = self.wanted(item, requests)
        return self.assemble(
            item, wanted, self.read_pieces(p for ps in wanted.values() for p in ps)
        )

    def assemble(
        self, item: str, wanted: Mapping[str, list[Piece]], blobs: Mapping[Piece, np.ndarray]
    ) -> dict[str, np.ndarray]:
        """The leaves `wanted` names, on the host, from the bytes of their pieces."""
        hosts = {}
        for name, pieces in wanted.items():
            dtype, shape, _ = self._leaves[item][name]
            hosts[name] = _assemble(dtype, shape, pieces, blobs)
        return hosts

    def holds(self, item: str, requests: Mapping[str, ReadRequest]) -> str | None:
        """Why these files cannot serve `requests` (None: they can), reading no leaf."""
        try:
            self.wanted(item, requests)
        except (ValueError, OSError) as e:
            return str(e)
        return None

    def wanted(self, item: str, requests: Mapping[str, ReadRequest]) -> dict[str, list[Piece]]:
        """The pieces to read for each requested leaf; ValueError if they cannot fill it."""
        leaves = self._leaves.get(item, {})
        wanted: dict[str, list[Piece]] = {}
        files: set[tuple] = set()
        for name, request in requests.items():
            if name not in leaves:
                raise Damaged(f"{item} leaf {name!r} is not among the stored arrays")
            dtype, shape, pieces = leaves[name]
            if shape != tuple(request.shape) or dtype != request.dtype:
                raise Damaged(
                    f"{item} leaf {name!r} is stored with shape {shape} and dtype {dtype}, "
                    f"but {INFO_PATH} records shape {tuple(request.shape)} and dtype "
                    f"{request.dtype}"
                )
            regions = regions_of(request, shape)
            if self._partial and regions is not None:
                check_held(item, name, pieces, regions)
            else:
                check_tiling(item, name, shape, pieces)
            wanted[name] = [p for p in pieces if regions is None or overlaps(p, regions)]
            files.update(p.source() for p in pieces)  # a leaf is allocated whole: all of them
        self._check_sizes(files - self._sized)
        return wanted

    def pieces(self) -> list[Piece]:
        """Every piece of every leaf the indexes list."""
        return [p for *_, ps in self.leaves() for p in ps]

    def leaves(self) -> Iterator[tuple[str, str, np.dtype, tuple[int, ...], list[Piece]]]:
        """Every leaf the indexes list: its item, name, dtype, shape and pieces."""
        for item, leaves in self._leaves.items():
            for name, (dtype, shape, pieces) in leaves.items():
                yield item, name, dtype, shape, pieces

    def check_sizes(self, sources: Iterable[tuple]) -> None:
        """`_check_sizes` of these files (`Piece.source`) not checked yet."""
        self._check_sizes(set(sources) - self._sized)

    def _check_sizes(self, sources: Iterable[tuple]) -> None:
        """Each of these files (`Piece.source`) must hold the bytes the indexes claim (its
        size as listed, ValueError otherwise; a file shorter when read is caught by that
        read): then no piece reaches past the file's end, and a leaf's pieces, sharing no
        byte, hold at most its bytes."""
        for source in sorted(sources, key=str):
            owner, name, process = source
            if owner is None:
                rel = packed_files(process, self.processes)[0]
                real, claimed = self._present.get(rel), self._sizes[process]
            else:
                rel = f"{owner}/{PACKED}/{name}"
                real, claimed = self._owner_files(owner).get(name), self._claims[source]
            if real is None and owner is not None and not (self.directory / str(owner)).exists():
                raise Incomplete(
                    f"it shares bytes with step {owner}, which is not in this directory (was "
                    f"this step copied without it?): copy step {owner} beside it, or copy "
                    "this step from where it was saved with jaxckpt copy, which writes one "
                    "that stands alone"
                )
            if real is None:
                raise Damaged(
                    f"{PACKED}/{rel} is missing"
                    if owner is None
                    else f"{rel}, which holds pieces of this step, is missing"
                )
            if real < claimed:
                self._unless_foreign(owner)
                raise Damaged(
                    f"{'' if owner is not None else PACKED + '/'}{rel} holds {real} bytes, "
                    f"fewer than the {claimed} the index places pieces in"
                )
            self._sized.add(source)

    def _owner_files(self, owner: int) -> dict[str, int]:
        """An earlier step's packed files, with their sizes (one listing a step)."""
        if owner not in self._owner_sizes:
            try:
                self._owner_sizes[owner] = file_sizes(self.directory / str(owner) / PACKED)
            except FileNotFoundError:
                self._owner_sizes[owner] = {}
        return self._owner_sizes[owner]

    def read_pieces(self, pieces: Iterable[Piece]) -> dict[Piece, np.ndarray]:
        """The bytes of each piece. On object storage in as few requests as their offsets
        allow: a run of pieces less than _MERGE_GAP apart in one process's file is one, the
        pieces views of its bytes. On local disk each piece is read into memory of its own:
        a batch's one buffer was new memory from the kernel at each restore, faulted in page
        by page as it was read (0.15-0.2 s for 64 MiB on these VMs, the read 0.02 s)."""
        by_file: dict[tuple, list[Piece]] = {}
        for p in pieces:
            by_file.setdefault(p.source(), []).append(p)
        out: dict[Piece, np.ndarray] = {}
        merge = is_remote(self.folder)
        for found in by_file.values():
            found.sort(key=lambda p: p.offset)
            runs: list[list[Piece]] = [[found[0]]]
            wanted = found[0].size  # of the last run
            for p in found[1:]:
                run_start, last = runs[-1][0].offset, runs[-1][-1]
                span = p.offset + p.size - run_start
                # merged only across small gaps, reading at most as much unwanted as wanted
                gap = p.offset - (last.offset + last.size)
                if merge and gap < _MERGE_GAP and span <= 2 * (wanted + p.size):
                    runs[-1].append(p)
                    wanted += p.size
                else:
                    runs.append([p])
                    wanted = p.size
            root, rel, where, size = self._file_of(found[0])
            with self._open(root, rel, size=size) as f:
                for run in runs:
                    start = run[0].offset
                    stop = max(p.offset + p.size for p in run)
                    f.seek(start)
                    # writable (a host leaf may be its view), and not zeroed first
                    view = np.empty(stop - start, np.uint8)
                    got = f.readinto(view.data)
                    if got != stop - start:
                        raise Damaged(
                            f"{where} ends at byte {start + got}, before the "
                            f"pieces its index places up to byte {stop}"
                        )
                    for p in run:
                        out[p] = view[p.offset - start : p.offset - start + p.size]
                        if p.stored is not None:
                            out[p] = _codec.decompressed(out[p], p.nbytes, _at(p, where))
                        self._check(p, out[p].data, where)
        return out

    def read_stored(self, piece: Piece) -> bytes:
        """A piece's bytes as its file stores them (a zstd frame as it is), checked against
        its digest: what a copy of the step writes again (`jaxckpt._standalone`)."""
        root, rel, where, size = self._file_of(piece)
        with self._open(root, rel, size=size) as f:
            f.seek(piece.offset)
            data = f.read(piece.size)
        if len(data) != piece.size:
            raise _cut_short(where, piece.offset + len(data), piece.offset + piece.size)
        raw = np.frombuffer(data, np.uint8)
        if piece.stored is not None:
            raw = _codec.decompressed(raw, piece.nbytes, _at(piece, where))
        self._check(piece, raw.data, where)
        return data

    def _file_of(self, piece: Piece) -> tuple[Any, str, str, int | None]:
        """Where a piece's bytes are: (root, path there, name to print, size as listed)."""
        if piece.owner is None:
            rel = packed_files(piece.process, self.processes)[0]
            return self.folder, rel, f"{PACKED}/{rel}", self._present.get(rel)
        # from the directory down, no link followed: never out of it
        rel = f"{piece.owner}/{PACKED}/{piece.file}"
        return self.directory, rel, rel, self._owner_files(piece.owner).get(str(piece.file))

    def _check(self, piece: Piece, data: Any, where: str) -> None:
        """`_check`: a piece's bytes against its digest. A piece of an earlier step whose
        bytes disagree, where that step's own index places other bytes there, is no damage:
        the step of that number here is not the one this step was saved beside (another
        run's, copied in): `Incomplete`."""
        try:
            _check(piece, data, where)
        except Damaged:
            self._unless_foreign(piece.owner)
            raise

    def _unless_foreign(self, owner: int | None) -> None:
        """`Incomplete` if the step `owner` here holds none of the pieces this step refers
        to in it where its own index places them: it is not the step this one was saved
        beside (another run's, copied in), whose files may well be whole. Nothing where one
        of them is there (a damaged file, or a hostile entry of this step's: damage), or
        that step's index cannot be read (damage too)."""
        if owner is None or owner == self.step:
            return
        try:
            step = PackedStep(self.directory / str(owner) / PACKED, self.processes)
            own = {
                (p.file or packed_files(p.process, self.processes)[0], p.offset, p.digest)
                for p in step.pieces()
                if p.owner in (None, owner)
            }
        except (OSError, ValueError):
            return
        if not any((p.file, p.offset, p.digest) in own for p in self.pieces() if p.owner == owner):
            raise Incomplete(
                f"it shares bytes with step {owner}, but the step {owner} in this directory "
                "is another one (its index places other bytes there: another run's step, "
                "copied in?): copy the step it was saved beside, or copy this step from "
                "where it was saved with jaxckpt copy, which writes one that stands alone"
            ) from None

    def read_sharded(self, item: str, requests: Mapping[str, ReadRequest]) -> dict[str, Any]:
        """The leaves `requests` names, each onto its sharding, read shard by shard: each
        of this process's distinct shards into a buffer of its own that becomes its
        devices' (`_host_buffers.host_buffer`: on CPU devices with no copy), a piece of the
        same bounds read straight into it, others read one at a time and copied where they
        overlap. Nothing of a leaf's size is assembled on the host. On object storage the
        pieces are read first, all of them in as few requests as `read_pieces` makes (one
        a piece was 138 requests for 64 MiB of 16 leaves), then copied into place.

        zstd frames are decoded DECODERS at a time (zstd decodes ~0.85 GiB/s a core, a disk
        reads faster): those of a region's bounds straight into it, the others each into
        staging of its own, copied and freed, at most a quarter of the batch's bytes (or
        one piece) staged at once."""
        wanted = self.wanted(item, requests)
        every = [p for pieces in wanted.values() for p in pieces]
        fetched = None
        if is_remote(self.folder):  # (a batch's bytes: what the restore's budget bounds)
            fetched = self.read_pieces(every)
        staging = sum(p.nbytes for p in every) // 4
        decoders = concurrent.futures.ThreadPoolExecutor(DECODERS, "jaxckpt-decode")
        with decoders:
            return {
                name: self._onto(item, name, request, wanted[name], fetched, decoders, staging)
                for name, request in requests.items()
            }

    def _onto(
        self,
        item: str,
        name: str,
        request: ReadRequest,
        pieces: list[Piece],
        fetched: dict[Piece, np.ndarray] | None,
        decoders: concurrent.futures.Executor,
        staging: int,
    ) -> Any:
        """One leaf of `read_sharded`."""
        dtype, shape, _ = self._leaves[item][name]
        sharding = request.sharding
        assert sharding is not None  # (`_transfer._by_shard`: on devices)
        placement = sharding.addressable_devices_indices_map(shape)
        regions: dict[Bounds, np.ndarray] = {}
        for index in placement.values():
            bounds = bounds_of(index, shape)  # type: ignore[arg-type]
            if bounds not in regions:
                regions[bounds] = host_buffer(tuple(b - a for a, b in bounds), dtype)
        if fetched is not None:
            for piece in pieces:
                _place(piece, fetched.pop(piece), dtype, regions)
        else:
            frames = [p for p in pieces if p.stored is not None]
            staged = [p for p in frames if p.bounds not in regions]
            largest = max((p.nbytes for p in staged), default=1)
            at_once = max(1, min(DECODERS, staging // largest))  # staged pieces in flight
            groups = [[p for p in frames if p.bounds in regions]]
            groups += [staged[i : i + at_once] for i in range(0, len(staged), at_once)]
            for group in groups:  # (disjoint parts of the regions: copied in at once)
                for _ in decoders.map(lambda p: self._read_into(p, dtype, regions), group):
                    pass
            for piece in pieces:
                if piece.stored is None:
                    self._read_into(piece, dtype, regions)
        try:  # (in the target's memory kind: a host-offloaded leaf's pinned_host, say)
            arrays = [
                jax.device_put(
                    regions[bounds_of(index, shape)],  # type: ignore[arg-type]
                    jax.sharding.SingleDeviceSharding(device, memory_kind=sharding.memory_kind),
                )
                for device, index in placement.items()
            ]
            return jax.make_array_from_single_device_arrays(shape, sharding, arrays)
        except ValueError as e:  # the target's placement, not the step's files
            raise ShardingError(
                f"{item} leaf {name!r} could not be placed onto its target's sharding "
                f"{sharding}: {e}"
            ) from e

    def _read_into(self, piece: Piece, dtype: np.dtype, regions: Mapping[Bounds, Any]) -> None:
        """A piece's bytes into each region it overlaps: straight into one of its bounds."""
        root, rel, where, size = self._file_of(piece)
        exact = regions.get(piece.bounds)
        blob = exact if exact is not None else np.empty(piece.nbytes, np.uint8)
        view = blob.reshape(-1).view(np.uint8)
        with self._open(root, rel, size=size) as f:
            f.seek(piece.offset)
            if piece.stored is not None:  # straight from the file into its place
                _codec.decompress_into(_codec.Span(f, piece.stored), view.data, _at(piece, where))
            elif (got := f.readinto(view.data)) != piece.nbytes:
                raise _cut_short(where, piece.offset + got, piece.offset + piece.nbytes)
        self._check(piece, view.data, where)
        if exact is None:
            _place(piece, blob, dtype, regions)


def _place(piece: Piece, blob: np.ndarray, dtype: np.dtype, regions: Mapping[Bounds, Any]) -> None:
    """A piece's bytes (checked) copied into each region it overlaps."""
    values = blob.view(dtype).reshape([b - a for a, b in piece.bounds])
    for bounds, region in regions.items():
        if (box := _intersection(piece.bounds, bounds)) is not None:
            region[within(box, bounds)] = values[within(box, piece.bounds)]


def _cut_short(where: str, end: int, wanted: int) -> Damaged:
    """A file that ends at byte `end`, before the piece its index places up to `wanted`."""
    return Damaged(
        f"{where} ends at byte {end}, before the piece its index places up to byte {wanted}"
    )


def _at(piece: Piece, where: str) -> str:
    return f"{where}: the {piece.size} bytes at byte {piece.offset}"


def _check(piece: Piece, data: Any, where: str) -> None:
    """ValueError unless `data` (the piece's bytes) match the piece's digest."""
    if piece.digest and _digest(data, piece.digest) != piece.digest:
        raise Damaged(
            f"{where}: the {piece.nbytes} bytes at byte {piece.offset} do "
            "not match their checksum in the index (the file is damaged)"
        )


def _intersection(a: Bounds, b: Bounds) -> Bounds | None:
    box = tuple((max(x, u), min(y, v)) for (x, y), (u, v) in zip(a, b, strict=True))
    return box if all(lo < hi for lo, hi in box) else None


def _digest(data: Any, like: str) -> str:
    """The digest of `data` of the kind `like` is (XXH3-64 or -128, by its length)."""
    return piece_digest(data, INCREMENTAL_FORMAT if len(like) == 32 else INDEX_FORMAT)


def _step_number(name: str) -> int | None:
    return int(name) if name.isdigit() and len(name) < 19 else None


def _assemble(
    dtype: np.dtype, shape: tuple[int, ...], pieces: list[Piece], blobs: Mapping
) -> np.ndarray:
    """The leaf on the host from its pieces (where a process needs part of a leaf, only
    that part is filled: the rest is never placed)."""
    if len(pieces) == 1 and all(
        b - a == n for (a, b), n in zip(pieces[0].bounds, shape, strict=True)
    ):
        return blobs[pieces[0]].view(dtype).reshape(shape)
    return filled(
        shape,
        dtype,
        ((p.bounds, blobs[p].view(dtype).reshape([b - a for a, b in p.bounds])) for p in pieces),
    )

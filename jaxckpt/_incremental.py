"""Incremental steps: a save writes only the pieces that changed since the newest committed
step, and records where the others already are. The one owner of what "unchanged" means,
of which steps a step shares bytes with, and of which steps must stay on disk for that.

A step saved with `incremental=True` packs every leaf (format 3, `jaxckpt._packed`): each
piece (a distinct shard of a leaf, or a small leaf whole) with the XXH3-128 of its bytes.
A piece of a leaf of more than 1 MiB (`shareable`: a smaller leaf is written at every save)
is the base's piece, and is not written, when the base (the newest committed step this
process saved) holds a piece of the same leaf, dtype, shape and bounds and either

- the leaf is the very `jax.Array` object the base saved (arrays are immutable: exact, and
  nothing is copied off the devices nor hashed), or
- its bytes have the same XXH3-128 (hashed in the save's background, as they are written
  otherwise). Two different pieces share a 128-bit digest with probability about 2^-128 a
  pair, the manifest's own odds (`_integrity.HASH`): a step is no likelier to restore wrong
  bytes than a damaged file is to pass `verify`.

The entry of such a piece names the step whose folder holds its bytes (the one that wrote
them: a reference never leads to another), and `<step>/jaxckpt/shares.json` summarises those
steps for a reader's listing.

A chain of saves that refer to earlier ones ends every `full_save_every` saves (`due_full`):
that save writes every piece, refers to nothing, and the next ones refer to it. So one
damaged file is read by at most `full_save_every` steps: the one that wrote it and those
saved after it up to the next full save (each process counts its own chain: a save that
happened to write every piece, as a pretraining run's do, starts a new one at no cost).

Retention never deletes a step a kept step shares bytes with, as its index says
(`Sharing`, `needs`: a step whose index cannot be read needs every earlier one): it
retires it instead (`<step>.jaxckpt-retired` beside it: out of every
listing, its files kept) and deletes it once no kept step shares its bytes.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
import numpy as np
from etils import epath

from jaxckpt import _layout, _packed, _packed_index, _packed_read
from jaxckpt._damage import Incomplete
from jaxckpt._storage import file_sizes, read_small

log = logging.getLogger("jaxckpt")

SHARES_PATH = f"{_layout.META_DIR}/shares.json"

Bounds = tuple[tuple[int, int], ...]
Key = tuple[str, str, Bounds]  # item, leaf name, bounds


@dataclasses.dataclass
class SavedPieces:
    """The newest committed step this process saved incrementally, as this process wrote
    it: each piece's entry where its bytes are (`[offset, xxh3-128, owner step, file]`),
    and the arrays it saved (weakly: the base keeps none alive). `chain`: how many saves
    since this process's newest full one (which refers to no other step: 0) the step is.
    A base seeded from disk (`seeded`) also holds `unproven`: its pieces whose bytes no one
    read back since, each read back (and checked against its XXH3-128) the first time a save
    would refer to it, by `reader` (`_packed_read.PackedStep`)."""

    step: int
    pieces: dict[Key, tuple[np.dtype, tuple[int, ...], list]]
    arrays: dict[tuple[str, str], weakref.ref]
    chain: int = 0
    unproven: dict[Key, _packed_index.Piece] = dataclasses.field(default_factory=dict)
    reader: Any = None

    def same(self, item: str, name: str, value: Any, bounds: Iterable[Bounds]) -> bool:
        """Whether `value` is the very array the base saved as this leaf, each of these
        pieces of it there (the base holds every byte this process would write of it)."""
        ref = self.arrays.get((item, name))
        if ref is None or ref() is not value:
            return False
        return all((item, name, b) in self.pieces for b in bounds)

    def entry(self, item: str, name: str, bounds: Bounds) -> list:
        """The entry of the base's piece of this leaf and bounds (`same` said it has it)."""
        return self.pieces[(item, name, bounds)][2]

    def held(
        self, item: str, name: str, dtype: np.dtype, shape: tuple[int, ...], bounds: Bounds
    ) -> list | None:
        """The entry of the base's piece of this leaf and bounds, if it has one of this
        dtype and shape whose bytes are known to be there, whole (`unproven`: read back
        first; a piece that is not is written again)."""
        key = (item, name, bounds)
        found = self.pieces.get(key)
        if found is None or found[0] != dtype or found[1] != shape:
            return None
        if (piece := self.unproven.pop(key, None)) is not None:
            try:
                self.reader.check_sizes({piece.source()})
                self.reader.read_pieces([piece])  # (each checked against its XXH3-128)
            except (OSError, ValueError) as e:
                log.warning(
                    "step %d: %s/%s is written again, not referred to: %s", self.step, item, name, e
                )
                del self.pieces[key]
                return None
        return found[2]

    def next(
        self, step: int, data_file: str, leaves: Iterable[tuple], entries: list
    ) -> SavedPieces:
        """The base step `step` makes once committed: `leaves` (`_packed.HostPieces.leaves`)
        with their pieces' `entries` as its index holds them, its own pieces in `data_file`."""
        found = iter(entries)
        pieces: dict[Key, tuple[np.dtype, tuple[int, ...], list]] = {}
        arrays: dict[tuple[str, str], weakref.ref] = {}
        refers = False
        for item, name, dtype, shape, bounds_list, value in leaves:
            entries = [next(found) for _ in bounds_list]
            refers = refers or any(len(e) == 4 and e[2] != step for e in entries)
            if not shareable(dtype, shape):
                continue
            for bounds, entry in zip(bounds_list, entries, strict=True):
                where = entry if len(entry) == 4 else [*entry, step, data_file]
                pieces[(item, name, bounds)] = (dtype, shape, where)
            if value is not None:
                arrays[(item, name)] = weakref.ref(value)
        return SavedPieces(step, pieces, arrays, self.chain + 1 if refers else 0)

    def owners(self) -> set[int]:
        """The steps this base's pieces are in."""
        return {entry[2] for _, _, entry in self.pieces.values()}


def shareable(dtype: np.dtype, shape: tuple[int, ...]) -> bool:
    """Whether a later step may refer to this leaf's pieces rather than write them: a leaf
    of more than `_packed.MAX_LEAF_BYTES`. A small one is written at every save: cheap, and
    it never keeps an earlier step on disk (a step that a kept one refers to stays whole
    until none does: a few constant bytes would keep all of it)."""
    return math.prod(shape) * np.dtype(dtype).itemsize > _packed.MAX_LEAF_BYTES


def empty(step: int) -> SavedPieces:
    """The base of a step that holds no piece (a full save makes one)."""
    return SavedPieces(step, {}, {})


FULL_EVERY = 10  # the default: MiB written and the steps one file reaches, docs/incremental.md


def due_full(base: SavedPieces | None, full_save_every: int | None) -> bool:
    """Whether a save on `base` writes every piece (refers to no earlier step): with no
    base, or as the `full_save_every`-th save of its chain (None: never), so that no file
    is read by more than `full_save_every` steps."""
    return base is None or (full_save_every is not None and base.chain + 1 >= full_save_every)


def seeded(
    directory: epath.Path,
    committed: Iterable[int],
    saving: int,
    codec: str | None = None,
    retired: Iterable[int] = (),
) -> SavedPieces | None:
    """The base of a save of step `saving` by a process with none (a restarted job, or its
    base deleted): this process's pieces of the newest `committed` step before it, as its
    own index lists them (their XXH3-128s and where their bytes are), and no arrays. The
    save then writes only the pieces whose bytes changed since, found by their digests,
    and refers to none it did not read back first (`SavedPieces.held`): an index says what
    was written, not what is there now. Its chain is counted in the steps on disk since the
    oldest it refers to. None (a full save) where there is no such step, it
    is not an incremental step this process wrote in a job of as many processes with this
    `codec`, its index or a file it places pieces in is not what jaxckpt writes, or it
    places pieces in a step that is neither committed nor `retired` (gone, or a link)."""
    committed = list(committed)
    earlier = [s for s in committed if s < saving]
    if not earlier:
        return None
    step, process, processes = max(earlier), jax.process_index(), jax.process_count()
    step_dir = directory / str(step)
    try:
        packed = _packed_read.PackedStep(step_dir / _layout.PACKED, processes, parts=(process,))
        leaves = [leaf for leaf in packed.leaves() if shareable(leaf[2], leaf[3])]
        every = [p for *_, pieces in leaves for p in pieces]
        if not every or any(p.digest is None or len(p.digest) != 32 for p in every):
            return None  # (nothing to refer to; or not format 3: XXH3-64s)
        if any((p.stored is not None) != (codec is not None) for p in every):
            return None  # (compressed otherwise)
        packed.check_sizes({p.source() for p in every})
    except (OSError, ValueError) as e:
        log.debug("step %d is no base for an incremental save: %s", step, e)
        return None
    known = {*committed, *retired}
    owners = {p.owner for p in every if p.owner is not None and p.owner != step}
    if not owners <= known:
        log.debug("step %d is no base: it places pieces in a step no listing shows", step)
        return None
    # its chain, as the steps on disk tell it: those since the oldest it refers to (the
    # saves between that retention deleted read no file any more)
    chain = len([s for s in known if min(owners) < s <= step]) if owners else 0
    own = _layout.packed_files(process, processes)[0]
    found: dict[Key, tuple[np.dtype, tuple[int, ...], list]] = {}
    unproven: dict[Key, _packed_index.Piece] = {}
    for item, name, dtype, shape, pieces in leaves:
        for p in pieces:
            owner = step if p.owner is None else p.owner
            place = p.offset if p.stored is None else [p.offset, p.stored]
            found[(item, name, p.bounds)] = (dtype, shape, [place, p.digest, owner, p.file or own])
            unproven[(item, name, p.bounds)] = p
    return SavedPieces(step, found, {}, chain, unproven, packed)


def shares_of(entries: Iterable[Mapping[str, Any]]) -> list[int]:
    """The owner steps that these indexes' (`_packed` format 3 docs) pieces refer to."""
    owners: set[int] = set()
    for doc in entries:
        if type(doc) is not dict or doc.get("format", 0) < 3:
            continue
        for leaves in (doc.get("leaves") or {}).values():
            for entry in leaves.values() if type(leaves) is dict else ():
                for piece in entry.get("pieces", ()) if type(entry) is dict else ():
                    if type(piece) is list and len(piece) == 5 and type(piece[3]) is int:
                        owners.add(piece[3])
    return sorted(owners)


def _shares_problems(step_dir: epath.Path, owners: frozenset[int]) -> list[str]:
    """Whether `shares.json` says what the index does (`owners`): a summary that disagrees
    would mislead a reader of the listing."""
    try:
        listed = read_shares(step_dir)
    except (OSError, ValueError) as e:
        return [f"{SHARES_PATH} is unreadable: {e}"]
    if listed is None:
        return [f"{SHARES_PATH} is missing"] if owners else []
    if listed != owners:
        return [
            f"{SHARES_PATH} names step(s) {sorted(listed) or 'none'}, but the packed index "
            f"refers to step(s) {sorted(owners) or 'none'}"
        ]
    return []


def write_shares(step_dir: epath.Path, steps: Iterable[int]) -> None:
    """The step's `shares.json`: the steps whose bytes it refers to (before its manifest,
    which covers it)."""
    (step_dir / SHARES_PATH).write_text(json.dumps({"steps": sorted(set(steps))}))


def read_shares(step_dir: epath.Path) -> frozenset[int] | None:
    """The steps a committed step's `shares.json` names (None without the file: a step not
    saved incrementally, or one that lost it); ValueError (OSError for a file of a size no
    summary has) for a file that is not what jaxckpt writes. A summary for listings and
    `verify`: what a step needs is its index's (`needs`)."""
    try:
        size = file_sizes(step_dir / _layout.META_DIR).get("shares.json")
    except FileNotFoundError:
        return None
    if size is None:
        return None
    try:
        doc = json.loads(read_small(step_dir / _layout.META_DIR, "shares.json", size))
    except RecursionError:
        raise ValueError(f"{step_dir / SHARES_PATH} is nested too deeply") from None
    steps = doc.get("steps") if type(doc) is dict else None
    if type(steps) is not list or not all(type(s) is int and s >= 0 for s in steps):
        raise ValueError(f"{step_dir / SHARES_PATH} is not a list of steps")
    return frozenset(steps)


class Sharing:
    """Which committed steps share bytes with which, from each step's packed index: the
    authority (`needs`), read once a step (a committed step's never changes; `forget` one
    that leaves the listing). `describe(step)` is the step's `StepInfo`. A step whose
    metadata or index cannot be read needs every earlier step (logged): retention keeps
    what it cannot tell, and never deletes on a missing or damaged summary."""

    def __init__(self, describe: Callable[[int], _layout.StepInfo]) -> None:
        self._describe = describe
        self._shares: dict[tuple[epath.Path, int], frozenset[int]] = {}

    def of(self, step: int, step_dir: epath.Path) -> frozenset[int]:
        """The steps `step` shares bytes with."""
        key = (step_dir, step)
        if key not in self._shares:
            try:
                info = self._describe(step)
                found = needs(step_dir, step, info.process_count or 1) if info.packed else None
            except (OSError, ValueError) as e:
                log.warning("could not read which steps step %d shares bytes with: %s", step, e)
                return frozenset(range(step))
            self._shares[key] = found or frozenset()
        return self._shares[key]

    def users(self, step: int, kept: Mapping[int, epath.Path]) -> list[int]:
        """Which of the `kept` steps (by their folders) share bytes with `step`."""
        return [s for s, at in kept.items() if s != step and step in self.of(s, at)]

    def unneeded(self, retired: Iterable[int], kept: Mapping[int, epath.Path]) -> list[int]:
        """Which `retired` steps no `kept` step shares bytes with: to delete."""
        needed = set().union(*(self.of(s, at) for s, at in kept.items()))
        return [s for s in retired if s not in needed]

    def forget(self, step: int) -> None:
        self._shares = {k: v for k, v in self._shares.items() if k[1] != step}


def needs(step_dir: epath.Path, step: int, processes: int) -> frozenset[int]:
    """The earlier steps whose folders hold bytes the committed step `step` reads: the
    owners its packed index (every process's) names for its pieces. The index is what a
    read follows; `shares.json` only summarises it, for a reader's listing. OSError or
    ValueError where the index cannot be read whole."""
    packed = _packed_read.PackedStep(step_dir / _layout.PACKED, processes)
    return frozenset(p.owner for p in packed.pieces() if p.owner not in (None, step))


VERIFY_BATCH_BYTES = 64 * 2**20  # of shared pieces read (and checked) at once


def verify_shared(step_dir: epath.Path, processes: int) -> list[str]:
    """The problems of the bytes a step shares with earlier ones, as its packed index
    places them: each piece in another step's folder read and checked against its
    XXH3-128, a batch at a time (their own files each step's manifest covers; here a piece
    damaged there is named again, for every step that uses it); and `shares.json` checked
    against the index it summarises."""
    if not (step_dir / _layout.PACKED).exists():
        return []  # (a step that packs nothing: Orbax's arrays only)
    try:
        packed = _packed_read.PackedStep(step_dir / _layout.PACKED, processes)
        shared = [p for p in packed.pieces() if p.owner not in (None, packed.step)]
    except (OSError, ValueError) as e:
        return [f"{_layout.PACKED}/: {e}"]
    problems = _shares_problems(step_dir, frozenset(p.owner for p in shared if p.owner is not None))
    batch: list[_packed_index.Piece] = []
    for piece in [*shared, None]:
        if piece is not None:
            batch.append(piece)
        if batch and (piece is None or sum(p.nbytes for p in batch) >= VERIFY_BATCH_BYTES):
            try:
                packed.check_sizes({p.source() for p in batch})
                packed.read_pieces(batch)
            except Incomplete as e:  # (says which step)
                problems.append(str(e))
            except (OSError, ValueError) as e:
                problems.append(f"shared with step {batch[0].owner}: {e}")
            batch = []
    return problems

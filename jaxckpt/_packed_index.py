"""A packed index's claims parsed and checked (`jaxckpt._packed` owns the format, and
`jaxckpt._packed_read` reads what they describe): each leaf's dtype, shape and pieces, every
piece's place, bounds, digest, owner and stored size of the form its index's format and
codec say, within its file as the index claims it. What one index cannot check alone (the
files' real sizes, the pieces' tiling) the reader checks before anything is allocated."""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Any

import jax
import numpy as np

from jaxckpt import _codec
from jaxckpt._damage import Damaged
from jaxckpt._packed import INCREMENTAL_FORMAT, INDEX_FORMAT
from jaxckpt._tree import is_count, is_counts

_FORMATS = (1, INDEX_FORMAT, INCREMENTAL_FORMAT)
_PIECE_FORMS = {
    1: "[offset, [[start, stop], ...]]",
    2: "[offset, [[start, stop], ...], xxh3-64]",
    3: "[offset, [[start, stop], ...], xxh3-128(, owner step, file)]",
    "zstd": "[[offset, stored bytes], [[start, stop], ...], xxh3-128(, owner step, file)]",
}
_DIGESTS = {2: re.compile("[0-9a-f]{16}"), 3: re.compile("[0-9a-f]{32}")}  # XXH3-64, -128
Bounds = tuple[tuple[int, int], ...]
# a process's data file: `packed_files`', or one more of an incremental step's (`_packed._Files`)
_DATA_FILE = re.compile(r"(\d{1,9})-of-(\d{1,9})(\.\d{1,3})?\.bin")


@dataclasses.dataclass(frozen=True)
class Piece:
    process: int
    offset: int
    bounds: tuple[tuple[int, int], ...]
    nbytes: int
    digest: str | None  # XXH3-64 (format 2) or -128 (3) hex of its bytes (None: format 1)
    # Format 3: the earlier step whose packed folder holds its bytes, and the file there
    # (None: this step's, the file of `process`).
    owner: int | None = None
    file: str | None = None
    stored: int | None = None  # compressed (zstd, `_codec`): its bytes in the file

    @property
    def size(self) -> int:
        """Its bytes in its file."""
        return self.nbytes if self.stored is None else self.stored

    def source(self) -> tuple[int | None, str | None, int]:
        """The file it is in: (owner step, file name) or (None, None, process)."""
        return (self.owner, self.file, -1) if self.owner is not None else (None, None, self.process)


def is_compressed(doc: Any, where: str) -> bool:
    """Whether an index (a process's, `doc`) describes zstd frames; ValueError naming
    `where` unless it is an index of packed leaves jaxckpt writes."""
    if not (
        isinstance(doc, dict)
        and doc.get("format") in _FORMATS
        and is_count(doc.get("bytes"))
        and isinstance(doc.get("leaves"), dict)
        and doc.get("codec", _codec.ZSTD) == _codec.ZSTD
        and ("codec" not in doc or doc["format"] == INCREMENTAL_FORMAT)
    ):
        raise Damaged(f"{where} is not an index of packed leaves (format {INDEX_FORMAT})")
    return "codec" in doc


def leaf_entry(
    entry: Any,
    process: int,
    size: int,
    version: int,
    where: str,
    step: int | None,
    compressed: bool = False,
) -> tuple:
    shape = entry.get("shape") if type(entry) is dict else None
    pieces = entry.get("pieces") if type(entry) is dict else None
    if not (is_counts(shape) and type(pieces) is list and type(entry.get("dtype")) is str):
        raise Damaged(f"{where} is not a packed leaf's entry")
    dtype = _dtype(entry["dtype"])
    if dtype is None:
        raise Damaged(f"{where}: {entry['dtype']!r} is not a dtype")
    shape = tuple(shape)
    out = []
    for piece in pieces:
        digest, owner, file, stored = None, None, None, None
        if version > 1:  # [offset, bounds, digest(, owner, file)]: the rest apart
            piece, digest, owner, file = _split(piece, version, step)
        if compressed:  # [[offset, stored bytes], bounds, ...]
            piece, stored = _stored(piece)
        bounds = _piece_bounds(piece, shape)
        if bounds is None:
            form = _PIECE_FORMS[_codec.ZSTD if compressed else version]
            raise Damaged(f"{where}: a piece is not {form} within shape")
        offset = piece[0]
        nbytes = math.prod(b - a for a, b in bounds) * dtype.itemsize
        p = Piece(process, offset, bounds, nbytes, digest, owner, file, stored)
        if owner is None and offset + p.size > size:
            raise Damaged(f"{where}: a piece ends past the file's {size} bytes")
        out.append(p)
    return dtype, shape, out


def _split(piece: Any, version: int, step: int | None) -> tuple:
    """A piece of format 2 or 3 as ([offset, bounds], digest, owner, file); ([], ...) if
    it is not one: a reference names this step or an earlier one, and a data file there."""
    nothing: tuple = ([], None, None, None)
    forms = (3, 5) if version >= INCREMENTAL_FORMAT else (3,)
    if type(piece) is not list or len(piece) not in forms:
        return nothing
    digest = piece[2]
    if type(digest) is not str or not _DIGESTS[version].fullmatch(digest):
        return nothing
    if len(piece) == 3:
        return piece[:2], digest, None, None
    owner, file = piece[3], piece[4]
    if type(owner) is not int or owner < 0 or (step is not None and owner > step):
        return nothing
    if type(file) is not str or not _DATA_FILE.fullmatch(file):
        return nothing
    return piece[:2], digest, owner, file


def _stored(piece: Any) -> tuple[list, int | None]:
    """A compressed piece's `[[offset, stored bytes], bounds]` as ([offset, bounds], stored);
    ([], None) if it is not one."""
    if type(piece) is not list or len(piece) != 2 or type(piece[0]) is not list:
        return [], None
    place = piece[0]
    if len(place) != 2 or not all(type(n) is int and n >= 0 for n in place):
        return [], None
    return [place[0], piece[1]], place[1]


def _piece_bounds(piece: Any, shape: tuple[int, ...]) -> tuple | None:
    """A piece's bounds, if it is `[offset, [[start, stop], ...]]` within `shape`."""
    if type(piece) is not list or len(piece) != 2:
        return None
    offset, bounds = piece
    if type(offset) is not int or offset < 0 or type(bounds) is not list:
        return None
    if len(bounds) != len(shape):
        return None
    out = []
    for pair, n in zip(bounds, shape, strict=True):
        if type(pair) is not list or len(pair) != 2:
            return None
        a, b = pair
        if type(a) is not int or type(b) is not int or not 0 <= a <= b <= n:
            return None
        out.append((a, b))
    return tuple(out)


@functools.lru_cache(maxsize=64)
def _dtype(name: str) -> np.dtype | None:
    try:
        return np.dtype(jax.numpy.dtype(name))
    except TypeError:
        return None

"""The geometry of a packed leaf's pieces, on their bounds alone (`[start, stop)` on each
axis), never with an array of the leaf's shape (an index may claim any): whether they hold
each element once (`check_tiling`), whether a region lies within one (`check_held`), the
regions a process's devices need and the pieces that overlap them. `_packed` owns the
format; this is its arithmetic."""

from __future__ import annotations

import bisect
import math
from typing import Any

from jaxckpt._damage import Damaged
from jaxckpt._layout import PACKED
from jaxckpt._tree import ReadRequest


def bounds_of(index: tuple, shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """The bounds of a shard's index (a slice per axis) in an array of `shape`."""
    return tuple(
        (s.start or 0, n if s.stop is None else s.stop) for s, n in zip(index, shape, strict=True)
    )


def within(box: tuple, bounds: tuple) -> tuple[slice, ...]:
    """The index of the region `box` within an array holding the region `bounds`."""
    return tuple(slice(lo - a, hi - a) for (lo, hi), (a, _) in zip(box, bounds, strict=True))


def check_tiling(item: str, name: str, shape: tuple[int, ...], pieces: list[Any]) -> None:
    """The pieces of a leaf must hold each of its elements once: none missing (a process's
    files lost), none twice (an index that is not what jaxckpt writes). Checked on their
    bounds alone, never with an array of the leaf's shape (an index may claim any): the
    pieces jaxckpt writes are the distinct shards of one sharding, a grid, so each must be
    one cell of the grid that the pieces' starts cut (from its start to the next cut on
    every axis), none the same as another; then they are disjoint, and hold every element
    once if their volume is the leaf's. (Pieces holding no element are left out.)"""
    size = math.prod(shape)
    boxes = [p.bounds for p in pieces if all(a < b for a, b in p.bounds)]
    held = sum(math.prod(b - a for a, b in box) for box in boxes)
    if held != size:
        raise Damaged(
            f"{PACKED}/: the pieces of {item} leaf {name!r} hold {held} of its {size} "
            "elements (a process's files are missing or damaged)"
        )
    if len(boxes) <= 1:
        return  # one piece within bounds holding every element is the whole leaf
    cuts = [sorted({box[axis][0] for box in boxes} | {n}) for axis, n in enumerate(shape)]
    cells = all(
        axis[bisect.bisect_left(axis, a) + 1] == b  # a is a cut, before n: the next is there
        for box in boxes
        for (a, b), axis in zip(box, cuts, strict=True)
    )
    if not cells or len(set(boxes)) != len(boxes):
        raise Damaged(
            f"{PACKED}/: the pieces of {item} leaf {name!r} overlap, or are not the shards "
            "of one sharding (not what jaxckpt writes)"
        )


def check_held(item: str, name: str, pieces: list[Any], regions: list) -> None:
    """Each region this process's devices need must lie within one piece of the parts
    there (a part holds its process's shards whole: on the same mesh each region is one)."""
    for region in regions:
        if not any(
            all(a <= c and d <= b for (a, b), (c, d) in zip(p.bounds, region, strict=True))
            for p in pieces
        ):
            raise Damaged(
                f"{item} leaf {name!r}: the region {[list(r) for r in region]} this process "
                "needs is not within one piece that it holds"
            )


def regions_of(request: ReadRequest, shape: tuple[int, ...]) -> list | None:
    """The regions of the leaf this process's devices need (None: all of it)."""
    if request.sharding is None or request.sharding.is_fully_addressable:
        return None
    indices = request.sharding.addressable_devices_indices_map(shape).values()
    # (jax types these indices `Index | None`, but takes them from `devices_indices_map`,
    # whose indices are never None)
    return list({bounds_of(i, shape) for i in indices})  # type: ignore[arg-type]


def overlaps(piece: Any, regions: list) -> bool:
    return any(
        all(a < d and c < b for (a, b), (c, d) in zip(piece.bounds, r, strict=True))
        for r in regions
    )

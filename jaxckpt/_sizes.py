"""How long each file that Orbax or tensorstore reads whole may be, checked from one listing
(and each zarr array's metadata, in the layouts without OCDBT) before they open anything:
a file swollen by damage or malice (a 1.5 GiB sparse file in 4 KiB of disk) is refused by
its size, never allocated.

jaxckpt's own reads are bounded where they happen (`_storage.read_small`); Orbax and
tensorstore read their files themselves, each whole, sized by the file: an item's tree
metadata (`_METADATA`, `_sharding`, the msgpack `checkpoint` of releases before it), its
array metadata, OCDBT's manifests, and in the layouts without OCDBT each array's metadata
(`.zarray`, `zarr.json`) and each of its chunk files. Those are held to
`_storage.small_file_limit()`, and a chunk file to what its array's metadata says a chunk
holds. The arrays' data in OCDBT's `d/` files is read by ranges, each checked (its CRC-32C).
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
from etils import epath

from jaxckpt._layout import ORBAX_JSON_FILE, ORBAX_LEGACY_FILE, ORBAX_STEP_METADATA, ORBAX_TREE_FILE
from jaxckpt._storage import SMALL_FILE_LIMIT_VARIABLE, read_small, sizes_below, small_file_limit

_ZARR = frozenset({".zarray", "zarr.json"})  # an array's metadata: its folder holds chunks
# Each of any Orbax release, read whole wherever it is in an item.
WHOLE = frozenset(
    {ORBAX_TREE_FILE, "_sharding", ORBAX_STEP_METADATA, ORBAX_LEGACY_FILE, ORBAX_JSON_FILE}
    | {"manifest.ocdbt", ".zattrs", "descriptor.pbtxt"}
    | _ZARR
)
WHOLE_FOLDERS = frozenset({"array_metadatas"})  # each file in it, read whole
# What a codec may add to a chunk of incompressible bytes (zstd's and blosc's bounds are
# well inside it), and to a chunk of a zarr3 shard (its index).
_CODEC_SLACK = 1 / 64
_CODEC_BYTES = 2**16


def oversized(folder: epath.Path) -> list[str]:
    """The files below `folder` (a step or one of its items) that Orbax or tensorstore would
    read whole and that are longer than they can be, each named (relative to the folder's
    parent) with its size and its bound; [] when none is."""
    sizes = sizes_below(folder)
    limit = small_file_limit()
    problems = []

    def over(rel: str, bound: int, what: str) -> None:
        problems.append(f"{folder.name}/{rel}: {sizes[rel]:,} bytes, over the {bound:,} {what}")

    arrays: dict[str, int] = {}  # an array's folder: the most bytes a chunk file holds
    for rel, size in sizes.items():
        folders, name = rel.split("/")[:-1], rel.rpartition("/")[2]
        if name in WHOLE or WHOLE_FOLDERS & set(folders):
            if size > limit:
                over(rel, limit, f"such a file may hold ({SMALL_FILE_LIMIT_VARIABLE} raises it)")
            elif name in _ZARR and (bound := _chunk_bound(folder, rel, size)) is not None:
                arrays[rel.rpartition("/")[0]] = bound
    for rel, size in sizes.items():
        if rel.rpartition("/")[2] in WHOLE:
            continue
        array = next((a for a in _parents(rel) if a in arrays), None)
        if array is not None and size > arrays[array]:
            over(rel, arrays[array], f"a chunk of {array or 'its array'} can hold")
    return sorted(problems)


def _parents(rel: str) -> list[str]:
    """The folders holding `rel`, nearest first ("" the root)."""
    parts = rel.split("/")[:-1]
    return ["/".join(parts[:i]) for i in range(len(parts), -1, -1)]


def _chunk_bound(folder: epath.Path, rel: str, size: int) -> int | None:
    """The most bytes one chunk file of the array whose metadata is `rel` (`size` bytes, as
    listed) may hold (None: metadata this cannot read, which Orbax then refuses itself)."""
    try:
        meta = json.loads(read_small(folder, rel, size))
        if rel.endswith(".zarray"):
            shape, dtype = meta["chunks"], meta["dtype"]
        else:
            shape = meta["chunk_grid"]["configuration"]["chunk_shape"]
            dtype = meta["data_type"]
        raw = math.prod(int(n) for n in shape) * _itemsize(dtype)
    except (OSError, ValueError, TypeError, KeyError, AttributeError, RecursionError):
        return None
    return raw + int(raw * _CODEC_SLACK) + _CODEC_BYTES


def _itemsize(dtype: Any) -> int:
    """Bytes an element of a zarr data type (zarr2's "<f4", zarr3's "bfloat16") at most."""
    try:
        return int(np.dtype(dtype).itemsize)
    except TypeError:
        import ml_dtypes  # bfloat16, float8_*: which NumPy names only once it is imported

        try:
            return int(np.dtype(getattr(ml_dtypes, str(dtype))).itemsize)
        except (AttributeError, TypeError):
            return 16  # (the widest: complex128)

"""Hugging Face safetensors from a running job, without a checkpoint (`save_safetensors`)."""

from __future__ import annotations

import concurrent.futures
import math
import os
import shutil
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax import tree_util
from jax.experimental import multihost_utils

from jaxckpt._storage import is_remote
from jaxckpt._tree import leaf_name
from jaxckpt.errors import ConfigError
from jaxckpt.hf import _files
from jaxckpt.hf import _format as st
from jaxckpt.hf._names import NameMap, Placement, place_all

LIVE_WRITERS = min(4, os.cpu_count() or 1)  # save_safetensors writes this many leaves at once
Piece = tuple[tuple[slice, ...], np.ndarray]  # a block of a leaf (concrete bounds), on the host


def save_safetensors(
    state: Any,
    out_dir: str | os.PathLike[str],
    *,
    names: NameMap | str | os.PathLike[str] | Mapping[str, Any] | None = None,
    dtype: str | None = None,
    max_shard_size: int | str = "5GB",
    metadata: Mapping[str, str] | None = None,
    overwrite: bool = False,
    skip_unsupported: bool = True,
    include: str | Sequence[str] | None = None,
    exclude: str | Sequence[str] | None = None,
) -> _files.ExportResult:
    """Writes a live (sharded) state as HF safetensors from inside a training job.

    >>> import jax, jax.numpy as jnp, tempfile, jaxckpt
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> w = jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P("data")))
    >>> result = jaxckpt.save_safetensors({"w": w}, tempfile.mkdtemp(), overwrite=True)
    >>> result.files, result.tensors  # each process wrote its own rows; nothing gathered
    (('model.safetensors',), 1)

    Every process calls it with the same arguments. The file layout follows from names,
    dtypes and shapes alone, so process 0 writes the headers and sizes the files, then each
    process writes the bytes of its own shards at their offsets (one replica per shard, no
    all-gather), and process 0 writes the index last and renames the directory into place.
    `out_dir` must be on storage every process sees. Arguments as for `export_safetensors`.

    On object storage (gs://), which has no writes at an offset, the files are streamed one
    tensor at a time (one leaf on the host at once), by a single-process job; a multi-process
    job saves a checkpoint and exports it with `export_safetensors` instead.
    """
    remote = is_remote(out_dir)
    if remote and jax.process_count() > 1:
        raise ConfigError(
            f"save_safetensors to object storage ({out_dir}) runs in a single-process job: "
            "object storage cannot take each process's bytes at their offsets. Save a "
            "checkpoint and export it with jaxckpt.export_safetensors (or `jaxckpt export`)."
        )
    out_dir, cast, meta = _files.check_output(out_dir, overwrite, dtype, metadata)
    limit = _files.parse_size(max_shard_size)
    primary = jax.process_index() == 0
    flat = tree_util.tree_flatten_with_path(state)[0]
    # Arrays as given, Python scalars as NumPy arrays: each with a shape and a dtype.
    leaves = {leaf_name(p): x if hasattr(x, "dtype") else np.asarray(x) for p, x in flat}
    leaves = _files.select(leaves, include, exclude)
    placements = place_all(NameMap.load(names), {n: np.shape(x) for n, x in leaves.items()})
    prng_key = jax.dtypes.prng_key
    keys = [p.leaf for p in placements if jax.dtypes.issubdtype(leaves[p.leaf].dtype, prng_key)]
    host: dict[str, np.ndarray] = {}  # the leaf last copied to the host

    def get(name: str) -> np.ndarray:
        """One leaf on the host at a time (a leaf split into several tensors is copied once)."""
        if name not in host:
            host.clear()  # the previous leaf's copy goes first
            host[name] = np.asarray(leaves[name])
        return host[name]

    # Produced only on object storage: locally each process writes its shards by region.
    unsupported = _files.cannot_hold(placements, leaves, keys, cast)
    files, skipped = _files.plan(
        placements, leaves, unsupported, cast, limit, skip_unsupported, get
    )
    if remote:
        _files.write(out_dir, files, meta, overwrite, lambda: None)
        return _files.exported(out_dir, None, files, skipped)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-live")
    layouts = {f: st.encode_header([t[:3] for t in g], meta) for f, g in files.items()}
    where = {t.name: (f, layouts[f][1][t.name], t) for f, g in files.items() for t in g}

    if primary:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for f, (head, _) in layouts.items():
            with open(tmp / f, "wb") as out:
                out.write(head)
                out.truncate(len(head) + sum(t.nbytes for t in files[f]))
    multihost_utils.sync_global_devices("jaxckpt.save_safetensors:files")
    fds = {f: os.open(tmp / f, os.O_WRONLY) for f in files}

    def write_leaf(placed: Placement) -> None:
        if math.prod(np.shape(leaves[placed.leaf])) == 0:
            return  # (no bytes: its header is all of it)
        pieces = _local_pieces(leaves[placed.leaf], primary)
        plain = (placed.split, placed.transpose, placed.reshape, placed.scale) == (None,) * 4
        if plain:
            # The common case: the shards' rows go to the file with gathered writes, no copy.
            f, offset, tensor = where[placed.names[0]]
            # pieces by their rows: (start, stop) of all axes but the last
            rows: dict[tuple[tuple[int, int], ...], list[Piece]] = {}
            for index, data in pieces:
                if data.dtype == tensor.dtype:
                    key = tuple((s.start, s.stop) for s in index[:-1])
                    rows.setdefault(key, []).append((index, data))
            written: set[int] = set()  # the ids of the pieces' data written
            for block in rows.values():
                if st.write_rows(fds[f], offset, tensor.shape, block):
                    written.update(id(data) for _, data in block)
            pieces = [(index, data) for index, data in pieces if id(data) not in written]
        for axis in reversed(range(len(pieces[0][0]) if pieces else 0)):
            pieces = _join_along(pieces, axis)  # the rest: larger blocks, fewer writes
        for index, data in pieces:
            for name, region, piece in _to_tensors(
                placed, index, data, np.shape(leaves[placed.leaf])
            ):
                f, offset, tensor = where[name]
                piece = piece.astype(tensor.dtype, copy=False)
                st.write_region(fds[f], offset, tensor.shape, region, piece)

    try:
        # Leaves in parallel: device-to-host copies and writes overlap (both release the
        # GIL); at most LIVE_WRITERS leaves are on the host at once.
        with concurrent.futures.ThreadPoolExecutor(LIVE_WRITERS, "jaxckpt-export") as pool:
            list(pool.map(write_leaf, [p for p in placements if p.leaf not in skipped]))
        for fd in fds.values():
            os.fsync(fd)
    except BaseException:
        if primary:  # (nothing is left of a failed export; `out_dir` is as it was)
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        for fd in fds.values():
            os.close(fd)
    multihost_utils.sync_global_devices("jaxckpt.save_safetensors:written")
    if primary:
        _files.publish(tmp, out_dir, files, overwrite)
    multihost_utils.sync_global_devices("jaxckpt.save_safetensors:done")
    return _files.exported(out_dir, None, files, skipped)


def _local_pieces(leaf: Any, primary: bool) -> list[Piece]:
    """(index with concrete bounds, host data) of what this process writes of a leaf: one
    replica of each of its shards (on CPU devices a view, elsewhere a device-to-host copy)."""
    if isinstance(leaf, jax.Array):
        return [
            (
                tuple(slice(*s.indices(n)[:2]) for s, n in zip(sh.index, leaf.shape, strict=True)),
                np.asarray(sh.data),
            )
            for sh in leaf.addressable_shards
            if sh.replica_id == 0
        ]
    if primary:  # NumPy arrays and scalars: process 0 writes them
        value = np.asarray(leaf)
        return [(tuple(slice(0, n) for n in value.shape), value)]
    return []


def _join_along(pieces: list[Piece], axis: int) -> list[Piece]:
    """Concatenates the pieces that touch along `axis` and agree on every other axis."""
    rows: dict[tuple[tuple[int, int], ...], list[Piece]] = {}
    for index, data in pieces:
        others = tuple((s.start, s.stop) for s in index[:axis] + index[axis + 1 :])
        rows.setdefault(others, []).append((index, data))
    joined = []
    for row in rows.values():
        row.sort(key=lambda piece: piece[0][axis].start)
        runs = [[row[0]]]
        for piece in row[1:]:
            if piece[0][axis].start == runs[-1][-1][0][axis].stop:
                runs[-1].append(piece)
            else:
                runs.append([piece])
        for run in runs:
            bounds = list(run[0][0])
            bounds[axis] = slice(run[0][0][axis].start, run[-1][0][axis].stop)
            data = run[0][1] if len(run) == 1 else np.concatenate([d for _, d in run], axis)
            joined.append((tuple(bounds), data))
    return joined


def _to_tensors(
    placed: Placement, index: tuple[slice, ...], data: np.ndarray, shape: Sequence[int]
) -> list[tuple[str, tuple[slice, ...], np.ndarray]]:
    """Maps a piece of a leaf of `shape` onto its file tensors: (tensor name, region, data)."""
    pieces = []
    if placed.split is None:
        pieces.append((placed.names[0], index, data))
    else:
        axis = placed.split
        start = index[axis].start
        rest = index[:axis] + index[axis + 1 :]
        for j in range(data.shape[axis]):
            pieces.append((placed.names[start + j], rest, np.take(data, j, axis=axis)))
    if placed.reshape is not None:
        inner = [n for a, n in enumerate(shape) if a != placed.split]
        pieces = [
            (n, image, d[_files.within(block, r)].reshape(_files.lengths(image)))
            for n, r, d in pieces
            for block, image in _files.reshape_blocks(placed.reshape, r, inner)
        ]
    if placed.transpose is not None:
        pieces = [
            (n, tuple(r[a] for a in placed.transpose), d.transpose(placed.transpose))
            for n, r, d in pieces
        ]
    if placed.scale is not None:
        pieces = [(n, r, _files.scaled(d, placed.scale)) for n, r, d in pieces]
    return pieces

"""Hugging Face safetensors: export a checkpoint to sharded files, import files onto a mesh.

Export reads the checkpoint in batches of leaves (through Orbax, as host NumPy arrays, with
no devices involved; the next batch is read while the current one is written) and streams
each tensor into its file: peak memory is about two batches of `READ_BATCH_BYTES` (or the
largest leaf). The output is the HF layout, written into a temporary directory that is
renamed into place:

    out_dir/model.safetensors                               (when it fits in one shard)
    out_dir/model-00001-of-00003.safetensors ...            (otherwise)
    out_dir/model.safetensors.index.json                    (written last: {"metadata":
                                                             {"total_size": N}, "weight_map"})

Import maps every leaf of a restore target (the same target form as `restore`) to its
tensor(s), checks names, shapes and dtypes first, then builds each array from the slices its
devices need, read through a memory map: a process reads only its addressable shards.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
import os
import posixpath
import re
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np
from etils import epath
from jax import tree_util

from jaxckpt import _orbax, integrity
from jaxckpt import safetensors_format as st
from jaxckpt.errors import (
    ConfigError,
    CorruptCheckpointError,
    FormatError,
    LeafMismatchError,
    MissingShardingError,
    OutputExistsError,
    TreeMismatchError,
    UnsupportedValueError,
)
from jaxckpt.names import NameMap, Placement
from jaxckpt.plan import read_batches
from jaxckpt.storage import absolute, is_remote
from jaxckpt.tree import KEY, LeafSpec, ReadRequest, leaf_name

log = logging.getLogger("jaxckpt")

SINGLE_FILE = "model.safetensors"
READ_BATCH_BYTES = 128 * 2**20  # export reads about this many bytes per Orbax call
LIVE_WRITERS = min(4, os.cpu_count() or 1)  # save_safetensors writes this many leaves at once
INDEX_FILE = "model.safetensors.index.json"
CAST_DTYPES = {"float32": np.float32, "bfloat16": "bfloat16", "float16": np.float16}
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


@dataclasses.dataclass(frozen=True)
class ExportResult:
    out_dir: Path
    step: int | None  # None for a live export (save_safetensors)
    files: tuple[str, ...]
    tensors: int
    total_size: int
    skipped: tuple[str, ...]  # leaves left out because safetensors cannot hold them


def parse_size(size: int | str) -> int:
    """Bytes from an int or a string with decimal (5GB = 5e9) or binary (5GiB) units."""
    if isinstance(size, int):
        value = size
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", str(size).upper())
        if not m:
            raise ConfigError(f"cannot read the size {size!r}; use e.g. 5GB, 500MB or 2GiB")
        value = int(float(m.group(1)) * _UNITS[m.group(2) or "B"])
    if value <= 0:
        raise ConfigError(f"a shard size must be positive, got {size!r}")
    return value


def export_safetensors(
    checkpoint_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    step: int | None = None,
    names: NameMap | str | os.PathLike | Mapping | None = None,
    dtype: str | None = None,
    max_shard_size: int | str = "5GB",
    metadata: Mapping[str, str] | None = None,
    overwrite: bool = False,
    skip_unsupported: bool = True,
    progress: Callable[[int, int], None] | None = None,
) -> ExportResult:
    """Exports a checkpoint's state to Hugging Face-style sharded safetensors.

    The step is verified against its manifest first (`CorruptCheckpointError` if it does
    not match), so corrupt weights are never shipped.

    Args:
      checkpoint_dir: a jaxckpt checkpoint directory (only read; no lock needed).
      out_dir: the output directory; must not exist or be empty, unless `overwrite`.
      step: the step to export; None for the latest committed one.
      names: a name map (YAML path, mapping or NameMap; see `jaxckpt.names`) from leaf
        names to HF tensor names, with transposes, layer splits and drops.
      dtype: cast floating-point tensors to "float32", "bfloat16" or "float16".
      max_shard_size: per-file limit, decimal units (5GB = 5e9 bytes) or binary (GiB).
      metadata: string-to-string `__metadata__` for every file (`format: pt` by default).
      overwrite: replace a non-empty `out_dir`.
      skip_unsupported: leaves safetensors cannot hold (PRNG keys) are skipped with a log
        note; False makes them an error.
      progress: called with (bytes written, bytes to write) after each tensor.
    """
    checkpoint_dir, out_dir = absolute(checkpoint_dir), absolute(out_dir)
    out_dir, cast = _out_path(out_dir), _check_output(out_dir, overwrite, dtype)
    limit = parse_size(max_shard_size)
    name_map = NameMap.load(names)
    file_metadata = {"format": "pt", **(metadata or {})}

    store = _orbax.OrbaxStore(checkpoint_dir, read_only=True)
    try:
        step = store.resolve(step)
        if unsafe := integrity.unsafe_entries(store.step_dir(step)):  # before any read
            raise CorruptCheckpointError(step, unsafe, str(store.directory))
        # The files are hashed in a worker thread while the tensors are written to a
        # temporary directory, which is published only if they match: corrupt weights are
        # never shipped.
        with concurrent.futures.ThreadPoolExecutor(1, "jaxckpt-verify") as pool:
            report = pool.submit(integrity.verify_step, store.step_dir(step), step)

            def check() -> None:
                if problems := report.result().problems:
                    raise CorruptCheckpointError(step, problems, str(store.directory))

            try:
                info = store.read_info(step)
                specs = [LeafSpec.from_json(d) for d in info["items"][_orbax.STATE]]
                by_name = {s.name: s for s in specs}
                targets = name_map.place_all({n: s.shape for n, s in by_name.items()})
                keys = [t.leaf for t in targets if by_name[t.leaf].kind == KEY]
                targets, skipped = _without_keys(targets, keys, skip_unsupported)
                leaves = [by_name[t.leaf] for t in targets]
                reader = _LeafReader(store, step, leaves, READ_BATCH_BYTES)
                try:
                    tensors = _plan_tensors(targets, by_name, cast, reader, progress)
                    files = _pack(tensors, limit)
                    _write(out_dir, files, file_metadata, overwrite, before_publish=check)
                finally:
                    reader.close()
            except Exception:
                check()  # corruption explains the failure
                raise
    finally:
        store.close()
    total = sum(t.nbytes for t in tensors)
    log.info(
        "exported step %d to %s: %d tensors in %d file(s)", step, out_dir, len(tensors), len(files)
    )
    return ExportResult(out_dir, step, tuple(files), len(tensors), total, tuple(skipped))


def _check_output(
    out_dir: str | os.PathLike, overwrite: bool, dtype: str | None
) -> np.dtype | None:
    """Refuses a non-empty output directory (unless `overwrite`); the dtype to cast to."""
    out_dir = _out_path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise OutputExistsError(
            f"{out_dir} exists and is not empty; choose another directory or pass overwrite=True"
        )
    if dtype is not None and dtype not in CAST_DTYPES:
        raise ConfigError(f"dtype must be one of {sorted(CAST_DTYPES)}, got {dtype!r}")
    return np.dtype(CAST_DTYPES[dtype]) if dtype is not None else None


def _without_keys(
    targets: list[Placement], keys: list[str], skip_unsupported: bool
) -> tuple[list[Placement], list[str]]:
    """Leaves out the PRNG keys the map did not drop: safetensors has no dtype for them."""
    if keys and not skip_unsupported:
        raise UnsupportedValueError(
            f"PRNG key leaves cannot be safetensors: {', '.join(keys)}; drop them in the name map "
            "or pass skip_unsupported=True"
        )
    for name in keys:
        log.warning("export: skipping %s (a PRNG key; safetensors cannot hold it)", name)
    return [t for t in targets if t.leaf not in keys], keys


class Planned(NamedTuple):
    """One output tensor; `produce` gives its data when the file is written."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    produce: Callable[[], np.ndarray]

    @property
    def nbytes(self) -> int:
        return st.nbytes(self.dtype, self.shape)


class _LeafReader:
    """Reads leaves to the host in the order an export asks for them: in batches of at
    most `budget` bytes (or one larger leaf), the next batch read in a worker thread while
    the current one is written. At most two batches are held."""

    def __init__(self, store: _orbax.OrbaxStore, step: int, specs: list[LeafSpec], budget: int):
        requests = {s.name: ReadRequest(s.shape, np.dtype(s.dtype), None) for s in specs}
        self._read = lambda names: store.read_arrays(
            step, _orbax.STATE, {n: requests[n] for n in names}
        )
        self._batches = read_batches(requests, budget)
        self._batch_of = {n: i for i, batch in enumerate(self._batches) for n in batch}
        self._pool = concurrent.futures.ThreadPoolExecutor(1, "jaxckpt-export-read")
        self._reads: dict[int, concurrent.futures.Future] = {}

    def get(self, name: str) -> np.ndarray:
        i = self._batch_of[name]
        for j in [j for j in self._reads if j < i]:
            del self._reads[j]  # consumed: leaves are asked for in order
        for j in (i, i + 1):
            if j < len(self._batches) and j not in self._reads:
                self._reads[j] = self._pool.submit(self._read, self._batches[j])
        return self._reads[i].result()[name]

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._reads.clear()


def _plan_tensors(targets, by_name, cast, reader, progress=None) -> list[Planned]:
    """(name, dtype, shape, producer) for every output tensor, in leaf order; `reader.get`
    gives a leaf on the host (`_LeafReader` or `_LiveLeaves`)."""
    planned: list[Planned] = []
    done = [0]
    for target in targets:
        spec = by_name[target.leaf]
        dtype = np.dtype(spec.dtype)
        if cast is not None and _is_float(dtype):
            dtype = cast
        shape = _file_shape(target, spec.shape)
        for i, name in enumerate(target.names):

            def produce(i=i, target=target, dtype=dtype):
                value = reader.get(target.leaf)
                if target.split is not None:
                    value = np.take(value, i, axis=target.split)
                if target.transpose is not None:
                    value = value.transpose(target.transpose)
                if progress is not None:
                    done[0] += st.nbytes(dtype, value.shape)
                    progress(done[0], total)
                return value.astype(dtype, copy=False)

            planned.append(Planned(name, dtype, tuple(shape), produce))
    total = sum(t.nbytes for t in planned)
    return planned


def _pack(tensors: list[Planned], limit: int) -> dict[str, list[Planned]]:
    """Greedy, in order: a new file when the next tensor would pass the limit."""
    groups: list[list[Planned]] = [[]]
    size = 0
    for t in tensors:
        n = t.nbytes
        if groups[-1] and size + n > limit:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += n
    if len(groups) == 1:
        return {SINGLE_FILE: groups[0]}
    count = len(groups)
    return {f"model-{i + 1:05d}-of-{count:05d}.safetensors": g for i, g in enumerate(groups)}


def _write(
    out_dir: Path,
    files: dict[str, list[Planned]],
    metadata,
    overwrite: bool,
    before_publish: Callable[[], None] = lambda: None,
) -> None:
    if is_remote(out_dir):
        _write_remote(epath.Path(out_dir), files, metadata, overwrite, before_publish)
        return
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        for file_name, tensors in files.items():
            st.write_file(tmp / file_name, tensors, metadata)
        before_publish()
        _publish(tmp, out_dir, files, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _write_remote(out_dir: epath.Path, files, metadata, overwrite: bool, before_publish) -> None:
    """Object storage has no rename: the files are written in place, each object appearing
    whole when its upload completes, and the index last; a failed export removes them."""
    if overwrite and out_dir.exists():
        out_dir.rmtree()
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        for file_name, tensors in files.items():
            st.write_file(out_dir / file_name, tensors, metadata)
        before_publish()
        _write_index(out_dir, files)
    except BaseException:
        out_dir.rmtree(missing_ok=True)
        raise


def _write_index(directory, files: dict[str, list[Planned]]) -> None:
    """`model.safetensors.index.json` for a sharded export: written last, it marks the
    export complete."""
    if len(files) > 1:
        index = {
            "metadata": {"total_size": sum(t.nbytes for g in files.values() for t in g)},
            "weight_map": {t.name: f for f, g in files.items() for t in g},
        }
        (directory / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _publish(tmp: Path, out_dir: Path, files: dict[str, list[Planned]], overwrite: bool) -> None:
    """Writes the index (last: its presence means complete) and renames `tmp` into place."""
    _write_index(tmp, files)
    if not out_dir.exists():
        tmp.rename(out_dir)
        return
    if any(out_dir.iterdir()) and not overwrite:
        raise OutputExistsError(f"{out_dir} became non-empty during the export")
    old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
    out_dir.rename(old)
    tmp.rename(out_dir)
    shutil.rmtree(old, ignore_errors=True)


def _out_path(out_dir: str | os.PathLike):
    return epath.Path(out_dir) if is_remote(out_dir) else Path(out_dir)


# ------------------------------------------------------------------------- live (in-job) export


def save_safetensors(
    state: Any,
    out_dir: str | os.PathLike,
    *,
    names: NameMap | str | os.PathLike | Mapping | None = None,
    dtype: str | None = None,
    max_shard_size: int | str = "5GB",
    metadata: Mapping[str, str] | None = None,
    overwrite: bool = False,
    skip_unsupported: bool = True,
) -> ExportResult:
    """Writes a live (sharded) state as HF safetensors from inside a training job.

    Every process calls it with the same arguments. The file layout follows from names,
    dtypes and shapes alone, so process 0 writes the headers and sizes the files, then each
    process writes the bytes of its own shards at their offsets (one replica per shard, no
    all-gather), and process 0 writes the index last and renames the directory into place.
    `out_dir` must be on storage every process sees. Arguments as for `export_safetensors`.

    On object storage (gs://), which has no writes at an offset, the files are streamed one
    tensor at a time (one leaf on the host at once), by a single-process job; a multi-process
    job saves a checkpoint and exports it with `export_safetensors` instead.
    """
    from jax.experimental import multihost_utils

    out_dir = absolute(out_dir)
    if is_remote(out_dir):
        return _save_safetensors_remote(
            state, out_dir, names, dtype, max_shard_size, metadata, overwrite, skip_unsupported
        )
    out_dir, cast = Path(out_dir), _check_output(out_dir, overwrite, dtype)
    primary = jax.process_index() == 0
    leaves, targets, skipped = _live_targets(state, names, skip_unsupported)

    planned: list[Planned] = []
    for target in targets:
        leaf = leaves[target.leaf]
        dt = np.dtype(leaf.dtype)
        dt = cast if cast is not None and _is_float(dt) else dt
        shape = _file_shape(target, np.shape(leaf))
        planned += [Planned(name, dt, shape, lambda: None) for name in target.names]
    files = _pack(planned, parse_size(max_shard_size))
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-live")
    file_metadata = {"format": "pt", **(metadata or {})}
    layouts = {
        f: st.encode_header([(t.name, t.dtype, t.shape) for t in g], file_metadata)
        for f, g in files.items()
    }
    where = {t.name: (f, layouts[f][1][t.name], t.shape) for f, g in files.items() for t in g}

    if primary:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for f, (head, _) in layouts.items():
            with open(tmp / f, "wb") as out:
                out.write(head)
                out.truncate(len(head) + sum(t.nbytes for t in files[f]))
    multihost_utils.sync_global_devices("jaxckpt.save_safetensors:files")
    dtypes = {t.name: t.dtype for t in planned}
    fds = {f: os.open(tmp / f, os.O_WRONLY) for f in files}

    def write(target: Placement) -> None:
        pieces = _local_pieces(leaves[target.leaf], primary)
        if target.split is None and target.transpose is None:
            # The common case: the shards' rows go to the file with gathered writes, no copy.
            f, offset, shape = where[target.names[0]]
            rows: dict[tuple, list] = {}  # pieces by their rows (all axes but the last)
            for index, data in pieces:
                if data.dtype == dtypes[target.names[0]]:
                    key = tuple((s.start, s.stop) for s in index[:-1])
                    rows.setdefault(key, []).append((index, data))
            written = set()
            for block in rows.values():
                if st.write_rows(fds[f], offset, shape, block):
                    written.update(id(data) for _, data in block)
            pieces = [(index, data) for index, data in pieces if id(data) not in written]
        for axis in reversed(range(len(pieces[0][0]) if pieces else 0)):
            pieces = _join_along(pieces, axis)  # the rest: larger blocks, fewer writes
        for index, data in pieces:
            for tensor, region, piece in _to_tensors(target, index, data):
                f, offset, shape = where[tensor]
                piece = piece.astype(dtypes[tensor], copy=False)
                st.write_region(fds[f], offset, shape, region, piece)

    try:
        # Leaves in parallel: device-to-host copies and writes overlap (both release the
        # GIL); at most LIVE_WRITERS leaves are on the host at once.
        with concurrent.futures.ThreadPoolExecutor(LIVE_WRITERS, "jaxckpt-export") as pool:
            list(pool.map(write, targets))
        for fd in fds.values():
            os.fsync(fd)
    finally:
        for fd in fds.values():
            os.close(fd)
    multihost_utils.sync_global_devices("jaxckpt.save_safetensors:written")
    if primary:
        _publish(tmp, out_dir, files, overwrite)
    multihost_utils.sync_global_devices("jaxckpt.save_safetensors:done")
    total = sum(t.nbytes for t in planned)
    return ExportResult(out_dir, None, tuple(files), len(planned), total, tuple(skipped))


def _save_safetensors_remote(
    state, out_dir, names, dtype, max_shard_size, metadata, overwrite, skip_unsupported
) -> ExportResult:
    if jax.process_count() > 1:
        raise ConfigError(
            f"save_safetensors to object storage ({out_dir}) runs in a single-process job: "
            "object storage cannot take each process's bytes at their offsets. Save a "
            "checkpoint and export it with jaxckpt.export_safetensors (or `jaxckpt export`)."
        )
    cast = _check_output(out_dir, overwrite, dtype)
    leaves, targets, skipped = _live_targets(state, names, skip_unsupported)
    shapes = {}
    for t in targets:
        leaf = leaves[t.leaf]
        dtype = leaf.dtype if hasattr(leaf, "dtype") else np.asarray(leaf).dtype
        shapes[t.leaf] = jax.ShapeDtypeStruct(np.shape(leaf), dtype)
    planned = _plan_tensors(targets, shapes, cast, _LiveLeaves(leaves))
    files = _pack(planned, parse_size(max_shard_size))
    _write_remote(
        epath.Path(out_dir), files, {"format": "pt", **(metadata or {})}, overwrite, lambda: None
    )
    total = sum(t.nbytes for t in planned)
    return ExportResult(
        epath.Path(out_dir), None, tuple(files), len(planned), total, tuple(skipped)
    )


def _live_targets(state, names, skip_unsupported) -> tuple[dict[str, Any], list[Placement], list]:
    """A live state's leaves by name, their placements by the name map (PRNG keys left out),
    and the names of the keys left out."""
    leaves = {leaf_name(p): leaf for p, leaf in tree_util.tree_flatten_with_path(state)[0]}
    targets = NameMap.load(names).place_all({n: np.shape(x) for n, x in leaves.items()})
    keys = [t.leaf for t in targets if _is_key(leaves[t.leaf])]
    return leaves, *_without_keys(targets, keys, skip_unsupported)


class _LiveLeaves:
    """Live leaves to the host in the order an export asks for them, one at a time (a leaf
    split into several tensors is copied once)."""

    def __init__(self, leaves: Mapping[str, Any]):
        self._leaves = leaves
        self._last: tuple[str | None, Any] = (None, None)

    def get(self, name: str) -> np.ndarray:
        if self._last[0] != name:
            self._last = (None, None)  # the previous leaf's copy goes first
            self._last = (name, np.asarray(self._leaves[name]))
        return self._last[1]


def _is_key(leaf: Any) -> bool:
    return isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key)


def _local_pieces(leaf: Any, primary: bool) -> list[tuple[tuple[slice, ...], np.ndarray]]:
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
        return [(tuple(slice(None) for _ in value.shape), value)]
    return []


def _join_along(pieces: list, axis: int) -> list:
    """Concatenates the pieces that touch along `axis` and agree on every other axis."""
    rows: dict[tuple, list] = {}
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
            index = list(run[0][0])
            index[axis] = slice(run[0][0][axis].start, run[-1][0][axis].stop)
            data = run[0][1] if len(run) == 1 else np.concatenate([d for _, d in run], axis)
            joined.append((tuple(index), data))
    return joined


def _to_tensors(target: Placement, index: tuple[slice, ...], data: np.ndarray):
    """Maps a piece of a leaf onto its file tensors: (tensor name, region, data)."""
    pieces = []
    if target.split is None:
        pieces.append((target.names[0], index, data))
    else:
        axis = target.split
        start = index[axis].start
        rest = index[:axis] + index[axis + 1 :]
        for j in range(data.shape[axis]):
            pieces.append((target.names[start + j], rest, np.take(data, j, axis=axis)))
    if target.transpose is not None:
        pieces = [
            (n, tuple(r[a] for a in target.transpose), d.transpose(target.transpose))
            for n, r, d in pieces
        ]
    return pieces


# ------------------------------------------------------------------------------------ import


def load_safetensors(
    path: str | os.PathLike,
    target: Any,
    *,
    names: NameMap | str | os.PathLike | Mapping | None = None,
    ignore: str | None = None,
) -> Any:
    """Loads a safetensors file or an HF directory (indexed or single-file) onto `target`.

    Args:
      path: a `.safetensors` file, or a directory with `model.safetensors.index.json` or
        `model.safetensors`.
      target: the restore target: leaves are `jax.ShapeDtypeStruct` with a sharding, live
        `jax.Array`s, or NumPy arrays (loaded on the host). Its treedef is the result's.
      names: the same name map as for export (leaf names -> tensor names).
      ignore: a regex of file tensors that may stay unused (e.g. `lm_head.weight` when tied).

    Floating-point tensors are cast to the target's dtype; other dtypes must match. From a
    directory only regular files inside it are read, symbolic links resolved (a Hugging Face
    hub cache snapshot may read its repo's blobs); FormatError for anything else, and for
    files or an index the reference loaders would refuse.
    """
    headers = _open(absolute(path))
    name_map = NameMap.load(names)
    pairs, treedef = tree_util.tree_flatten_with_path(target)
    # Leaves are named as everywhere in jaxckpt: by their stored (dotted) name.
    leaves = [(leaf_name(p), leaf) for p, leaf in pairs]

    plans, missing, mismatched, used = [], [], [], set()
    for name, leaf in leaves:
        if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
            raise UnsupportedValueError(
                f"target leaf {name} is a {type(leaf).__name__}; give arrays"
            )
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            raise UnsupportedValueError(f"target leaf {name} is a PRNG key; safetensors hold none")
        sharding = getattr(leaf, "sharding", None)
        if not isinstance(leaf, np.ndarray) and (
            sharding is None
            or isinstance(getattr(sharding, "mesh", None), jax.sharding.AbstractMesh)
        ):
            raise MissingShardingError(
                f"target leaf {name} has no sharding on concrete devices; build the target "
                "with jaxckpt.target_on_mesh / target_from_flax, or give NumPy arrays"
            )
        placed = name_map.place(name, leaf.shape)
        if placed is None:
            raise TreeMismatchError(f"the name map drops target leaf {name}; nothing would fill it")
        want = _file_shape(placed, leaf.shape)
        for tensor in placed.names:
            used.add(tensor)
            if tensor not in headers:
                missing.append(f"{tensor} (for {name})")
                continue
            info = headers[tensor][1]
            if info.shape != want:
                mismatched.append(
                    f"{tensor}: shape {info.shape} in the file, {want} expected for {name}"
                )
            elif info.dtype != np.dtype(leaf.dtype) and not (
                _is_float(info.dtype) and _is_float(np.dtype(leaf.dtype))
            ):
                mismatched.append(
                    f"{tensor}: dtype {info.dtype} in the file, {leaf.dtype} in the target {name}"
                )
        plans.append((placed, leaf))
    extra = sorted(n for n in headers if n not in used and not (ignore and re.search(ignore, n)))
    if missing or extra:
        lines = ["the safetensors do not match the target:"]
        if missing:
            lines.append(f"  missing in the files: {', '.join(missing[:20])}")
        if extra:
            lines.append(f"  in the files but not in the target: {', '.join(extra[:20])}")
        lines.append("Fix the name map, or pass ignore= for tensors to leave unused.")
        raise TreeMismatchError("\n".join(lines))
    if mismatched:
        raise LeafMismatchError("tensors do not fit the target:\n  " + "\n  ".join(mismatched))

    arrays = [_load_leaf(placed, leaf, headers) for placed, leaf in plans]
    return tree_util.tree_unflatten(treedef, arrays)


def _open(path: str | os.PathLike) -> dict[str, tuple[Path, st.TensorInfo]]:
    """{tensor name: (file, info)} over a file or an HF directory.

    From a directory only regular files inside it are read, once symbolic links are
    resolved: the index's weight_map cannot send the load elsewhere (`../x`, `/abs`, a link
    out). One layout is allowed on purpose: a Hugging Face hub cache snapshot
    (`<repo>/snapshots/<rev>/` whose files link to `<repo>/blobs/`) may read anything inside
    `<repo>`. A file named by the caller may be a link (their choice) but must be a regular
    file. The index and the shards must agree: each tensor in the one file the index names.
    """
    if is_remote(path):
        root, inside = epath.Path(path), None  # object storage has no links to follow
        if not root.is_dir():
            if not root.exists():
                raise FileNotFoundError(f"{root} does not exist")
            return {n: (root, info) for n, info in st.read_header(root)[0].items()}
    else:
        given = Path(path)
        if not given.is_dir():
            if not os.path.lexists(given):
                raise FileNotFoundError(f"{given} does not exist")
            real = Path(os.path.realpath(given))
            return {n: (real, info) for n, info in st.read_header(real)[0].items()}
        root = Path(os.path.realpath(given))
        inside = _allowed_root(root)
    if _lexists(root / INDEX_FILE):
        index = _inside(root, INDEX_FILE, inside)
        by_file: dict[str, set[str]] = {}
        for tensor, file in _read_index(index).items():
            by_file.setdefault(_shard_name(index, tensor, file), set()).add(tensor)
        shards = {file: _inside(root, file, inside) for file in sorted(by_file)}
        found = {file: st.read_header(p)[0] for file, p in shards.items()}
        _check_index(index, by_file, found)
        return {n: (shards[f], info) for f, infos in found.items() for n, info in infos.items()}
    if _lexists(root / SINGLE_FILE):
        single = _inside(root, SINGLE_FILE, inside)
        return {n: (single, info) for n, info in st.read_header(single)[0].items()}
    raise FormatError(f"{root} holds neither {INDEX_FILE} nor {SINGLE_FILE}")


MAX_INDEX = 100 * 1000 * 1000  # bytes; real indexes are kilobytes to a few megabytes


def _lexists(path) -> bool:
    """Whether the name exists (a dangling link counts: it is then refused, not skipped)."""
    return path.exists() if is_remote(path) else os.path.lexists(path)


def _allowed_root(directory: Path) -> Path:
    """What files in the (resolved) `directory` may resolve into: itself, or for a hub cache
    snapshot `<repo>/snapshots/<rev>` beside `<repo>/blobs`, the whole `<repo>`."""
    snapshots = directory.parent
    if snapshots.name == "snapshots" and (snapshots.parent / "blobs").is_dir():
        return snapshots.parent
    return directory


def _inside(root, name: str, inside: Path | None):
    """`root / name` resolved, refused unless it stays inside `inside` (None: remote)."""
    if inside is None:
        return root / name
    real = Path(os.path.realpath(root / name))
    if not real.is_relative_to(inside):
        raise FormatError(
            f"{st.quote_name(str(root / name), 4096)} leads to {st.quote_name(str(real), 4096)}, outside "
            f"{inside}; only files inside the model "
            "directory are read. Copy the file into the directory, or load it by its own path"
        )
    return real


def _shard_name(index, tensor: str, file: str) -> str:
    """A weight_map file name, normalized; refused if absolute, with `..` or a URL scheme."""
    parts = file.replace("\\", "/").split("/")
    if not file or "\0" in file or file.startswith(("/", "\\")) or ".." in parts or "://" in file:
        raise FormatError(
            f"{index}: weight_map puts {st.quote_name(tensor)} in {st.quote_name(file)}; shard names must "
            "be relative to the index's directory, without '..'. Fix the index"
        )
    return posixpath.normpath(file)


def _read_index(index) -> dict[str, str]:
    """The weight_map of an HF index, its types checked."""
    with st.open_regular(index) as (f, size, _):
        if size > MAX_INDEX:
            raise FormatError(f"{index} has {size} bytes, too many for an index (at most 100 MB)")
        try:
            raw = f.read(MAX_INDEX + 1)
        except OSError as e:
            raise FormatError(f"cannot read {index}: {e.strerror or type(e).__name__}") from None
    if len(raw) > MAX_INDEX:
        raise FormatError(f"{index} grew past 100 MB while it was read")
    data = st.parse_json(raw, str(index))
    fix = "re-download or re-export the model"
    if not isinstance(data, dict) or not isinstance(data.get("weight_map"), dict):
        raise FormatError(
            f"{index} is not a valid index: it must be a JSON object whose weight_map is an "
            f"object of tensor names to file names; {fix}"
        )
    weight_map = data["weight_map"]
    if not weight_map:
        raise FormatError(f"{index} is not a valid index: its weight_map names no tensors; {fix}")
    if bad := [t for t, f in weight_map.items() if not isinstance(f, str)]:
        raise FormatError(
            f"{index} is not a valid index: weight_map maps {st.quote_name(bad[0])} to something "
            f"other than a file name (a string); {fix}"
        )
    metadata = data.get("metadata", {})
    if not isinstance(metadata, dict):
        raise FormatError(f"{index} is not a valid index: its metadata is not an object; {fix}")
    # transformers and huggingface_hub write an int; older transformers counted a bool as
    # 1/8 byte and could write a float. It is not used here, only checked for sense.
    total = metadata.get("total_size", 0)
    if type(total) not in (int, float) or total < 0:
        raise FormatError(
            f"{index} is not a valid index: metadata.total_size must be a non-negative number "
            f"of bytes; {fix}"
        )
    return weight_map


def _check_index(index, by_file: dict[str, set[str]], found: dict[str, dict]) -> None:
    """Each tensor in exactly one shard, the one the index names for it."""
    fix = "the export is incomplete or was altered: re-download or re-export it"
    owner: dict[str, str] = {}
    for file, tensors in found.items():
        for name in tensors:
            if name in owner:
                raise FormatError(
                    f"tensor {st.quote_name(name)} is in both {st.quote_name(owner[name])} and "
                    f"{st.quote_name(file)} (listed in "
                    f"{index}); a tensor must be in exactly one shard: {fix}"
                )
            owner[name] = file
    for file, tensors in found.items():
        if missing := sorted(by_file[file] - tensors.keys()):
            names = ", ".join(map(st.quote_name, missing[:5])) + (
                " ..." if len(missing) > 5 else ""
            )
            raise FormatError(
                f"{index} puts {names} in {st.quote_name(file)}, which does not hold them: {fix}"
            )
        if extra := sorted(tensors.keys() - by_file[file]):
            names = ", ".join(map(st.quote_name, extra[:5])) + (" ..." if len(extra) > 5 else "")
            raise FormatError(
                f"{st.quote_name(file)} holds {names}, which {index} does not put in that file: {fix}"
            )


def _file_shape(placed: Placement, shape) -> tuple[int, ...]:
    """The shape of each file tensor a leaf of `shape` becomes (split, then transposed)."""
    shape = list(shape)
    if placed.split is not None:
        del shape[placed.split]
    if placed.transpose is not None:
        if sorted(placed.transpose) != list(range(len(shape))):
            raise ConfigError(
                f"transpose {placed.transpose} does not fit leaf {placed.leaf!r} "
                f"(tensor shape {tuple(shape)})"
            )
        shape = [shape[a] for a in placed.transpose]
    return tuple(shape)


def _is_float(dtype: np.dtype) -> bool:
    return np.issubdtype(dtype, np.floating) or dtype.name == "bfloat16"


def _load_leaf(placed: Placement, leaf: Any, headers) -> Any:
    dtype = np.dtype(leaf.dtype)
    inverse = None if placed.transpose is None else tuple(np.argsort(placed.transpose))

    def read_one(tensor: str, index: tuple[slice, ...]) -> np.ndarray:
        path, info = headers[tensor]
        file_index = (
            index if placed.transpose is None else tuple(index[a] for a in placed.transpose)
        )
        value = (
            np.zeros(info.shape, info.dtype)[file_index]
            if info.nbytes == 0
            else st.read_slice(path, info, file_index)
        )
        return value if inverse is None else value.transpose(inverse)

    def read(index: tuple[slice, ...]) -> np.ndarray:
        index = tuple(index) + (slice(None),) * (len(leaf.shape) - len(index))
        if placed.split is None:
            value = read_one(placed.names[0], index)
        else:
            axis = placed.split
            rest = index[:axis] + index[axis + 1 :]
            layers = range(*index[axis].indices(leaf.shape[axis]))
            value = np.stack([read_one(placed.names[i], rest) for i in layers], axis=axis)
        return value.astype(dtype, copy=False)

    if isinstance(leaf, np.ndarray):
        return read(tuple(slice(None) for _ in leaf.shape))
    return jax.make_array_from_callback(tuple(leaf.shape), leaf.sharding, read)

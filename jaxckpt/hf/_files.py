"""Hugging Face safetensors: what export, live export and import share.

Both exports plan their output tensors (`Planned`), pack them into shards in order and
write the HF layout into a temporary directory that is renamed into place:

    out_dir/model.safetensors                               (when it fits in one shard)
    out_dir/model-00001-of-00003.safetensors ...            (otherwise)
    out_dir/model.safetensors.index.json                    (written last: {"metadata":
                                                             {"total_size": N}, "weight_map"})

Import reads that layout. Every flow maps a leaf to its file tensors with `file_shape`, and
a block of a reshaped tensor to blocks of the file's with `reshape_blocks`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import re
import shutil
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import NamedTuple, Protocol, TypeVar

import numpy as np
import numpy.typing as npt
from etils import epath

from jaxckpt._escape import escape
from jaxckpt._storage import absolute, is_remote
from jaxckpt.errors import ConfigError, NameMapError, OutputExistsError, UnsupportedValueError
from jaxckpt.hf import _format as st
from jaxckpt.hf._names import Placement, reshape_text

log = logging.getLogger("jaxckpt")

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CAST_DTYPES: dict[str, npt.DTypeLike] = {
    "float32": np.float32,
    "bfloat16": "bfloat16",
    "float16": np.float16,
}
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
# The fix an UnsupportedValueError for unsupported leaves names (the CLI rewrites it).
SKIP_HINT = "leave them out with exclude=, drop them in the name map, or pass skip_unsupported=True"
T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class ExportResult:
    out_dir: Path | epath.Path  # an epath on object storage (gs://)
    step: int | None  # None for a live export (save_safetensors)
    files: tuple[str, ...]
    tensors: int
    total_size: int
    skipped: tuple[str, ...]  # leaves left out because safetensors cannot hold them (logged)


class Planned(NamedTuple):
    """One output tensor; `produce` gives its data when the file is written."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    produce: Callable[[], np.ndarray]

    @property
    def nbytes(self) -> int:
        return st.nbytes(self.dtype, self.shape)


class Leaf(Protocol):
    """What an export plans a leaf's tensors from: its `LeafSpec` (from a checkpoint: the
    dtype a name) or, in a live export, the array itself."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def dtype(self) -> str | np.dtype: ...


def exported(
    out_dir: Path | epath.Path,
    step: int | None,
    files: dict[str, list[Planned]],
    skipped: Sequence[str],
) -> ExportResult:
    tensors = [t for group in files.values() for t in group]
    total = sum(t.nbytes for t in tensors)
    return ExportResult(out_dir, step, tuple(files), len(tensors), total, tuple(skipped))


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


def check_output(
    out_dir: str | os.PathLike[str],
    overwrite: bool,
    dtype: str | None,
    metadata: Mapping[str, str] | None,
) -> tuple[Path | epath.Path, np.dtype | None, dict[str, str]]:
    """The output path (absolute; an epath on object storage), refused when non-empty (unless
    `overwrite`); the dtype to cast to; every file's `__metadata__` (`format: pt` by default)."""
    out_dir = epath.Path(out_dir) if is_remote(out_dir) else Path(absolute(out_dir))
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise OutputExistsError(
            f"{out_dir} exists and is not empty; choose another directory or pass overwrite=True"
        )
    if dtype is not None and dtype not in CAST_DTYPES:
        raise ConfigError(f"dtype must be one of {sorted(CAST_DTYPES)}, got {dtype!r}")
    cast = np.dtype(CAST_DTYPES[dtype]) if dtype is not None else None
    return out_dir, cast, {"format": "pt", **(metadata or {})}


def select(
    leaves: Mapping[str, T],
    include: str | Sequence[str] | None,
    exclude: str | Sequence[str] | None,
) -> dict[str, T]:
    """The leaves an export keeps: those whose name one `include` regex matches (all when
    there is none) and no `exclude` regex does, searched in the dotted name as `jaxckpt
    inspect --filter` searches it. A pattern that matches no leaf is a ConfigError naming it."""
    kept = dict(leaves)
    for kind, given in (("include", include), ("exclude", exclude)):
        patterns = [given] if isinstance(given, str) else list(given or ())
        if not patterns:
            continue
        compiled = [_regex(p, kind) for p in patterns]
        for pattern, regex in zip(patterns, compiled, strict=True):
            if not any(regex.search(n) for n in leaves):
                examples = ", ".join(st.quote_name(n) for n in list(leaves)[:3]) or "none"
                raise ConfigError(
                    f"the {kind} pattern {st.quote_name(pattern)} matches no leaf; leaf names "
                    f"look like {examples} (`jaxckpt inspect DIR` lists them)"
                )
        wanted = kind == "include"
        kept = {n: v for n, v in kept.items() if any(r.search(n) for r in compiled) == wanted}
    if leaves and not kept:
        raise ConfigError("the include and exclude patterns leave no leaf to export")
    return kept


def _regex(pattern: object, kind: str) -> re.Pattern[str]:
    if not isinstance(pattern, str):
        raise ConfigError(f"{kind} patterns are regex strings, got {type(pattern).__name__}")
    try:
        return re.compile(pattern)
    except re.error as e:
        raise ConfigError(
            f"the {kind} pattern {pattern!r} is not a regular expression: {e}"
        ) from None


def cannot_hold(
    placements: Sequence[Placement],
    specs: Mapping[str, Leaf],
    keys: Collection[str],
    cast: np.dtype | None,
) -> dict[str, str]:
    """The placed leaves safetensors has no dtype for, with why: `keys` (PRNG keys) and
    leaves whose dtype (after `cast`) has no safetensors code (int4, complex128, ...)."""
    why = {}
    for placed in placements:
        if placed.leaf in keys:
            why[placed.leaf] = "a PRNG key"
            continue
        dtype = specs[placed.leaf].dtype
        with contextlib.suppress(TypeError):  # a dtype NumPy does not know stays a string
            dtype = out_dtype(np.dtype(dtype), cast)
        if dtype not in st.CODES:
            why[placed.leaf] = f"dtype {dtype}"
    return why


def out_dtype(dtype: np.dtype, cast: np.dtype | None) -> np.dtype:
    return cast if cast is not None and is_float(dtype) else dtype


def plan(
    placements: Sequence[Placement],
    specs: Mapping[str, Leaf],
    unsupported: Mapping[str, str],
    cast: np.dtype | None,
    limit: int,
    skip_unsupported: bool,
    get: Callable[[str], np.ndarray],
    progress: Callable[[int, int], None] | None = None,
) -> tuple[dict[str, list[Planned]], list[str]]:
    """The files of an export (`pack`), every output tensor in leaf order, and the leaves
    left out: `unsupported` (from `cannot_hold`: leaf name -> why), skipped with a log note
    each, or refused unless `skip_unsupported`. `get(leaf name)` gives a leaf on the host
    (from the export's batch reader or a live job's leaves)."""
    if unsupported and not skip_unsupported:
        listed = [f"{st.quote_name(n)} ({why})" for n, why in list(unsupported.items())[:20]]
        more = f" (and {len(unsupported) - 20} more)" if len(unsupported) > 20 else ""
        raise UnsupportedValueError(
            f"these leaves cannot be safetensors: {', '.join(listed)}{more}; " + SKIP_HINT
        )
    for name, why in unsupported.items():
        log.warning("export: skipping %s (%s; safetensors cannot hold it)", escape(name), why)
    planned: list[Planned] = []
    done = [0]
    for placed in placements:
        if placed.leaf in unsupported:
            continue
        spec = specs[placed.leaf]
        dtype = out_dtype(np.dtype(spec.dtype), cast)
        shape = file_shape(placed, spec.shape, spec.dtype)
        for i, name in enumerate(placed.names):

            def produce(
                i: int = i, placed: Placement = placed, dtype: np.dtype = dtype
            ) -> np.ndarray:
                value = get(placed.leaf)
                if placed.split is not None:
                    value = np.take(value, i, axis=placed.split)
                if placed.reshape is not None:
                    value = value.reshape(merged(value.shape, placed.reshape))
                if placed.transpose is not None:
                    value = value.transpose(placed.transpose)
                if placed.scale is not None:
                    value = scaled(value, placed.scale)
                if progress is not None:
                    done[0] += st.nbytes(dtype, value.shape)
                    progress(done[0], total)
                return value.astype(dtype, copy=False)

            planned.append(Planned(name, dtype, shape, produce))
    total = sum(t.nbytes for t in planned)
    return pack(planned, limit), list(unsupported)


def pack(tensors: list[Planned], limit: int) -> dict[str, list[Planned]]:
    """Greedy, in order: a new file when the next tensor would pass the limit."""
    groups: list[list[Planned]] = [[]]
    size = 0
    for t in tensors:
        if groups[-1] and size + t.nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += t.nbytes
    if len(groups) == 1:
        return {SINGLE_FILE: groups[0]}
    return {f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors": g for i, g in enumerate(groups)}


def write(
    out_dir: Path | epath.Path,
    files: dict[str, list[Planned]],
    metadata: Mapping[str, str],
    overwrite: bool,
    before_publish: Callable[[], None],
) -> None:
    """Writes the files into a temporary directory, then publishes it unless
    `before_publish()` raises. Object storage has no rename: there each file appears whole
    when its upload completes, the index last; a failed export removes them."""
    if isinstance(out_dir, epath.Path):  # on object storage (what `check_output` makes)
        tmp = out_dir
        if overwrite:
            out_dir.rmtree(missing_ok=True)
        out_dir.mkdir(parents=True, exist_ok=True)
    else:
        tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)  # and out_dir's parent, where it is renamed to
    try:
        for file_name, tensors in files.items():
            st.write_file(tmp / file_name, tensors, metadata)
        before_publish()
        publish(tmp, out_dir, files, overwrite)
    except BaseException:
        if tmp is out_dir:
            out_dir.rmtree(missing_ok=True)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def publish(
    tmp: Path | epath.Path,
    out_dir: Path | epath.Path,
    files: dict[str, list[Planned]],
    overwrite: bool,
) -> None:
    """Writes the index (for a sharded export; last: its presence means complete) and
    renames `tmp` into place (unless it is `out_dir`, written in place)."""
    if len(files) > 1:
        index = {
            "metadata": {"total_size": sum(t.nbytes for g in files.values() for t in g)},
            "weight_map": {t.name: f for f, g in files.items() for t in g},
        }
        (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    if tmp is out_dir:
        return
    if not out_dir.exists():
        tmp.rename(out_dir)
        return
    if any(out_dir.iterdir()) and not overwrite:
        raise OutputExistsError(f"{out_dir} became non-empty during the export")
    old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
    out_dir.rename(old)
    tmp.rename(out_dir)
    shutil.rmtree(old, ignore_errors=True)


def file_shape(placed: Placement, shape: Sequence[int], dtype: npt.DTypeLike) -> tuple[int, ...]:
    """The shape of each file tensor a leaf of `shape` becomes (split, reshaped, then
    transposed); refuses a placement that does not fit the leaf."""
    shape = list(shape)
    if placed.split is not None:
        del shape[placed.split]
    if placed.reshape is not None:
        if [a for group in placed.reshape for a in group] != list(range(len(shape))):
            raise NameMapError(
                f"reshape {reshape_text(placed.reshape)} does not fit leaf {placed.leaf!r} "
                f"(tensor shape {tuple(shape)}): it must take each axis 0..{len(shape) - 1} "
                "once, in order (a list merges consecutive axes)"
            )
        shape = list(merged(shape, placed.reshape))
    if placed.transpose is not None:
        if sorted(placed.transpose) != list(range(len(shape))):
            raise ConfigError(
                f"transpose {placed.transpose} does not fit leaf {placed.leaf!r} "
                f"(tensor shape {tuple(shape)})"
            )
        shape = [shape[a] for a in placed.transpose]
    if placed.scale is not None and not is_float(np.dtype(dtype)):
        raise NameMapError(
            f"leaf {placed.leaf!r} is {np.dtype(dtype)}: only floating-point leaves can be scaled"
        )
    return tuple(shape)


def merged(shape: Sequence[int], groups: Sequence[Sequence[int]]) -> tuple[int, ...]:
    """`shape` with each group of axes merged into one."""
    return tuple(math.prod(shape[a] for a in group) for group in groups)


def scaled(value: np.ndarray, scale: float) -> np.ndarray:
    """`value * scale`, rounded once (to the dtype the caller casts to)."""
    return value.astype(np.float64) * scale


def reshape_blocks(
    groups: tuple[tuple[int, ...], ...] | None, index: tuple[slice, ...], shape: Sequence[int]
) -> list[tuple[tuple[slice, ...], tuple[slice, ...]]]:
    """A block `index` (slices with bounds) of a tensor of `shape`, as (block, image) pairs:
    its parts whose images under the reshape that merges `groups` are blocks too. One part
    unless a slice cuts inside a merged axis (e.g. head_dim sharded under heads): a block's
    image is a block when, in each group, the axes after its first longer than 1 are whole."""
    if groups is None:
        return [(index, index)]
    blocks = [index]
    for group in groups:
        blocks = [part for block in blocks for part in _cut(block, shape, group)]
    images = []
    for block in blocks:
        image = []
        for group in groups:
            start, size = 0, 1
            for a in group:
                start = start * shape[a] + block[a].start
                size *= block[a].stop - block[a].start
            image.append(slice(start, start + size))
        images.append((block, tuple(image)))
    return images


def _cut(
    block: tuple[slice, ...], shape: Sequence[int], group: tuple[int, ...]
) -> list[tuple[slice, ...]]:
    sizes = [block[a].stop - block[a].start for a in group]
    partial = [j for j, a in enumerate(group) if sizes[j] != shape[a]]
    wide = [j for j in range(partial[-1]) if sizes[j] > 1] if partial else []
    if not wide:
        return [block]
    a = group[wide[0]]  # cut into single indices along it: each part then fits
    return [
        part
        for i in range(block[a].start, block[a].stop)
        for part in _cut((*block[:a], slice(i, i + 1), *block[a + 1 :]), shape, group)
    ]


def within(block: tuple[slice, ...], index: tuple[slice, ...]) -> tuple[slice, ...]:
    """`block`, a part of the block `index`, relative to it."""
    return tuple(
        slice(b.start - i.start, b.stop - i.start) for b, i in zip(block, index, strict=True)
    )


def lengths(index: tuple[slice, ...]) -> tuple[int, ...]:
    return tuple(s.stop - s.start for s in index)


def is_float(dtype: np.dtype) -> bool:
    return np.issubdtype(dtype, np.floating) or dtype.name == "bfloat16"

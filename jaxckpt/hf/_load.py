"""Load Hugging Face safetensors onto a mesh (`load_safetensors`).

Every leaf of a restore target (the same target form as `restore`) is mapped to its
tensor(s), names, shapes and dtypes are checked first, then each array is built from the
slices its devices need, read through a memory map: a process reads only its addressable
shards. Files and indexes are checked as the reference loaders check them.
"""

from __future__ import annotations

import os
import posixpath
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
from etils import epath
from jax import tree_util

from jaxckpt._storage import SizeError, absolute, is_remote, read_whole
from jaxckpt._tree import leaf_name
from jaxckpt.errors import (
    FormatError,
    LeafMismatchError,
    MissingShardingError,
    NoCheckpointError,
    TreeMismatchError,
    UnsupportedValueError,
)
from jaxckpt.hf import _format as st
from jaxckpt.hf._files import (
    INDEX_FILE,
    SINGLE_FILE,
    file_shape,
    is_float,
    lengths,
    reshape_blocks,
    within,
)
from jaxckpt.hf._names import NameMap, Placement, place

MAX_INDEX = 100 * 1000 * 1000  # bytes; real indexes are kilobytes to a few megabytes


def load_safetensors(
    path: str | os.PathLike[str],
    target: Any,
    *,
    names: NameMap | str | os.PathLike[str] | Mapping[str, Any] | None = None,
    ignore: str | None = None,
) -> Any:
    """Loads a safetensors file or an HF directory (indexed or single-file) onto `target`.

    >>> import jax.numpy as jnp, numpy as np, tempfile, jaxckpt
    >>> out = tempfile.mkdtemp()
    >>> _ = jaxckpt.save_safetensors({"w": jnp.arange(4.0)}, out, overwrite=True)
    >>> jaxckpt.load_safetensors(out, {"w": np.zeros(4, np.float32)})["w"].tolist()
    [0.0, 1.0, 2.0, 3.0]

    Args:
      path: a `.safetensors` file, or a directory with `model.safetensors.index.json` or
        `model.safetensors`.
      target: the restore target: leaves are [`jax.ShapeDtypeStruct`][jax.ShapeDtypeStruct]
        with a sharding, live [`jax.Array`][jax.Array]s, or [NumPy arrays][numpy.ndarray]
        (loaded on the host). Its treedef is the result's.
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
    plans, missing, mismatched, used = [], [], [], set()
    for keys, leaf in pairs:
        name = leaf_name(keys)  # as everywhere in jaxckpt: the stored (dotted) name
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
        placed = place(name_map, name, leaf.shape)
        if placed is None:
            raise TreeMismatchError(f"the name map drops target leaf {name}; nothing would fill it")
        dtype = np.dtype(leaf.dtype)
        want = file_shape(placed, leaf.shape, dtype)
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
            elif info.dtype != dtype and not (is_float(info.dtype) and is_float(dtype)):
                mismatched.append(
                    f"{tensor}: dtype {info.dtype} in the file, {leaf.dtype} in the target {name}"
                )
        plans.append((placed, leaf))
    extra = sorted(n for n in headers if n not in used and not (ignore and re.search(ignore, n)))
    if missing or extra:
        parts = [("missing in the files", missing), ("in the files but not in the target", extra)]
        lines = ["the safetensors do not match the target:"]
        lines += [f"  {what}: {', '.join(names[:20])}" for what, names in parts if names]
        lines.append("Fix the name map, or pass ignore= for tensors to leave unused.")
        raise TreeMismatchError("\n".join(lines))
    if mismatched:
        raise LeafMismatchError("tensors do not fit the target:\n  " + "\n  ".join(mismatched))

    arrays = [_load_leaf(placed, leaf, headers) for placed, leaf in plans]
    return tree_util.tree_unflatten(treedef, arrays)


def _open(path: str | os.PathLike[str]) -> dict[str, tuple[Path | epath.Path, st.TensorInfo]]:
    """{tensor name: (file, info)} over a file or an HF directory.

    From a directory only regular files inside it are read, once symbolic links are
    resolved: the index's weight_map cannot send the load elsewhere (`../x`, `/abs`, a link
    out). One layout is allowed on purpose: a Hugging Face hub cache snapshot
    (`<repo>/snapshots/<rev>/` whose files link to `<repo>/blobs/`) may read anything inside
    `<repo>`. A file named by the caller may be a link (their choice) but must be a regular
    file. The index and the shards must agree: each tensor in the one file the index names.
    """
    remote = is_remote(path)  # object storage has no links to follow
    given = epath.Path(path) if remote else Path(path)
    real = given if remote else Path(os.path.realpath(given))
    exists = (lambda p: p.exists()) if remote else os.path.lexists  # a dangling link: refused
    if not given.is_dir():
        if not exists(given):
            raise NoCheckpointError(
                f"{given} does not exist: no safetensors file or model directory there"
            )
        return {n: (real, info) for n, info in st.read_header(real)[0].items()}
    # What files may resolve into (None: anywhere); for a hub cache snapshot, its <repo>.
    inside = None if remote else real
    if not remote and real.parent.name == "snapshots" and (real.parent.parent / "blobs").is_dir():
        inside = real.parent.parent
    if exists(real / INDEX_FILE):
        index = _inside(real, INDEX_FILE, inside)
        by_file: dict[str, set[str]] = {}
        for tensor, file in _read_index(index).items():
            by_file.setdefault(_shard_name(index, tensor, file), set()).add(tensor)
        shards = {file: _inside(real, file, inside) for file in sorted(by_file)}
        found = {file: st.read_header(p)[0] for file, p in shards.items()}
        _check_index(index, by_file, found)
        return {n: (shards[f], info) for f, infos in found.items() for n, info in infos.items()}
    if exists(real / SINGLE_FILE):
        single = _inside(real, SINGLE_FILE, inside)
        return {n: (single, info) for n, info in st.read_header(single)[0].items()}
    raise FormatError(f"{real} holds neither {INDEX_FILE} nor {SINGLE_FILE}")


def _inside(root: Path | epath.Path, name: str, inside: Path | None) -> Path | epath.Path:
    """`root / name` resolved, refused unless it stays inside `inside` (None: remote)."""
    if inside is None:
        return root / name
    real = Path(os.path.realpath(root / name))
    if not real.is_relative_to(inside):
        raise FormatError(
            f"{st.quote_name(str(root / name), 4096)} leads to {st.quote_name(str(real), 4096)}, "
            f"outside {inside}; only files inside the model directory are read. Copy the file "
            "into the directory, or load it by its own path"
        )
    return real


def _shard_name(index: Path | epath.Path, tensor: str, file: str) -> str:
    """A weight_map file name, normalized; refused if absolute, with `..` or a URL scheme."""
    parts = file.replace("\\", "/").split("/")
    if not file or "\0" in file or file.startswith(("/", "\\")) or ".." in parts or "://" in file:
        raise FormatError(
            f"{index}: weight_map puts {st.quote_name(tensor)} in {st.quote_name(file)}; shard "
            "names must be relative to the index's directory, without '..'. Fix the index"
        )
    return posixpath.normpath(file)


def _read_index(index: Path | epath.Path) -> dict[str, str]:
    """The weight_map of an HF index, its types checked."""
    with st.open_regular(index) as (f, size, _):
        try:
            raw = read_whole(f, size, limit=MAX_INDEX)
        except SizeError:
            raise FormatError(
                f"{index} has {size} bytes, too many for an index (at most 100 MB)"
            ) from None
        except OSError as e:
            raise FormatError(f"cannot read {index}: {e.strerror or e}") from None
    data = st.parse_json(raw, str(index))

    def invalid(why: str) -> FormatError:
        return FormatError(
            f"{index} is not a valid index: {why}; re-download or re-export the model"
        )

    if not isinstance(data, dict) or not isinstance(data.get("weight_map"), dict):
        raise invalid(
            "it must be a JSON object whose weight_map is an object of tensor names to file names"
        )
    weight_map: dict[str, str] = data["weight_map"]  # (its values are checked next)
    if not weight_map:
        raise invalid("its weight_map names no tensors")
    if bad := [t for t, f in weight_map.items() if not isinstance(f, str)]:
        not_a_name = "something other than a file name (a string)"
        raise invalid(f"weight_map maps {st.quote_name(bad[0])} to {not_a_name}")
    metadata = data.get("metadata", {})
    if not isinstance(metadata, dict):
        raise invalid("its metadata is not an object")
    # transformers and huggingface_hub write an int; older transformers counted a bool as
    # 1/8 byte and could write a float. It is not used here, only checked for sense.
    total = metadata.get("total_size", 0)
    if type(total) not in (int, float) or total < 0:
        raise invalid("metadata.total_size must be a non-negative number of bytes")
    return weight_map


def _check_index(
    index: Path | epath.Path,
    by_file: dict[str, set[str]],
    found: dict[str, dict[str, st.TensorInfo]],
) -> None:
    """Each tensor in exactly one shard, the one the index names for it."""
    fix = "the export is incomplete or was altered: re-download or re-export it"
    owner: dict[str, str] = {}

    def listed(names: list[str]) -> str:
        return ", ".join(map(st.quote_name, names[:5])) + (" ..." if len(names) > 5 else "")

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
            raise FormatError(
                f"{index} puts {listed(missing)} in {st.quote_name(file)}, which does not hold "
                f"them: {fix}"
            )
        if extra := sorted(tensors.keys() - by_file[file]):
            raise FormatError(
                f"{st.quote_name(file)} holds {listed(extra)}, which {index} does not put in that "
                f"file: {fix}"
            )


def _load_leaf(
    placed: Placement, leaf: Any, headers: Mapping[str, tuple[Path | epath.Path, st.TensorInfo]]
) -> Any:
    """Reads each block a device needs: per file tensor (one per layer of a split axis) the
    blocks of the file the reshape maps it to, transposed back, unmerged, unscaled."""
    dtype = np.dtype(leaf.dtype)
    inverse = None if placed.transpose is None else tuple(np.argsort(placed.transpose))
    inner = [n for a, n in enumerate(leaf.shape) if a != placed.split]  # one file tensor's

    def read_image(tensor: str, image: tuple[slice, ...]) -> np.ndarray:
        path, info = headers[tensor]
        file_index = (
            image if placed.transpose is None else tuple(image[a] for a in placed.transpose)
        )
        value = (
            np.zeros(info.shape, info.dtype)[file_index]
            if info.nbytes == 0
            else st.read_slice(path, info, file_index)
        )
        return value if inverse is None else value.transpose(inverse)

    def read_one(tensor: str, index: tuple[slice, ...]) -> np.ndarray:
        blocks = reshape_blocks(placed.reshape, index, inner)
        if len(blocks) == 1:
            return read_image(tensor, blocks[0][1]).reshape(lengths(index))
        value = np.empty(lengths(index), headers[tensor][1].dtype)
        for block, image in blocks:
            value[within(block, index)] = read_image(tensor, image).reshape(lengths(block))
        return value

    def read(index: tuple[slice, ...]) -> np.ndarray:
        index = tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, leaf.shape, strict=True))
        if placed.split is None:
            value = read_one(placed.names[0], index)
        else:
            axis = placed.split
            rest = index[:axis] + index[axis + 1 :]
            layers = range(index[axis].start, index[axis].stop)
            value = np.stack([read_one(placed.names[i], rest) for i in layers], axis=axis)
        if placed.scale is not None:
            value = value.astype(np.float64) / placed.scale
        return value.astype(dtype, copy=False)

    if isinstance(leaf, np.ndarray):
        return read(tuple(slice(None) for _ in leaf.shape))
    # (jax types the callback's index `Index | None`, but asserts it is not None first)
    return jax.make_array_from_callback(tuple(leaf.shape), leaf.sharding, read)  # type: ignore[arg-type]

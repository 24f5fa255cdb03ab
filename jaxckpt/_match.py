"""A restore target matched against what was saved: which arrays to read, onto which
shardings, and how to rebuild the target's tree from them (`jaxckpt._tree` is how a tree
became named arrays and leaf specs).

Missing/extra leaves and shape/dtype differences are found by comparing names and specs,
and reported by path before a single array byte is read. Restoring with a target
unflattens with the target's own treedef, so any pytree node type comes back as itself;
without one, nested dicts and lists are rebuilt from the recorded paths (and empty nodes).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax import tree_util

from jaxckpt._tree import (
    KEY,
    PYTHON,
    EmptyNode,
    LeafSpec,
    ReadRequest,
    display,
    is_python_scalar,
    leaf_name,
    path_entries,
)
from jaxckpt.errors import (
    LeafMismatchError,
    MissingShardingError,
    ShardingError,
    TreeMismatchError,
)

log = logging.getLogger("jaxckpt")


def plan_restore(
    target: Any,
    saved: Sequence[LeafSpec],
    *,
    item: str,
    step: int,
    partial: bool = False,
    home: jax.sharding.Sharding | None = None,
) -> tuple[dict[str, ReadRequest], Callable[[Mapping[str, Any]], Any]]:
    """Checks `target` against the saved specs and says what to read and how to rebuild.

    Returns the read requests by stored name and a function that turns the arrays read into
    a tree with the target's structure and leaf types. With `partial`, saved leaves that the
    target lacks are allowed (and not read). Uncommitted live arrays in the target land
    replicated on the mesh of its other leaves (`replicated_sharding`), or on `home` when
    the target places nothing.
    """
    home = replicated_sharding(target) or home
    pairs, treedef = tree_util.tree_flatten_with_path(target)
    if not pairs and saved:
        raise TreeMismatchError(
            f"the {item} target holds no arrays (every leaf of it is None, or it is empty), "
            f"so nothing of the {len(saved)} leaves saved at step {step} can be restored into "
            "it. Pass a tree whose leaves are jax.ShapeDtypeStruct with a sharding (or live "
            "arrays). With Equinox, eqx.is_array is False for a ShapeDtypeStruct: partition "
            "eqx.filter_eval_shape(...) by `lambda x: isinstance(x, jax.ShapeDtypeStruct)`, "
            "not by eqx.is_array (docs: 'Equinox and Levanter-style trainers')."
        )
    by_name = {s.name: s for s in saved}
    target_leaves: dict[str, tuple[tuple, Any]] = {}  # name: (key path, leaf)
    for path, leaf in pairs:
        name = leaf_name(path)
        if name in target_leaves:
            raise TreeMismatchError(
                f"{item} target leaves {tree_util.keystr(target_leaves[name][0])} and "
                f"{tree_util.keystr(path)} both stand for the stored name {name!r} (stored names "
                "join the path with '.'), so no checkpoint can fill both; rename one key."
            )
        target_leaves[name] = (path, leaf)

    missing = [display(path_entries(p)) for n, (p, _) in target_leaves.items() if n not in by_name]
    extra = [] if partial else [s.display for s in saved if s.name not in target_leaves]
    if missing or extra:
        lines = [f"the {item} target does not match the {item} saved at step {step}:"]
        if missing:
            lines.append(f"  in the target but not in the checkpoint: {_listing(missing)}")
        if extra:
            lines.append(f"  in the checkpoint but not in the target: {_listing(extra)}")
        lines.append(
            "Build the target from the same model and optimizer definition that was saved "
            "(e.g. jax.eval_shape of the init function)"
            + ("." if missing else ", or pass partial=True to restore only the target's leaves.")
        )
        raise TreeMismatchError("\n".join(lines))

    mismatches, unsharded = [], []
    requests: dict[str, ReadRequest] = {}
    for name, (_, leaf) in target_leaves.items():
        spec = by_name[name]
        if problem := _compare(leaf, spec):
            mismatches.append(f"  leaf {spec.display}: {problem}")
            continue
        sharding = _target_sharding(leaf, home)
        if sharding is _MISSING:
            unsharded.append(spec.display)
            continue
        if sharding is not None:
            try:
                sharding.shard_shape(spec.shape)
            except ValueError as e:
                raise ShardingError(
                    f"{item} leaf {spec.display} of shape {spec.shape} cannot be placed on the "
                    f"target's sharding {sharding}: {e}. Choose a PartitionSpec whose mesh "
                    "axes divide the dimensions, or replicate that dimension (None)."
                ) from None
        requests[name] = ReadRequest(spec.stored_shape, spec.stored_dtype, sharding)
    if mismatches:
        raise LeafMismatchError(
            f"the {item} target differs from the {item} saved at step {step}:\n"
            + "\n".join(mismatches)
            + "\nRestore into a target with the saved shapes and dtypes, and cast afterwards."
        )
    if unsharded:
        raise MissingShardingError(
            f"{item} target leaves have no sharding on concrete devices, so jaxckpt cannot "
            f"tell where to put them: {_listing(unsharded)}. Build the target with "
            "jaxckpt.target_on_mesh / target_from_flax / target_like, give each "
            "jax.ShapeDtypeStruct a sharding (NamedSharding(mesh, spec)), pass live "
            "jax.Arrays, or pass NumPy arrays to restore on the host."
        )

    def rebuild(arrays: Mapping[str, Any]) -> Any:
        leaves = [
            _decode(arrays[name], by_name[name], leaf) for name, (_, leaf) in target_leaves.items()
        ]
        return tree_util.tree_unflatten(treedef, leaves)

    return requests, rebuild


def uniform_requests(
    saved: Sequence[LeafSpec], sharding: jax.sharding.Sharding | None
) -> dict[str, ReadRequest]:
    """Read requests that put every saved leaf on `sharding` (None: NumPy on the host)."""
    return {s.name: ReadRequest(s.stored_shape, s.stored_dtype, sharding) for s in saved}


def nest(
    saved: Sequence[LeafSpec], arrays: Mapping[str, Any], empty: Sequence[EmptyNode] = ()
) -> Any:
    """Rebuilds nested dicts/lists from the recorded paths (restore without a target) as
    plain Orbax restores its own: sequences and nodes registered without keys as lists,
    the recorded empty nodes in their places (None for optax's EmptyState, `{}`, `[]`,
    `()`), so that a sequence keeps its length.

    A leaf or empty node recorded where another one is (a damaged record) is left out,
    logged."""
    if len(saved) == 1 and not saved[0].path:
        return _decode(arrays[saved[0].name], saved[0], None)
    root: dict = {}
    inner = {id(root)}  # the dicts made here for inner nodes (not empty nodes' values)
    sequences: set[int] = set()

    def place(path: Sequence[tuple[str, Any]], value: Any) -> bool:
        node = root
        for depth, (kind, key) in enumerate(path):
            if kind in ("seq", "index"):  # (index: a node registered without keys)
                sequences.add(id(node))
            if depth == len(path) - 1:
                if key in node:
                    return False
                node[key] = value
            else:
                if key not in node:
                    node[key] = {}
                    inner.add(id(node[key]))
                elif id(node[key]) not in inner:
                    return False
                node = node[key]
        return True

    for spec in saved:
        if not place(spec.path, _decode(arrays[spec.name], spec, None)):
            log.warning("leaf %s is recorded where another leaf is: left out", spec.display)
    for node in empty:
        if not place(node.path, node.value):
            log.warning("empty node %s is recorded where a leaf is: left out", display(node.path))

    def finish(node: Any) -> Any:
        if id(node) not in inner:
            return node
        if id(node) in sequences:
            return [finish(node[k]) for k in sorted(node)]
        return {k: finish(v) for k, v in node.items()}

    return finish(root)


_MISSING = object()


def replicated_sharding(target: Any) -> jax.sharding.Sharding | None:
    """Full replication over the mesh of the target's placed leaves (or over its one
    device); None when it places nothing (host arrays, scalars, uncommitted arrays only).

    Where uncommitted arrays of a target land, and PRNG keys restored without a target:
    `optax.adam(...).init`, `nnx.Optimizer`, `nnx.MultiMetric` and `nnx.Rngs` make scalars
    uncommitted on device 0 beside parameters on a mesh. Restored onto device 0 they would
    be committed there, and the next jitted step would refuse arguments on two device sets.
    """
    shardings = [
        leaf.sharding
        for leaf in jax.tree.leaves(target)
        if isinstance(leaf, jax.ShapeDtypeStruct | jax.Array)
        and getattr(leaf, "sharding", None) is not None
        and not isinstance(getattr(leaf.sharding, "mesh", None), jax.sharding.AbstractMesh)
        and not _uncommitted(leaf)
    ]
    for sharding in shardings:
        if isinstance(sharding, jax.sharding.NamedSharding):
            return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
    return next((s for s in shardings if len(s.device_set) == 1), None)


def _uncommitted(leaf: Any) -> bool:
    """A live array JAX may still move (made without a device: `jnp.zeros([])`)."""
    return isinstance(leaf, jax.Array) and not leaf.committed


def _target_sharding(leaf: Any, home: jax.sharding.Sharding | None = None) -> Any:
    if home is not None and _uncommitted(leaf):
        return home
    if isinstance(leaf, jax.Array | jax.ShapeDtypeStruct):
        sharding = getattr(leaf, "sharding", None)
        if sharding is None or isinstance(
            getattr(sharding, "mesh", None), jax.sharding.AbstractMesh
        ):
            return _MISSING  # nowhere to put it, or only an abstract mesh without devices
        return sharding
    return None  # NumPy arrays and Python scalars are restored on the host


def _compare(leaf: Any, spec: LeafSpec) -> str | None:
    """Says how a target leaf differs from the saved one, or None if it matches."""
    if is_python_scalar(leaf):
        saved_kind = np.dtype(spec.dtype).kind if spec.kind != KEY else "key"
        want = {bool: "b", int: "iu", float: "f"}[type(leaf)]
        if spec.shape != () or saved_kind not in want:
            return (
                f"a Python {type(leaf).__name__} in the target but "
                f"{_describe(spec.shape, spec.dtype)} in the checkpoint"
            )
        return None
    shape = tuple(getattr(leaf, "shape", ()))
    dtype = getattr(leaf, "dtype", None)
    if dtype is None:
        return (
            f"the target leaf is a {type(leaf).__name__}; use jax.ShapeDtypeStruct, jax.Array, "
            "NumPy arrays or Python scalars as target leaves"
        )
    dtype_name = _target_dtype_name(dtype)
    if shape != spec.shape or dtype_name != spec.dtype:
        return (
            f"{_describe(shape, dtype_name)} in the target but "
            f"{_describe(spec.shape, spec.dtype)} in the checkpoint"
        )
    return None


def _decode(value: Any, spec: LeafSpec, target_leaf: Any) -> Any:
    if spec.kind == KEY:
        return jax.random.wrap_key_data(value, impl=spec.key_impl)
    if is_python_scalar(target_leaf):
        return type(target_leaf)(np.asarray(value).item())
    if isinstance(target_leaf, np.generic):
        return np.asarray(value)[()]
    if target_leaf is None and spec.kind == PYTHON:  # no target (a tree's leaf is never None)
        return np.asarray(value).item()
    return value


@functools.lru_cache(maxsize=256)
def _target_dtype_name(dtype: Any) -> str:
    """A target leaf's dtype as recorded: a key dtype's name (`key<fry>`), else NumPy's."""
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return str(dtype)
    return np.dtype(dtype).name


def _describe(shape: Sequence[int], dtype: str) -> str:
    return f"shape {tuple(shape)} dtype {dtype}"


def _listing(paths: Sequence[str], limit: int = 20) -> str:
    shown = ", ".join(paths[:limit])
    return shown + (f" (and {len(paths) - limit} more)" if len(paths) > limit else "")

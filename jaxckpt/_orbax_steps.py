"""Checkpoints plain Orbax wrote, read through Orbax: a step's pytree item as a `StepInfo`
(its leaves as Orbax's metadata records them, any of Orbax's array layouts since 0.2), its
arrays read by leaf name; and `write_plain`, the checkpoint `ocp.StandardCheckpointer`
writes (`jaxckpt.export_orbax`). What such a step is on disk is `jaxckpt._layout`'s
(`OrbaxStep`); jaxckpt never writes, deletes or checksums one.
"""

from __future__ import annotations

import itertools
import json
import logging
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from jaxckpt import _internals, _layout, _transfer
from jaxckpt._storage import files_below, read_small
from jaxckpt._tree import ARRAY, KEY, PYTHON, EmptyNode, LeafSpec, ReadRequest, childless, leaf_name
from jaxckpt.errors import ConfigError, CorruptCheckpointError

log = logging.getLogger("jaxckpt")


def write_plain(out_dir: epath.Path, tree: Any) -> None:
    """`tree` as a plain Orbax checkpoint at `out_dir`, which must not exist: what
    `ocp.StandardCheckpointer().save(out_dir, tree)` writes (and Orbax commits atomically),
    so that `ocp.StandardCheckpointer().restore(out_dir, target)` reads it."""
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(out_dir, tree)
        checkpointer.wait_until_finished()


def info(
    directory: epath.Path,
    step: int,
    found: _layout.OrbaxStep,
    item: str | None,
    tree_of: Callable[[epath.Path], Any],
) -> _layout.StepInfo:
    """A plain Orbax step as jaxckpt sees one: the leaves of its pytree item `item` (None:
    its only one) as Orbax's metadata records them (`tree_of` an item's folder), its grain
    states as data."""
    trees = found.items_of("pytree")
    if item is None and len(trees) == 1:
        item = trees[0]
    if item not in trees:
        held = ", ".join(f"{name} ({kind})" for name, kind in sorted(found.items.items()))
        ask = (
            "choose one with item= (CLI: --item)"
            if item is None
            else f"it has no pytree item {item!r}"
        )
        raise ConfigError(f"step {step} in {directory}, written by Orbax, holds {held}: {ask}")
    try:
        tree = tree_of(found.item_dir(item))
        impls = _internals.key_impls(found.item_dir(item))
        # (None in the tree is an empty node: optax's EmptyState is saved as one)
        leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
        specs = [_orbax_spec(path, meta, impls) for path, meta in leaves]
        nodes = jax.tree_util.tree_flatten_with_path(tree, is_leaf=childless)[0]
        empty = tuple(EmptyNode.of(p, node) for p, node in nodes if p and childless(node))
    except Exception as e:
        problem = f"Orbax cannot read the metadata of its item {item!r}: {_transfer.first_line(e)}"
        raise CorruptCheckpointError(step, [problem], str(directory)) from None
    return _layout.StepInfo(
        step=step,
        state=tuple(s for s in specs if s is not None),
        data="grain" if found.items_of("grain") else None,
        orbax=found,
        item=item,
        empty={_layout.STATE: empty},
    )


def tree(path: epath.Path) -> Any:
    """The nested tree of an Orbax pytree item, its leaves Orbax's value metadata."""
    if legacy(path):
        return _legacy_tree(path)
    return ocp.PyTreeCheckpointHandler().metadata(path).tree


def legacy(path: epath.Path) -> bool:
    """An item of an Orbax release before `_METADATA` (0.2-0.4): its tree is the msgpack
    file `checkpoint`, each leaf a zarr (v2) array of its own, named by its leaf name."""
    return not (path / _layout.ORBAX_TREE_FILE).exists()


def missing_chunks(path: epath.Path) -> list[str]:
    """Of a legacy item, the arrays whose chunk files are not all there: Orbax reads a
    missing chunk of such an item as zeros, so only the listing tells. (An array with a fill
    value may leave chunks out: not counted.)"""
    if not legacy(path):
        return []
    problems = []
    for leaf in sorted(p for p in path.iterdir() if (p / ".zarray").exists()):
        try:
            zarray = json.loads(read_small(path, f"{leaf.name}/.zarray"))
            grid = [-(-n // c) for n, c in zip(zarray["shape"], zarray["chunks"], strict=True)]
        except (OSError, ValueError, TypeError, KeyError, ZeroDivisionError) as e:
            problems.append(f"{leaf.name}/.zarray is unreadable: {_transfer.first_line(e)}")
            continue
        if zarray.get("fill_value") is not None:
            continue
        separator = zarray.get("dimension_separator", ".")
        expected = {
            separator.join(map(str, i)) or "0" for i in itertools.product(*map(range, grid))
        }
        present = {str(p.relative_to(leaf)) for p in files_below(leaf)}
        if missing := sorted(expected - present):
            problems.append(
                f"{leaf.name}: {len(missing)} of {len(expected)} chunk files are missing "
                f"(first: {missing[0]}), which Orbax would read as zeros"
            )
    return problems


def _legacy_tree(path: epath.Path) -> Any:
    """A legacy item's tree, each array's metadata from its `.zarray`: shape and dtype (no
    sharding is recorded there). A value stored in the msgpack file itself is left out."""
    tree = ocp.aggregate_handlers.MsgpackHandler().deserialize(path / _layout.ORBAX_LEGACY_FILE)

    def meta(value: Any) -> Any:
        if not ocp.utils.leaf_is_placeholder(value):
            log.warning("Orbax leaf stored in %s/checkpoint itself: jaxckpt skips it", path)
            return None
        name = ocp.utils.name_from_leaf_placeholder(value)
        if not name or "/" in name or "\\" in name or name in (".", ".."):
            raise ValueError(f"a leaf is named {name!r}, which is no folder of the item")
        try:
            zarray = json.loads(read_small(path, f"{name}/.zarray"))
        except (OSError, ValueError) as e:
            raise ValueError(f"{name}/.zarray is unreadable: {e}") from None
        return ocp.metadata.ArrayMetadata(
            name=name,
            directory=path,
            shape=tuple(zarray["shape"]),
            sharding=None,
            dtype=np.dtype(zarray["dtype"]),
        )

    return jax.tree.map(meta, tree)


def _orbax_spec(path: tuple, meta: Any, impls: Mapping[str, str]) -> LeafSpec | None:
    """The LeafSpec of one leaf of Orbax's metadata (None: a string leaf, which jaxckpt
    does not restore, logged); a typed PRNG key (its impl in `impls`) is a KEY leaf."""
    name = leaf_name(path)
    if not isinstance(meta, ocp.metadata.ArrayMetadata):
        log.warning("Orbax leaf %s is a %s: jaxckpt skips it", name, type(meta).__name__)
        return None
    kind = PYTHON if isinstance(meta, ocp.metadata.ScalarMetadata) else ARRAY
    shape, dtype, impl = tuple(meta.shape), meta.dtype, impls.get(name)
    if impl is not None:  # Orbax's metadata has the key data: (*shape, *impl's own dims)
        key = jax.eval_shape(lambda: jax.random.key(0, impl=impl))
        own = jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0, impl=impl))).shape
        kind, shape, dtype = KEY, shape[: len(shape) - len(own)], str(key.dtype)
    sharding: dict[str, Any] | None = None  # as `LeafSpec.sharding` records it
    if isinstance(meta.sharding, ocp.metadata.NamedShardingMetadata):
        spec = [list(e) if isinstance(e, tuple) else e for e in meta.sharding.partition_spec]
        mesh = dict(zip(meta.sharding.axis_names, map(int, meta.sharding.shape), strict=True))
        sharding = {"mesh": mesh, "spec": spec}
    elif isinstance(meta.sharding, ocp.metadata.SingleDeviceShardingMetadata):
        sharding = {"devices": 1}
    return LeafSpec.at(path, shape, dtype, kind=kind, key_impl=impl, sharding=sharding)


class OrbaxLayout:
    """A step plain Orbax (or Flax) wrote (`_read_interfaces.Layout`): one of its pytree items
    (`info.item`), read through Orbax alone, each leaf read checked against its metadata.
    An item saved before Orbax's metadata named each leaf is read whole (`whole`): Orbax
    reads every leaf of it on each restore."""

    def __init__(self, info: _layout.StepInfo, tree: Any, directory: epath.Path):
        assert info.orbax is not None and info.item is not None
        self._info, self._tree, self._directory = info, tree, directory
        self._path = info.orbax.item_dir(info.item)
        self.whole = legacy(self._path)

    def read(self, item: str, batch: Mapping[str, ReadRequest]) -> dict[str, Any]:
        step, item = self._info.step, self._info.item or item
        with _transfer.read_errors(step, item, self._directory):
            got = read_batch(self._path, self._tree, batch)
        for name, request in batch.items():
            _transfer.check_read(step, item, name, got.get(name), request, self._directory)
        return got

    def packed_step(self, item: str) -> Any:
        raise ValueError(f"step {self._info.step} was written by plain Orbax: no packed leaves")


def read_batch(path: epath.Path, tree: Any, batch: Mapping[str, ReadRequest]) -> dict[str, Any]:
    """Reads the leaves `batch` names of an Orbax pytree item: the item's whole tree with
    Orbax's placeholder for every other leaf, so that none of those is read."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    names = [leaf_name(p) for p, _ in leaves]
    scalar = {
        n
        for n, (_, meta) in zip(names, leaves, strict=True)
        if isinstance(meta, ocp.metadata.ScalarMetadata)
    }
    item = [target(batch[n]) if n in batch else ocp.PLACEHOLDER for n in names]
    args = [
        restore_args(batch[n]) if n in batch and n not in scalar else ocp.RestoreArgs()
        for n in names
    ]
    got = ocp.PyTreeCheckpointHandler().restore(
        path,
        args=ocp.args.PyTreeRestore(
            item=jax.tree_util.tree_unflatten(treedef, item),
            restore_args=jax.tree_util.tree_unflatten(treedef, args),
        ),
    )
    values = jax.tree_util.tree_leaves(got, is_leaf=lambda x: x is ocp.PLACEHOLDER)
    out = {}
    for name, value in zip(names, values, strict=True):
        if jax.dtypes.issubdtype(getattr(value, "dtype", np.float32), jax.dtypes.prng_key):
            value = jax.random.key_data(value)  # Orbax wraps typed keys; jaxckpt reads data
        if name in scalar and name in batch:  # Orbax hands back a Python or NumPy scalar
            request = batch[name]
            value = np.asarray(value, request.dtype)
            if request.sharding is not None:
                value = _transfer.on(request.sharding, value)
        if name in batch:
            out[name] = value
    return out


def target(request: ReadRequest) -> Any:
    return jax.ShapeDtypeStruct(request.shape, request.dtype, sharding=request.sharding)


def restore_args(request: ReadRequest) -> ocp.RestoreArgs:
    if request.sharding is None:
        return ocp.RestoreArgs(restore_type=np.ndarray, dtype=request.dtype)
    return ocp.ArrayRestoreArgs(
        sharding=request.sharding, global_shape=request.shape, dtype=request.dtype
    )

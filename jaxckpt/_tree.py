"""How a pytree becomes named arrays on disk (`jaxckpt._match` is how a restore target maps
back onto them).

A saved tree is flattened with `jax.tree_util` into a flat mapping `{name: array}`, where
`name` joins the leaf's key path with dots (`params.layers.0.kernel.value`). Next to the
arrays, each checkpoint records a :class:`LeafSpec` per leaf (path, shape, dtype, kind),
which keeps Orbax's view of the tree flat and simple, and an :class:`EmptyNode` per node
without children (optax's EmptyState, `{}`, None), which no leaf records. Typed PRNG keys
are stored as their raw key data plus the impl name, and are wrapped back with the same impl
on restore, so they round-trip bitwise with any impl. The checks of what `save` is
given are `jaxckpt._checks`'.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, TypeGuard

import jax
import numpy as np
import tensorstore as ts
from jax import tree_util

from jaxckpt.errors import (
    UnsupportedValueError,
)

# Leaf kinds as recorded on disk.
ARRAY = "array"  # jax.Array, NumPy array or NumPy scalar
KEY = "key"  # typed PRNG key array, stored as its key data
PYTHON = "python"  # Python bool/int/float, stored as a 0-d array

# A `jax.tree_util` key path: DictKey, SequenceKey, GetAttrKey, FlattenedIndexKey or a
# custom node's own key entries.
KeyPath = tuple[Any, ...]


@dataclasses.dataclass(frozen=True)
class LeafSpec:
    """What one saved leaf is: enough to validate a target and rebuild the tree."""

    name: str
    path: tuple[tuple[str, Any], ...]  # ((entry kind, key), ...) with kind dict|seq|attr|index
    shape: tuple[int, ...]
    dtype: str  # NumPy dtype name, or the key dtype (e.g. "key<fry>") for KEY leaves
    kind: str = ARRAY
    key_impl: str | None = None
    # How the leaf was laid out when saved, for `jaxckpt inspect` and `plan` (None: on the
    # host, or a step older than this field): {"mesh": {axis: size}, "spec": [...]} for a
    # NamedSharding (spec entries: null, an axis, or a list of axes), {"devices": n} else.
    sharding: dict[str, Any] | None = None

    @classmethod
    def at(cls, path: KeyPath, shape: tuple[int, ...], dtype: Any, **fields: Any) -> LeafSpec:
        """The spec of a leaf at a `jax.tree_util` key path (of a tree Orbax saved); `dtype`
        a NumPy dtype, or a key dtype's name (`key<fry>`)."""
        entries = path_entries(path)
        dtype = dtype if isinstance(dtype, str) else dtype_name(dtype)
        return cls(_name(entries), entries, tuple(shape), dtype, **fields)

    @property
    def display(self) -> str:
        """The leaf as errors name it: its stored name (`params.w`), which `jaxckpt inspect`
        lists and its `--filter` matches."""
        return display(self.path)

    def to_json(self) -> dict[str, Any]:
        # By hand: dataclasses.asdict deep-copies, ~80 us a leaf on the save's blocking path.
        return {
            "name": self.name,
            "path": [list(e) for e in self.path],
            "shape": list(self.shape),
            "dtype": self.dtype,
            "kind": self.kind,
            "key_impl": self.key_impl,
            "sharding": self.sharding,
        }

    @classmethod
    def from_json(cls, d: Any) -> LeafSpec:
        """The spec recorded in a step's jaxckpt.json; ValueError naming the first field
        that is not what jaxckpt writes (a damaged or hand-edited file)."""
        if not isinstance(d, dict):  # (JSON's objects: dict, never another Mapping)
            raise ValueError("a leaf entry is not an object")
        name = d.get("name")
        if not isinstance(name, str):
            raise ValueError("a leaf's name is not a string")
        path, shape = d.get("path"), d.get("shape")
        if not _is_path(path):
            raise ValueError(f"leaf {name!r}: path is not a list of [kind, key] pairs")
        if not is_counts(shape):
            raise ValueError(f"leaf {name!r}: shape is not a list of non-negative integers")
        kind, dtype, key_impl = d.get("kind", ARRAY), d.get("dtype"), d.get("key_impl")
        if kind not in (ARRAY, KEY, PYTHON):
            raise ValueError(f"leaf {name!r}: unknown kind {short(kind)}")
        if not isinstance(dtype, str) or not (kind == KEY or _is_dtype(dtype)):
            raise ValueError(f"leaf {name!r}: dtype {short(dtype)} is not a NumPy dtype name")
        if kind == KEY and not (isinstance(key_impl, str) and _is_key_impl(key_impl)):
            raise ValueError(f"leaf {name!r}: key_impl {short(key_impl)} is not a PRNG impl")
        sharding = d.get("sharding")
        if sharding is not None and not _is_layout(sharding):
            raise ValueError(f"leaf {name!r}: sharding is not a recorded layout")
        return cls(name, tuple(map(tuple, path)), tuple(shape), dtype, kind, key_impl, sharding)

    @property
    def stored_shape(self) -> tuple[int, ...]:
        """The shape as stored: a PRNG key's data adds the impl's trailing dims, e.g. (2,)."""
        if self.kind == KEY:
            one = jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0, impl=self.key_impl)))
            return (*self.shape, *one.shape)
        return self.shape

    @property
    def stored_dtype(self) -> np.dtype:
        return np.dtype(np.uint32) if self.kind == KEY else np.dtype(self.dtype)

    @property
    def nbytes(self) -> int:
        """The bytes the leaf takes as stored."""
        return math.prod(self.stored_shape) * self.stored_dtype.itemsize

    @property
    def layout(self) -> str:
        """How the leaf was laid out when saved, as `jaxckpt inspect` shows it."""
        if self.sharding is None:
            return "host"
        if "mesh" not in self.sharding:
            n = self.sharding["devices"]
            return f"{n} device{'s' * (n != 1)}"
        mesh = ",".join(f"{k}={v}" for k, v in self.sharding["mesh"].items())
        return f"{self.spec} on {mesh}"

    @property
    def spec(self) -> jax.sharding.PartitionSpec | None:
        """The saved PartitionSpec, when the leaf was saved with a NamedSharding."""
        if not self.sharding or "spec" not in self.sharding:
            return None
        return jax.sharding.PartitionSpec(
            *(tuple(e) if isinstance(e, list) else e for e in self.sharding["spec"])
        )


_ENTRY_KINDS = ("dict", "seq", "attr", "index")

# What an empty node is recorded as: what plain Orbax writes for it (its `empty_values`), so
# that an export writes the node as Orbax would have. A Mapping (dict, nnx.State) is "dict",
# a list "list", a tuple "tuple"; None, a NamedTuple (optax's EmptyState and MaskedNode) and
# any other node without children (a dataclass without fields) are "none".
EMPTY_KINDS = ("dict", "list", "tuple", "none")


@dataclasses.dataclass(frozen=True)
class EmptyNode:
    """A node of a saved tree without children (None, `{}`, `[]`, `()`, optax's EmptyState):
    no leaf records it, so the save records where it was and what kind it was.

    A restore without a target puts it back as plain Orbax's does (`value`), and
    `export_orbax` writes it, so that plain Orbax's restore onto the live state (whose tree
    holds it) finds every node of that tree. Recorded in jaxckpt.json's optional "empty"
    (either format; an older jaxckpt ignores it, and reads such a step as before).
    """

    path: tuple[tuple[str, Any], ...]  # as LeafSpec.path
    kind: str  # one of EMPTY_KINDS

    @classmethod
    def of(cls, path: KeyPath, node: Any) -> EmptyNode:
        """The record of `node`, a node without children at a `jax.tree_util` key path."""
        if isinstance(node, list):
            kind = "list"
        elif isinstance(node, tuple):  # (a NamedTuple is written as None by Orbax)
            kind = "none" if hasattr(node, "_fields") else "tuple"
        elif isinstance(node, Mapping):
            kind = "dict"
        else:
            kind = "none"
        return cls(path_entries(path), kind)

    @property
    def value(self) -> Any:
        """The node as plain Orbax restores it without a target (a new one each time)."""
        return {"dict": {}, "list": [], "tuple": (), "none": None}[self.kind]

    def to_json(self) -> dict[str, Any]:
        return {"path": [list(e) for e in self.path], "kind": self.kind}

    @classmethod
    def from_json(cls, d: Any) -> EmptyNode:
        """The record in a step's jaxckpt.json; ValueError if it is not what jaxckpt writes."""
        if not isinstance(d, dict) or not _is_path(d.get("path")) or not d["path"]:
            raise ValueError("an empty node's path is not a list of [kind, key] pairs")
        if d.get("kind") not in EMPTY_KINDS:
            raise ValueError(
                f"empty node {_name(d['path'])!r}: kind {short(d.get('kind'))} is not one of "
                f"{', '.join(EMPTY_KINDS)}"
            )
        return cls(tuple(map(tuple, d["path"])), d["kind"])


def empty_to_json(empty: Mapping[str, Sequence[EmptyNode]] | None) -> Any:
    """Each item's empty nodes as a step's jaxckpt.json records them (None: not recorded)."""
    if empty is None:
        return None
    return {item: [node.to_json() for node in nodes] for item, nodes in empty.items()}


def empty_from_json(doc: Any, items: Sequence[str]) -> dict[str, tuple[EmptyNode, ...]] | None:
    """The empty nodes recorded in a step's jaxckpt.json, of `items` (None: not recorded, as
    in steps saved before they were); ValueError naming the first entry jaxckpt never
    writes."""
    if doc is None:
        return None
    if not isinstance(doc, dict) or not set(doc) <= set(items):
        raise ValueError("'empty' is not an object of the items' empty nodes")
    empty = {}
    for item, nodes in doc.items():
        if not isinstance(nodes, list):
            raise ValueError(f"'empty.{item}' is not a list of empty nodes")
        try:
            empty[item] = tuple(EmptyNode.from_json(node) for node in nodes)
        except ValueError as e:
            raise ValueError(f"'empty.{item}': {e}") from None
    return empty


def childless(node: Any) -> bool:
    """Whether `node` is a pytree node without children (None, `{}`, optax's EmptyState),
    as Orbax's `is_empty_or_leaf` finds them. Fast for arrays: a save asks of every node."""
    kind = type(node)
    if kind is dict or kind is list or kind is tuple:
        return not node
    if node is None:
        return True
    leaf = _LEAF_TYPES.get(kind)
    if leaf is None:
        leaf = _LEAF_TYPES[kind] = issubclass(kind, _LEAVES)
    if leaf:
        return False
    # Any other node flattened one level: its children are leaves here, whatever they are.
    return not tree_util.tree_leaves(node, is_leaf=lambda child: child is not node)


_LEAVES = (np.ndarray, np.generic, jax.Array, bool, int, float, str)
_LEAF_TYPES: dict[type, bool] = {}  # each type `childless` met: whether it is one of _LEAVES


def is_count(n: Any) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n >= 0


@functools.lru_cache(maxsize=256)
def _is_dtype(name: str) -> bool:
    try:
        dtype = np.dtype(name)
    except (TypeError, ValueError):
        return False
    return dtype.name == name and _storable(dtype)


@functools.lru_cache(maxsize=16)
def _is_key_impl(name: str) -> bool:
    try:
        jax.eval_shape(lambda: jax.random.key(0, impl=name))
    except Exception:  # JAX's error for an unknown impl name is not one class
        return False
    return True


def _is_path(path: Any) -> TypeGuard[list[list[Any]]]:
    # Plain loops and exact types (bool is not an int here): thousands of leaves are
    # checked on every restore.
    if type(path) is not list:
        return False
    for e in path:
        if type(e) is not list or len(e) != 2 or e[0] not in _ENTRY_KINDS:
            return False
        if type(e[1]) is not str and type(e[1]) is not int:
            return False
    return True


def is_counts(values: Any) -> TypeGuard[list[int]]:
    """A list of non-negative ints (a recorded shape)."""
    return type(values) is list and all(type(n) is int and n >= 0 for n in values)


def _is_layout(layout: Any) -> bool:
    if type(layout) is not dict:
        return False
    if "mesh" in layout:
        mesh, spec = layout.get("mesh"), layout.get("spec")
        if type(mesh) is not dict or type(spec) is not list:
            return False
        for k, v in mesh.items():
            if type(k) is not str or type(v) is not int or v < 0:
                return False
        for e in spec:
            if e is not None and type(e) is not str:
                if type(e) is not list:
                    return False
                for a in e:
                    if type(a) is not str:
                        return False
        return True
    return is_count(layout.get("devices"))


@dataclasses.dataclass(frozen=True)
class ReadRequest:
    """How to read one stored array: its stored shape/dtype and where it should land."""

    shape: tuple[int, ...]
    dtype: np.dtype
    sharding: jax.sharding.Sharding | None  # None: a host NumPy array


# --------------------------------------------------------------------------------------------
# Saving


def flatten(tree: Any, *, item: str) -> tuple[dict[str, Any], list[LeafSpec], list[EmptyNode]]:
    """Flattens `tree` into `{name: array}` ready to write, plus the specs to record and
    its nodes without children (the tree itself, when it is one, is not recorded: a save
    without `rng=` has none).

    NumPy leaves are copied, so the caller may mutate its arrays as soon as `save` returns.
    """
    arrays: dict[str, Any] = {}
    specs: list[LeafSpec] = []
    empty: list[EmptyNode] = []
    seen: dict[str, KeyPath] = {}  # the key path of each name
    for path, leaf in tree_util.tree_flatten_with_path(tree, is_leaf=childless)[0]:
        if childless(leaf):
            if path:
                empty.append(EmptyNode.of(path, leaf))
            continue
        entries = path_entries(path)
        name = _name(entries)
        if name in seen:
            raise UnsupportedValueError(
                f"{item} leaves {tree_util.keystr(seen[name])} and {tree_util.keystr(path)} both map "
                f"to the stored name {name!r}; rename one of the keys (stored names join the path "
                "with '.')."
            )
        seen[name] = path
        arrays[name], spec = _encode(leaf, name, entries, item)
        specs.append(spec)
    return arrays, specs, empty


def _encode(
    leaf: Any, name: str, entries: tuple[tuple[str, Any], ...], item: str
) -> tuple[Any, LeafSpec]:
    if isinstance(leaf, jax.Array):
        layout = _layout(leaf.sharding)
        # (a NumPy dtype is never a key: the common case skips the slower issubdtype)
        if not isinstance(leaf.dtype, np.dtype) and jax.dtypes.issubdtype(
            leaf.dtype, jax.dtypes.prng_key
        ):
            impl = str(jax.random.key_impl(leaf))
            spec = LeafSpec(name, entries, leaf.shape, str(leaf.dtype), KEY, impl, layout)
            array = jax.random.key_data(leaf)
        else:
            _check_storable(item, entries, leaf.dtype)
            dtype = dtype_name(leaf.dtype)
            array, spec = leaf, LeafSpec(name, entries, leaf.shape, dtype, sharding=layout)
        if jax.process_count() > 1 and array.is_fully_addressable:
            # A host-local array (e.g. jax.random.key(0) made on every host), which Orbax
            # refuses in a multi-process job: it is saved like a NumPy array, by one process
            # (`_packed`: the least loaded; Orbax: process 0), restored onto the target's
            # sharding.
            return np.asarray(array), spec
        return array, spec
    if is_python_scalar(leaf):
        value = np.asarray(leaf)
        if value.dtype != object:  # e.g. 2**70 fits no integer dtype
            return value, LeafSpec(name, entries, (), value.dtype.name, PYTHON)
    elif isinstance(leaf, np.ndarray | np.generic) and leaf.dtype != object:
        _check_storable(item, entries, leaf.dtype)
        value = np.array(leaf, copy=True)
        return value, LeafSpec(name, entries, value.shape, value.dtype.name)
    raise UnsupportedValueError(
        f"{item} leaf {display(entries)} is a {type(leaf).__module__}.{type(leaf).__qualname__} "
        f"({short(leaf)}), which jaxckpt cannot save: leaves must be jax.Array, NumPy arrays "
        "of a numeric dtype or Python/NumPy scalars that fit one. Put other values in meta= "
        "(JSON), or make them static pytree fields."
    )


_PLAIN_NODES = (dict, list, tuple, type(None))


class _TreeDef(Protocol):
    """What `node_types` reads of a `jax.tree_util.PyTreeDef`. Its class is jaxlib's C++
    one, which ships no stubs: mypy sees none of its methods."""

    def node_data(self) -> tuple[type, Any] | None: ...

    def children(self) -> list[_TreeDef]: ...


def node_types(tree: Any) -> list[str]:
    """The qualified names of the tree's node types other than dict, list, tuple and None:
    those a restore without a target cannot rebuild (it returns nested dicts and lists)."""
    found: set[type] = set()
    stack: list[_TreeDef] = [tree_util.tree_structure(tree)]
    while stack:
        treedef = stack.pop()
        data = treedef.node_data()  # None for a leaf, which has no children
        if data is not None and data[0] not in _PLAIN_NODES:
            found.add(data[0])
        stack.extend(treedef.children())
    return sorted(f"{t.__module__}.{t.__qualname__}" for t in found)


@functools.lru_cache(maxsize=256)  # save blocks on this
def _storable(dtype: np.dtype) -> bool:
    """Whether the storage (tensorstore) has the dtype: not strings, dates, records, uint4."""
    try:
        ts.dtype(np.dtype(dtype).name)
    except (TypeError, ValueError):
        return False
    return True


def _check_storable(item: str, entries: tuple[tuple[str, Any], ...], dtype: np.dtype) -> None:
    if not _storable(dtype):
        raise UnsupportedValueError(
            f"{item} leaf {display(entries)} has dtype {dtype}, which checkpoints (tensorstore) "
            "cannot store. Cast it to a supported dtype first (e.g. uint4 to uint8), keep "
            "strings in meta=, or make the value a static pytree field."
        )


@functools.lru_cache(maxsize=256)  # numpy's dtype.name is slow Python; save blocks on this
def dtype_name(dtype: np.dtype) -> str:
    return np.dtype(dtype).name


@functools.lru_cache(maxsize=1024)  # a state has few distinct shardings; save blocks on this
def _layout(sharding: jax.sharding.Sharding) -> dict[str, Any]:
    if isinstance(sharding, jax.sharding.NamedSharding):
        return {
            "mesh": dict(sharding.mesh.shape),
            "spec": [list(e) if isinstance(e, tuple) else e for e in sharding.spec],
        }
    return {"devices": len(sharding.device_set)}


# --------------------------------------------------------------------------------------------
# Leaf names


def is_python_scalar(leaf: Any) -> bool:
    # np.float64 subclasses float: it is a NumPy scalar, not a Python one.
    return isinstance(leaf, bool | int | float) and not isinstance(leaf, np.generic)


def leaf_name(path: KeyPath) -> str:
    """The stored name of the leaf at a [`jax.tree_util`][jax.tree_util] key path (`params.w`)."""
    return _name(path_entries(path))


def path_entries(path: KeyPath) -> tuple[tuple[str, Any], ...]:
    out = []
    for e in path:
        if isinstance(e, tree_util.DictKey):
            key = e.key if isinstance(e.key, str | int) else str(e.key)
            out.append(("dict", key))
        elif isinstance(e, tree_util.SequenceKey):
            out.append(("seq", e.idx))
        elif isinstance(e, tree_util.GetAttrKey):
            out.append(("attr", e.name))
        elif isinstance(e, tree_util.FlattenedIndexKey):
            out.append(("index", e.key))
        else:  # A custom key type: keep its text form.
            out.append(("dict", str(e)))
    return tuple(out)


def _name(entries: Sequence[tuple[str, Any]]) -> str:
    return ".".join(str(key) for _, key in entries) or "_"


def display(entries: Sequence[tuple[str, Any]]) -> str:
    """How errors name a leaf: its stored name, the one spelling the CLI uses too."""
    return _name(entries) if entries else "_ (the tree's root)"


def short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."

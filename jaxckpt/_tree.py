"""How a pytree becomes named arrays on disk, and how a restore target maps back onto them.

A saved tree is flattened with `jax.tree_util` into a flat mapping `{name: array}`, where
`name` joins the leaf's key path with dots (`params.layers.0.kernel.value`). Next to the
arrays, each checkpoint records a :class:`LeafSpec` per leaf (path, shape, dtype, kind). This
keeps Orbax's view of the tree flat and simple, and puts every tree concern here:

* Restoring *with* a target unflattens with the target's own treedef, so any pytree node type
  (Flax NNX `State`, Linen `TrainState`, optax NamedTuples, empty nodes) comes back as itself.
* Restoring *without* a target rebuilds nested dicts and lists from the recorded paths.
* Missing/extra leaves and shape/dtype differences are found by comparing names and specs,
  and reported by path before a single array byte is read.
* Typed PRNG keys are stored as their raw key data plus the impl name, and are wrapped back
  with the same impl on restore, so they round-trip bitwise with any impl.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
import tensorstore as ts
from jax import tree_util

from jaxckpt.errors import (
    LeafMismatchError,
    MissingShardingError,
    ShardingError,
    TreeMismatchError,
    UnsupportedValueError,
)

# Leaf kinds as recorded on disk.
ARRAY = "array"  # jax.Array, NumPy array or NumPy scalar
KEY = "key"  # typed PRNG key array, stored as its key data
PYTHON = "python"  # Python bool/int/float, stored as a 0-d array


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
    def at(cls, path: tuple, shape: tuple[int, ...], dtype: Any, **fields: Any) -> LeafSpec:
        """The spec of a leaf at a `jax.tree_util` key path (of a tree Orbax saved); `dtype`
        a NumPy dtype, or a key dtype's name (`key<fry>`)."""
        entries = _entries(path)
        dtype = dtype if isinstance(dtype, str) else _dtype_name(dtype)
        return cls(_name(entries), entries, tuple(shape), dtype, **fields)

    @property
    def display(self) -> str:
        """The leaf as errors name it: its stored name (`params.w`), which `jaxckpt inspect`
        lists and its `--filter` matches."""
        return _display(self.path)

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
            raise ValueError(f"leaf {name!r}: unknown kind {_short(kind)}")
        if not isinstance(dtype, str) or not (kind == KEY or _is_dtype(dtype)):
            raise ValueError(f"leaf {name!r}: dtype {_short(dtype)} is not a NumPy dtype name")
        if kind == KEY and not (isinstance(key_impl, str) and _is_key_impl(key_impl)):
            raise ValueError(f"leaf {name!r}: key_impl {_short(key_impl)} is not a PRNG impl")
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


def _is_path(path: Any) -> bool:
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


def is_counts(values: Any) -> bool:
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


def flatten(tree: Any, *, item: str) -> tuple[dict[str, Any], list[LeafSpec]]:
    """Flattens `tree` into `{name: array}` ready to write, plus the specs to record.

    NumPy leaves are copied, so the caller may mutate its arrays as soon as `save` returns.
    """
    arrays: dict[str, Any] = {}
    specs: list[LeafSpec] = []
    seen: dict[str, tuple] = {}  # the key path of each name
    for path, leaf in tree_util.tree_flatten_with_path(tree)[0]:
        entries = _entries(path)
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
    return arrays, specs


def _encode(leaf: Any, name: str, entries: tuple, item: str) -> tuple[Any, LeafSpec]:
    if isinstance(leaf, jax.Array):
        layout = _layout(leaf.sharding)
        # (a NumPy dtype is never a key: the common case skips the slower issubdtype)
        if not isinstance(leaf.dtype, np.dtype) and jax.dtypes.issubdtype(
            leaf.dtype, jax.dtypes.prng_key
        ):
            impl = str(jax.random.key_impl(leaf))
            spec = LeafSpec(name, entries, leaf.shape, str(leaf.dtype), KEY, impl, layout)
            value = jax.random.key_data(leaf)
        else:
            _check_storable(item, entries, leaf.dtype)
            dtype = _dtype_name(leaf.dtype)
            value, spec = leaf, LeafSpec(name, entries, leaf.shape, dtype, sharding=layout)
        if jax.process_count() > 1 and value.is_fully_addressable:
            # A host-local array (e.g. jax.random.key(0) made on every host), which Orbax
            # refuses in a multi-process job: it is saved like a NumPy array, from process 0,
            # and restored onto the target's sharding.
            value = np.asarray(value)
        return value, spec
    if _is_python_scalar(leaf):
        value = np.asarray(leaf)
        if value.dtype != object:  # e.g. 2**70 fits no integer dtype
            return value, LeafSpec(name, entries, (), value.dtype.name, PYTHON)
    elif isinstance(leaf, np.ndarray | np.generic) and leaf.dtype != object:
        _check_storable(item, entries, leaf.dtype)
        value = np.array(leaf, copy=True)
        return value, LeafSpec(name, entries, value.shape, value.dtype.name)
    raise UnsupportedValueError(
        f"{item} leaf {_display(entries)} is a {type(leaf).__module__}.{type(leaf).__qualname__} "
        f"({_short(leaf)}), which jaxckpt cannot save: leaves must be jax.Array, NumPy arrays "
        "of a numeric dtype or Python/NumPy scalars that fit one. Put other values in meta= "
        "(JSON), or make them static pytree fields."
    )


_PLAIN_NODES = (dict, list, tuple, type(None))


def node_types(tree: Any) -> list[str]:
    """The qualified names of the tree's node types other than dict, list, tuple and None:
    those a restore without a target cannot rebuild (it returns nested dicts and lists)."""
    found: set[type] = set()
    stack = [tree_util.tree_structure(tree)]
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


def _check_storable(item: str, entries: tuple, dtype: np.dtype) -> None:
    if not _storable(dtype):
        raise UnsupportedValueError(
            f"{item} leaf {_display(entries)} has dtype {dtype}, which checkpoints (tensorstore) "
            "cannot store. Cast it to a supported dtype first (e.g. uint4 to uint8), keep "
            "strings in meta=, or make the value a static pytree field."
        )


@functools.lru_cache(maxsize=256)  # numpy's dtype.name is slow Python; save blocks on this
def _dtype_name(dtype: np.dtype) -> str:
    return np.dtype(dtype).name


@functools.lru_cache(maxsize=1024)  # a state has few distinct shardings; save blocks on this
def _layout(sharding: jax.sharding.Sharding) -> dict[str, Any]:
    if isinstance(sharding, jax.sharding.NamedSharding):
        return {
            "mesh": dict(sharding.mesh.shape),
            "spec": [list(e) if isinstance(e, tuple) else e for e in sharding.spec],
        }
    return {"devices": len(sharding.device_set)}


MAX_JSON_DEPTH = 200  # far below where Python's json (and most others) stop reading


def check_json(value: Any, path: str = "meta") -> None:
    """Raises UnsupportedValueError naming the first value that is not JSON, or that JSON
    readers refuse: nesting deeper than MAX_JSON_DEPTH, integers too long to print.

    NaN and infinities are kept (a NaN loss in `meta=` must not stop training): Python's
    json writes and reads them as the tokens NaN, Infinity and -Infinity, which strict JSON
    lacks; `strict_json` turns them into those strings for output that must be strict.
    """
    stack = [(value, path, 0)]
    while stack:
        value, path, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise UnsupportedValueError(
                f"{path} is nested more than {MAX_JSON_DEPTH} levels deep, which JSON readers "
                "refuse; flatten it, or keep such data in a file of its own."
            )
        if isinstance(value, int) and value.bit_length() > 14_000:
            try:
                str(value)
            except ValueError:  # over sys.get_int_max_str_digits()
                raise UnsupportedValueError(
                    f"{path} is an integer of more than {sys.get_int_max_str_digits()} digits, "
                    "which Python's JSON cannot write or read; store it as a string."
                ) from None
        if value is None or isinstance(value, str | int | float):  # (bool is an int)
            continue
        if isinstance(value, Mapping):
            for k in value:
                if not isinstance(k, str):
                    raise UnsupportedValueError(
                        f"{path} has the key {_short(k)} of type {type(k).__name__}; JSON object "
                        "keys must be strings. Convert the key with str()."
                    )
            items = value.items()
        elif isinstance(value, list | tuple):
            items = enumerate(value)
        else:
            raise UnsupportedValueError(
                f"{path} is a {type(value).__module__}.{type(value).__qualname__} "
                f"({_short(value)}), which is not JSON. meta= takes dicts with string keys, "
                "lists, strings, numbers, booleans and None; convert the value first (e.g. "
                ".item() for a NumPy scalar, str() for a path, or keep arrays in state=)."
            )
        children = [(v, f"{path}[{k!r}]", depth + 1) for k, v in items]
        stack.extend(reversed(children))  # the first bad value is the one reported


_NON_FINITE = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}


def strict_json(value: Any) -> Any:
    """`value` with NaN and infinities as the strings "NaN", "Infinity" and "-Infinity" (the
    tokens Python's json writes for them), for documents that must be strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return _NON_FINITE[repr(value)]
    if isinstance(value, Mapping):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [strict_json(v) for v in value]
    return value


# --------------------------------------------------------------------------------------------
# Restoring


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

    missing = [_display(_entries(p)) for n, (p, _) in target_leaves.items() if n not in by_name]
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


def nest(saved: Sequence[LeafSpec], arrays: Mapping[str, Any]) -> Any:
    """Rebuilds nested dicts/lists from the recorded paths (restore without a target)."""
    if len(saved) == 1 and not saved[0].path:
        return _decode(arrays[saved[0].name], saved[0], None)
    root: dict = {}
    sequences: set[int] = set()
    for spec in saved:
        node = root
        for depth, (kind, key) in enumerate(spec.path):
            if kind == "seq":
                sequences.add(id(node))
            if depth == len(spec.path) - 1:
                node[key] = _decode(arrays[spec.name], spec, None)
            else:
                node = node.setdefault(key, {})

    def finish(node: Any) -> Any:
        if not isinstance(node, dict):
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


def _is_python_scalar(leaf: Any) -> bool:
    # np.float64 subclasses float: it is a NumPy scalar, not a Python one.
    return isinstance(leaf, bool | int | float) and not isinstance(leaf, np.generic)


def _compare(leaf: Any, spec: LeafSpec) -> str | None:
    """Says how a target leaf differs from the saved one, or None if it matches."""
    if _is_python_scalar(leaf):
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
    if _is_python_scalar(target_leaf):
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


def leaf_name(path: tuple) -> str:
    """The stored name of the leaf at a `jax.tree_util` key path (`params.w`)."""
    return _name(_entries(path))


def _entries(path: tuple) -> tuple[tuple[str, Any], ...]:
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


def _name(entries: tuple[tuple[str, Any], ...]) -> str:
    return ".".join(str(key) for _, key in entries) or "_"


def _display(entries: Sequence[tuple[str, Any]]) -> str:
    """How errors name a leaf: its stored name, the one spelling the CLI uses too."""
    return _name(entries) if entries else "_ (the tree's root)"


def _describe(shape: Sequence[int], dtype: str) -> str:
    return f"shape {tuple(shape)} dtype {dtype}"


def _listing(paths: Sequence[str], limit: int = 20) -> str:
    shown = ", ".join(paths[:limit])
    return shown + (f" (and {len(paths) - limit} more)" if len(paths) > limit else "")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."

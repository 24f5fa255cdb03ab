"""Restore targets: abstract trees whose shardings say where every restored array lands.

A checkpoint moves to another mesh (another shape, device count or host count) by restoring
it into a target built for that mesh. Three ways to build one:

* `target_on_mesh(abstract, mesh, specs)`: from shapes/dtypes and a PartitionSpec tree;
* `target_from_flax(abstract, mesh, rules)`: from Flax partitioning annotations
  (`nnx.with_partitioning`, Linen `nn.with_partitioning` / logical axis names + rules);
* `target_like(state)`: from a live state, keeping each leaf's current sharding.

>>> import jax, jax.numpy as jnp
>>> from jax.sharding import PartitionSpec as P
>>> mesh = jax.make_mesh((1,), ("data",))
>>> target = target_on_mesh({"w": jax.ShapeDtypeStruct((4, 2), jnp.float32)}, mesh, P("data"))
>>> target["w"].sharding.spec == P("data")
True
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding, SingleDeviceSharding

from jaxckpt._match import replicated_sharding
from jaxckpt._tree import KeyPath, LeafSpec, ReadRequest, leaf_name
from jaxckpt.errors import ConfigError

if TYPE_CHECKING:
    from jaxckpt._manager import CheckpointManager

log = logging.getLogger("jaxckpt")


def fitting_spec(
    spec: PartitionSpec | None, shape: Sequence[int], mesh_axes: Mapping[str, int]
) -> PartitionSpec:
    """`spec` if it fits a mesh with these axis sizes, else replicated (`PartitionSpec()`).

    A spec fits when the mesh has every axis it names and they divide the dimensions they
    split. The one rule for a leaf that keeps its own spec on another mesh: in
    `target_on_mesh(abstract, mesh)` and in `jaxckpt plan`.

    >>> fitting_spec(PartitionSpec("data", "model"), (8, 4), {"data": 8})
    P()
    >>> fitting_spec(PartitionSpec("data"), (8, 4), {"data": 8})
    P('data',)
    """
    if spec is None or len(spec) > len(shape):
        return PartitionSpec()
    for dim, entry in zip(shape, spec, strict=False):
        axes = () if entry is None else entry if isinstance(entry, tuple) else (entry,)
        if any(a not in mesh_axes for a in axes) or dim % math.prod(mesh_axes[a] for a in axes):
            return PartitionSpec()
    return spec


def requests_on_mesh(
    specs: Sequence[LeafSpec], mesh: Mesh
) -> tuple[dict[str, ReadRequest], list[str]]:
    """What a restore onto `mesh` reads of each saved leaf, as `target_on_mesh(abstract,
    mesh)` places it: its saved spec where that fits (`fitting_spec`), else replicated; host
    leaves stay on the host. Also the leaves whose saved spec did not fit (`jaxckpt plan`)."""
    sizes = dict(mesh.shape)
    requests, replicated = {}, []
    for spec in specs:
        sharding = None
        if spec.sharding is not None:
            placed = fitting_spec(spec.spec, spec.shape, sizes)
            if spec.spec is not None and placed != spec.spec:
                replicated.append(spec.name)
            sharding = NamedSharding(mesh, placed)
        requests[spec.name] = ReadRequest(spec.stored_shape, spec.stored_dtype, sharding)
    return requests, replicated


def target_on_mesh(abstract: Any, mesh: Mesh, specs: Any = None) -> Any:
    """Places every array leaf of `abstract` on `mesh`.

    Args:
      abstract: a tree whose leaves have `.shape` and `.dtype`
        ([`jax.eval_shape`][jax.eval_shape] output, live arrays,
        [`nnx.eval_shape`][flax.nnx.eval_shape] state). Python scalars and NumPy arrays stay
        as they are (restored on the host).
      mesh: a concrete [device mesh][jax.sharding.Mesh]; its axis types (Auto or Explicit) are kept.
      specs: a [`PartitionSpec`][jax.sharding.PartitionSpec] tree matching `abstract` (None
        entries: replicated), or one PartitionSpec for every leaf; a spec naming an axis the
        mesh lacks is a ConfigError. None: each leaf keeps the spec of its own
        [`NamedSharding`][jax.sharding.NamedSharding] (e.g. live arrays on another mesh, or
        [`nnx.eval_shape`][flax.nnx.eval_shape] under [`jax.set_mesh`][jax.set_mesh]) where
        it fits `mesh` (`fitting_spec`, the rule `jaxckpt plan` uses), and is replicated
        otherwise: the leaves that fell back to replicated are logged.
    """
    if not isinstance(mesh, Mesh):
        raise ConfigError(f"mesh must be a concrete jax.sharding.Mesh, got {type(mesh).__name__}")
    if specs is None or isinstance(specs, PartitionSpec):  # one spec (None: its own) for all
        fell_back: list[str] | None = [] if specs is None else None
        placed = jax.tree_util.tree_map_with_path(
            lambda path, leaf: _place(path, leaf, mesh, specs, fell_back), abstract
        )
        if fell_back:
            log.warning(
                "target_on_mesh: %d leaves placed replicated, their spec does not fit the "
                "mesh %s: %s",
                len(fell_back),
                dict(mesh.shape),
                ", ".join(fell_back),
            )
        return placed
    try:
        return jax.tree_util.tree_map_with_path(
            lambda path, leaf, spec: _place(path, leaf, mesh, spec), abstract, specs
        )
    except ConfigError:
        raise
    except ValueError as e:
        raise ConfigError(
            f"the PartitionSpec tree does not match the abstract tree: {e}. Give one spec per "
            "array leaf (None for replicated), or a single PartitionSpec for all."
        ) from None


def _place(
    path: KeyPath,
    leaf: Any,
    mesh: Mesh,
    spec: PartitionSpec | None,
    fell_back: list[str] | None = None,
) -> Any:
    """`leaf` on `mesh` with `spec`; with `fell_back`, with its own spec where that fits
    (else replicated, its name added to `fell_back`)."""
    if not hasattr(leaf, "shape") or isinstance(leaf, np.ndarray | np.generic):
        return leaf  # a scalar or NumPy array, restored on the host
    if fell_back is not None:
        own = getattr(leaf, "sharding", None)
        own = own.spec if isinstance(own, NamedSharding) else PartitionSpec()
        if (spec := fitting_spec(own, leaf.shape, dict(mesh.shape))) != own:
            fell_back.append(leaf_name(path))
    spec = PartitionSpec() if spec is None else spec
    named = {a for e in spec if e is not None for a in (e if isinstance(e, tuple) else (e,))}
    if missing := sorted(named - set(mesh.axis_names)):
        raise ConfigError(
            f"leaf {leaf_name(path)}: its PartitionSpec {spec} names the axis "
            f"{', '.join(map(repr, missing))}, which the mesh {dict(mesh.shape)} lacks. Use "
            "the mesh's axes, or None to replicate that dimension."
        )
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=NamedSharding(mesh, spec))


def target_from_flax(
    abstract: Any, mesh: Mesh, rules: Sequence[tuple[str, Any]] | None = None
) -> Any:
    """Places a Flax state on `mesh` per its partitioning annotations.

    Args:
      abstract: an NNX state (`nnx.state(nnx.eval_shape(...))`, whose variables carry
        [`nnx.with_partitioning`][flax.nnx.with_partitioning] metadata) or a Linen variables
        tree with `nn.Partitioned` boxes (`jax.eval_shape(model.init, ...)`); unannotated
        leaves are replicated.
      mesh: the concrete mesh to restore onto.
      rules: logical axis rules, `(logical name, mesh axis or None)` pairs, when the
        annotations name logical axes (e.g. `("embed", None), ("mlp", "model")`).
    """
    from flax import linen as nn  # flax is optional: only this helper needs it
    from flax import nnx

    if isinstance(abstract, nnx.State):
        specs = nnx.get_partition_spec(abstract)
    else:
        specs = nn.get_partition_spec(abstract)
        abstract = nn.unbox(abstract)
    if rules is not None:
        specs = nn.logical_to_mesh(specs, rules)
    return target_on_mesh(abstract, mesh, specs)


def target_like(state: Any) -> Any:
    """The target of a live state: each array leaf's shape, dtype and current sharding.

    Unlike passing the live state itself, the result holds no device memory, so the live
    arrays may be deleted before restoring. Uncommitted arrays (the scalars `optax` and
    [`nnx.Optimizer`][flax.nnx.Optimizer] make on device 0) are placed replicated on the
    mesh of the other leaves, as a restore into the live state itself places them.
    """
    home = replicated_sharding(state)

    def abstract(leaf: Any) -> Any:
        if isinstance(leaf, jax.Array):
            sharding = home if home is not None and not leaf.committed else leaf.sharding
            return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)
        return leaf

    return jax.tree.map(abstract, state)


def restore_or_init(
    manager: CheckpointManager, init: Callable[..., Any], *args: Any, shardings: Any = None
) -> tuple[Any, int]:
    """The state to train from, and its step: the latest committed step restored onto the
    shapes `init(*args)` makes, or where the directory holds none, `init(*args)` itself
    and step 0 (Levanter's `load_checkpoint_or_initialize`).

    The target is [`jax.eval_shape`][jax.eval_shape] of `init` under `jax.jit` with
    `out_shardings=shardings`: nothing is allocated twice, and the restored state lands
    where a fresh one would. A save of this manager still in flight is waited for first,
    as `restore` waits for it.

    >>> import jax, jax.numpy as jnp, tempfile, jaxckpt
    >>> init = lambda: {"w": jnp.zeros(3)}
    >>> with jaxckpt.CheckpointManager(tempfile.mkdtemp()) as mngr:
    ...     state, step = jaxckpt.restore_or_init(mngr, init)  # nothing saved: init()
    ...     mngr.save(7, state={"w": jnp.arange(3.0)})
    ...     state, step = jaxckpt.restore_or_init(mngr, init)
    >>> step, state["w"].tolist()
    (7, [0.0, 1.0, 2.0])

    Args:
      manager: the manager of the run's directory.
      init: makes the state from `args` (a model and its optimizer state, say).
      shardings: where the state's arrays go (a sharding, or a tree of them like the
        state's), as `jax.jit`'s `out_shardings`; None: where `init` puts them.
    """
    made = jax.jit(init, out_shardings=shardings)
    manager.wait()  # as `restore` does: a process sees its own saves, its own failures
    latest = manager.latest_step()
    if latest is None:
        return made(*args), 0
    default = SingleDeviceSharding(jax.devices()[0])  # where jit puts what it is not told

    def placed(leaf: Any) -> Any:
        if isinstance(leaf, jax.ShapeDtypeStruct) and not isinstance(leaf.sharding, Sharding):
            return leaf.update(sharding=default)
        return leaf

    target = jax.tree.map(placed, jax.eval_shape(made, *args))
    restored = manager.restore(latest, state=target)
    return restored.state, restored.step

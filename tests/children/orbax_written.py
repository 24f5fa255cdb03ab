"""Checkpoints plain Orbax writes, as tests/test_from_orbax.py opens them: a MaxText-style
training state, and the jobs that save and restore it on several processes (run by
children.job in every process)."""

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from children.job import Job

STEP = 7
KERNEL = np.arange(8 * 16, dtype=np.float32).reshape(8, 16)
BIAS = np.arange(16, dtype=np.float32)


def put(x, mesh, spec):
    """A global array from a host array (on every process of a multi-process job)."""
    return jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec), lambda i: x[i])


def train_state(mesh=None):
    """MaxText's state tree, {"params": {"params": ...}, "opt_state": ..., "step": ...};
    the kernel sharded on `mesh`'s data x model (None: its shapes and dtypes only)."""
    if mesh is None:
        return jax.eval_shape(lambda: _state(jnp.asarray(KERNEL), jnp.asarray(BIAS)))
    state = _state(put(KERNEL, mesh, P("data", "model")), put(BIAS, mesh, P()))
    # optax's count and the step are made on one device: global arrays, as Orbax needs
    # from several processes
    on_mesh = lambda x: isinstance(x.sharding, NamedSharding)  # noqa: E731
    return jax.tree.map(lambda x: x if on_mesh(x) else put(np.asarray(x), mesh, P()), state)


def _state(kernel, bias):
    params = {"params": {"dense": {"kernel": kernel, "bias": bias}}}
    return {"params": params, "opt_state": optax.adam(1e-3).init(params), "step": jnp.int32(STEP)}


def target_on(mesh, kernel_spec):
    """The restore target: the state's shapes, replicated on `mesh`, the kernel laid out
    by `kernel_spec`."""
    replicated = NamedSharding(mesh, P())
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated), train_state()
    )
    dense = target["params"]["params"]["dense"]
    dense["kernel"] = jax.ShapeDtypeStruct(
        KERNEL.shape, np.float32, sharding=NamedSharding(mesh, kernel_spec)
    )
    return target


def check_restored(state, mesh):
    """The restored state holds what was saved, on `mesh` (only this process's shards)."""
    dense = state["params"]["params"]["dense"]
    assert dense["kernel"].sharding.mesh.shape == mesh.shape
    for array, full in ((dense["kernel"], KERNEL), (dense["bias"], BIAS)):
        for shard in array.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), full[shard.index])
    assert int(np.asarray(state["step"].addressable_shards[0].data)) == STEP
    adam = state["opt_state"][0]
    assert type(adam).__name__ == "ScaleByAdamState"
    assert not np.asarray(adam.mu["params"]["dense"]["kernel"].addressable_shards[0].data).any()


def dataset(process: int = 0):
    # Each process reads its own shard of the data, as a MaxText input pipeline does.
    return grain.MapDataset.range(process * 1000, process * 1000 + 1000).batch(4)


def save_maxtext(directory, state, process: int = 0):
    """MaxText's CheckpointManager: items (the state) and iter (grain's handler), the
    iterator `process + 1` batches in."""
    data = iter(dataset(process).to_iter_dataset())
    for _ in range(process + 1):
        next(data)
    with ocp.CheckpointManager(directory, item_names=("items", "iter")) as m:
        args = ocp.args.Composite(
            items=ocp.args.PyTreeSave(state), iter=grain.checkpoint.CheckpointSave(data)
        )
        m.save(STEP, args=args)
        return m.all_steps()


def mesh_of(shape):
    return jax.make_mesh(shape, ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


def save(job: Job) -> dict:
    """The MaxText layout, saved from every process."""
    return {"steps": save_maxtext(job.args["dir"], train_state(mesh_of((4, 2))), job.process_id)}


def restore(job: Job) -> dict:
    """Onto a (2, 4) mesh with the kernel laid out otherwise, each process's grain iterator
    from `iter`. `continue_in_place`: a writer then saves the next step beside Orbax's."""
    mesh = mesh_of((2, 4))
    data = iter(dataset(job.process_id).to_iter_dataset())
    writer = job.args.get("continue_in_place", False)
    with jaxckpt.CheckpointManager(job.args["dir"], read_only=not writer) as m:
        restored = m.restore(state=target_on(mesh, P("model", "data")), data=data)
        check_restored(restored.state, mesh)
        report = {"step": restored.step, "next": np.asarray(next(data)).tolist()}
        if writer:
            m.save(STEP + 1, state=restored.state, data=data)
            m.wait()
            report["steps"] = m.all_steps()
    return report


def restore_each(job: Job) -> dict:
    """Every directory of `job.args["dirs"]` (`{name: (path, item)}`), onto a (2, 4) mesh."""
    mesh = mesh_of((2, 4))
    steps = {}
    for name, (path, item) in job.args["dirs"].items():
        with jaxckpt.CheckpointManager(path, read_only=True) as m:
            restored = m.restore(state=target_on(mesh, P("model", "data")), item=item)
        check_restored(restored.state, mesh)
        steps[name] = restored.step
    return {"steps": steps}

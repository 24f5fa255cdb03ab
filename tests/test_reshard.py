"""Restoring onto another mesh: the target's shardings decide where every array lands."""

import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from jaxckpt import errors
from jaxckpt._match import plan_restore
from jaxckpt._plan import RESTORE_FIXED_BYTES, process_bytes, read_batches
from jaxckpt._tree import LeafSpec


def make_mesh(shape, names, axis_type=AxisType.Auto, devices=None):
    devices = np.array(devices if devices is not None else jax.devices()[: np.prod(shape)])
    return jax.sharding.Mesh(devices.reshape(shape), names, axis_types=(axis_type,) * len(shape))


def saved_state(mesh):
    """A state on the (4, 2) mesh: sharded both ways, on one axis, replicated, a key, scalars."""

    def put(x, spec):
        return jax.device_put(x, NamedSharding(mesh, spec))

    return {
        "w": put(np.arange(64 * 16, dtype=np.float32).reshape(64, 16), P("data", "model")),
        "b": put(np.arange(16, dtype=np.float32), P("model")),
        "odd": put(np.arange(6 * 10, dtype=np.int32).reshape(6, 10), P("model", None)),
        "rep": put(np.linspace(0, 1, 12, dtype=np.float32).astype(jnp.bfloat16), P()),
        "key": put(jax.random.key(7), P()),
        "count": put(np.int32(3), P()),
    }


def assert_values(restored, expected):
    for name, value in expected.items():
        got, want = restored[name], value
        if jax.dtypes.issubdtype(want.dtype, jax.dtypes.prng_key):
            got, want = jax.random.key_data(got), jax.random.key_data(want)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=name)
        assert restored[name].dtype == value.dtype


@pytest.fixture
def saved(mesh, ckpt_dir):
    state = saved_state(mesh)
    with jaxckpt.CheckpointManager(ckpt_dir) as m:
        m.save(1, state=state, rng=jax.random.key(1))
    return state


def abstract(state):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)


SPECS_24 = {
    "w": P("model", "data"),
    "b": P(("data", "model")),
    "odd": P("data", None),
    "rep": P("model"),  # replicated -> sharded
    "key": P(),
    "count": P(),
}


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_onto_a_transposed_mesh(saved, ckpt_dir, axis_type):
    mesh = make_mesh((2, 4), ("data", "model"), axis_type)
    target = jaxckpt.target_on_mesh(abstract(saved), mesh, SPECS_24)
    with jaxckpt.CheckpointManager(ckpt_dir) as m:
        restored = m.restore(state=target)
    assert_values(restored.state, saved)
    for name, spec in SPECS_24.items():
        assert restored.state[name].sharding == NamedSharding(mesh, spec), name
    assert restored.state["w"].sharding.mesh.axis_types == (axis_type, axis_type)
    # The rng lands replicated on the state target's mesh.
    assert restored.rng.sharding.mesh == mesh
    assert restored.rng.sharding.is_fully_replicated


@pytest.mark.parametrize(
    "shape, names, specs",
    [
        ((8,), ("x",), {"w": P("x"), "b": P("x"), "odd": P(), "rep": P()}),
        ((2,), ("x",), {"w": P(None, "x"), "b": P(), "odd": P("x"), "rep": P("x")}),
        ((1,), ("x",), {"w": P("x"), "b": P(), "odd": P(), "rep": P()}),
    ],
    ids=["8-in-a-line", "2-devices", "1-device"],
)
def test_onto_fewer_or_other_devices(saved, ckpt_dir, shape, names, specs):
    mesh = make_mesh(shape, names)
    target = jaxckpt.target_on_mesh(abstract(saved), mesh, {**specs, "key": P(), "count": P()})
    with jaxckpt.CheckpointManager(ckpt_dir) as m:
        restored = m.restore(state=target)
    assert_values(restored.state, saved)
    assert restored.state["w"].sharding == NamedSharding(mesh, specs["w"])
    assert {d.id for d in restored.state["w"].sharding.device_set} == {
        d.id for d in mesh.devices.flat
    }


def test_sharded_to_fully_replicated_and_onto_one_device(saved, ckpt_dir):
    mesh = make_mesh((2, 4), ("data", "model"))
    one = SingleDeviceSharding(jax.devices()[5])
    target = jaxckpt.target_on_mesh(abstract(saved), mesh, P())
    target["w"] = jax.ShapeDtypeStruct((64, 16), jnp.float32, sharding=one)
    with jaxckpt.CheckpointManager(ckpt_dir) as m:
        restored = m.restore(state=target)
    assert_values(restored.state, saved)
    assert restored.state["b"].sharding.is_fully_replicated
    assert restored.state["w"].sharding == one


def test_target_like_keeps_live_shardings(saved, ckpt_dir):
    target = jaxckpt.target_like(saved)
    assert all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in jax.tree.leaves(target))
    with jaxckpt.CheckpointManager(ckpt_dir) as m:
        restored = m.restore(state=target)
    assert_values(restored.state, saved)
    for name, value in saved.items():
        assert restored.state[name].sharding == value.sharding


def test_restore_or_init_initializes_then_restores_onto_the_shardings_given(ckpt_dir):
    """Nothing saved: init's own state and step 0; then the latest step, each leaf onto the
    sharding given for it (init's `out_shardings`)."""

    def init(scale):
        return {"w": jnp.ones((64, 16)) * scale, "n": jnp.int32(0)}

    mesh = make_mesh((2, 4), ("data", "model"))
    onto = {"w": NamedSharding(mesh, P("model", "data")), "n": NamedSharding(mesh, P())}
    with jaxckpt.CheckpointManager(ckpt_dir) as m:
        state, step = jaxckpt.restore_or_init(m, init, 2.0, shardings=onto)
        assert step == 0 and float(state["w"][0, 0]) == 2.0 and state["w"].sharding == onto["w"]
        m.save(3, state={"w": state["w"] + 1, "n": state["n"] + 3})
    with jaxckpt.CheckpointManager(ckpt_dir) as m:
        state, step = jaxckpt.restore_or_init(m, init, 2.0, shardings=onto)
    assert step == 3 and int(state["n"]) == 3 and float(state["w"][5, 5]) == 3.0
    assert {k: v.sharding for k, v in state.items()} == onto


def test_partial_restore_of_a_subtree(mesh, ckpt_dir):
    state = {"params": saved_state(mesh), "opt_state": {"mu": jnp.ones((64, 16))}}
    with jaxckpt.CheckpointManager(ckpt_dir) as m:
        m.save(1, state=state)
        target = {"params": jaxckpt.target_like(state["params"])}
        with pytest.raises(errors.TreeMismatchError, match=r"pass partial=True"):
            m.restore(state=target)
        restored = m.restore(state=target, partial=True)
    assert set(restored.state) == {"params"}
    assert_values(restored.state["params"], state["params"])


def test_strict_targets(saved, ckpt_dir):
    with jaxckpt.CheckpointManager(ckpt_dir) as m:
        with pytest.raises(
            errors.MissingShardingError, match=r"leaves have no sharding.*: (.*, )?w(,|\.)"
        ):
            m.restore(state=abstract(saved))  # no sharding: never fall back to the saved one
        mesh = make_mesh((2, 4), ("data", "model"))
        target = jaxckpt.target_on_mesh(abstract(saved), mesh, SPECS_24)
        target["odd"] = jax.ShapeDtypeStruct(
            (6, 10), jnp.int32, sharding=NamedSharding(mesh, P("model"))
        )
        with pytest.raises(
            errors.ShardingError, match=r"leaf odd of shape \(6, 10\) cannot be placed"
        ):
            m.restore(state=target)


def test_abstract_mesh_target_is_refused_with_the_fix(saved, ckpt_dir):
    mesh = make_mesh((2, 4), ("data", "model"))
    abstract_mesh = mesh.abstract_mesh
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=NamedSharding(abstract_mesh, P())
        ),
        abstract(saved),
    )
    with jaxckpt.CheckpointManager(ckpt_dir) as m:
        with pytest.raises(errors.MissingShardingError, match=r"jaxckpt.target_on_mesh"):
            m.restore(state=target)
        restored = m.restore(state=jaxckpt.target_on_mesh(target, mesh))  # keeps each spec
    assert_values(restored.state, saved)


# ------------------------------------------------------------------------------- Flax


class Mlp(nnx.Module):
    def __init__(self, rngs):
        init = nnx.initializers.lecun_normal()
        self.up = nnx.Linear(
            16, 32, kernel_init=nnx.with_partitioning(init, ("embed", "mlp")), rngs=rngs
        )
        self.down = nnx.Linear(
            32, 16, kernel_init=nnx.with_partitioning(init, ("mlp", "embed")), rngs=rngs
        )


RULES = [("embed", None), ("mlp", "model")]


def test_nnx_logical_annotations_onto_another_mesh(ckpt_dir):
    src = make_mesh((4, 2), ("data", "model"))
    with jax.set_mesh(src), nn.logical_axis_rules(RULES):
        model = Mlp(nnx.Rngs(0))  # created sharded per its annotations
    assert model.up.kernel.value.sharding == NamedSharding(src, P(None, "model"))
    dst = make_mesh((2, 4), ("data", "model"), AxisType.Explicit)
    with jax.set_mesh(dst), nn.logical_axis_rules(RULES):
        abstract_state = nnx.state(nnx.eval_shape(lambda: Mlp(nnx.Rngs(1))))
    with jaxckpt.CheckpointManager(ckpt_dir) as m:
        m.save(1, state=nnx.state(model))
        restored = m.restore(state=jaxckpt.target_from_flax(abstract_state, dst, RULES))
    kernel = restored.state["up"]["kernel"].value
    assert kernel.sharding == NamedSharding(dst, P(None, "model"))
    assert restored.state["up"]["bias"].value.sharding == NamedSharding(dst, P())
    np.testing.assert_array_equal(np.asarray(kernel), np.asarray(model.up.kernel.value))
    with jax.set_mesh(dst), nn.logical_axis_rules(RULES):
        fresh = Mlp(nnx.Rngs(5))
    nnx.update(fresh, restored.state)
    np.testing.assert_array_equal(
        np.asarray(fresh.down.kernel.value), np.asarray(model.down.kernel.value)
    )


def test_linen_logical_partitioning_onto_another_mesh(ckpt_dir):
    class Dense(nn.Module):
        @nn.compact
        def __call__(self, x):
            init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp"))
            return nn.Dense(32, kernel_init=init)(x)

    x = jnp.ones((2, 16))
    variables = Dense().init(jax.random.key(0), x)
    params = nn.unbox(variables)
    with jaxckpt.CheckpointManager(ckpt_dir) as m:
        m.save(1, state=params)
        dst = make_mesh((8,), ("model",))
        target = jaxckpt.target_from_flax(
            jax.eval_shape(Dense().init, jax.random.key(0), x), dst, RULES
        )
        restored = m.restore(state=target)
    kernel = restored.state["params"]["Dense_0"]["kernel"]
    assert kernel.sharding == NamedSharding(dst, P(None, "model"))
    np.testing.assert_array_equal(
        np.asarray(kernel), np.asarray(params["params"]["Dense_0"]["kernel"])
    )


def test_plan_reports_per_process_reads_before_reading(saved, ckpt_dir):
    mesh = make_mesh((2, 4), ("data", "model"))
    target = jaxckpt.target_on_mesh(abstract(saved), mesh, SPECS_24)
    # w, b, odd, rep (bf16), key (2 uint32 words), count
    stored = 64 * 16 * 4 + 16 * 4 + 6 * 10 * 4 + 12 * 2 + 2 * 4 + 4
    with jaxckpt.CheckpointManager(ckpt_dir, restore_inflight_bytes=1024) as m:
        plan = m.plan(state=target)
        (process,) = plan.processes
        assert (plan.step, plan.leaves, plan.saved_bytes) == (1, 6, stored)
        assert process.read_bytes == stored  # each distinct slice once
        # Replicas count on each device: odd (x4 over "model"), rep (x2 over "data"),
        # key and count (x8); w and b are split over all 8 devices.
        assert process.device_bytes == 4096 + 64 + 4 * 240 + 2 * 24 + 8 * 8 + 8 * 4
        # On CPU devices the restored arrays are host memory; then 1.25x the largest batch
        # read at once (w alone: 4096 bytes > the 1024 budget) and a fixed cost (a bound:
        # benchmarks/restore_memory.py).
        assert process.peak_host_bytes == process.device_bytes + 4096 * 5 // 4 + RESTORE_FIXED_BYTES
        assert "restore plan for step 1: 6 leaves" in str(plan)

        (replicated,) = m.plan(state=jaxckpt.target_on_mesh(abstract(saved), mesh, P())).processes
        assert replicated.read_bytes == stored and replicated.device_bytes == 8 * stored

        with pytest.raises(
            errors.TreeMismatchError, match=r"in the target but not in the checkpoint: extra\n"
        ):
            m.plan(state=dict(target, extra=target["w"]))


def test_restore_in_small_batches_reads_every_leaf_once(saved, ckpt_dir):
    """A budget smaller than any leaf restores one leaf per batch, bitwise."""
    mesh = make_mesh((2, 4), ("data", "model"))
    target = jaxckpt.target_on_mesh(abstract(saved), mesh, SPECS_24)
    info = json.loads((ckpt_dir / "1" / "jaxckpt" / "jaxckpt.json").read_text())
    specs = [LeafSpec.from_json(d) for d in info["items"]["state"]]
    requests, _ = plan_restore(target, specs, item="state", step=1, partial=False)
    assert [len(b) for b in read_batches(requests, 1)] == [1] * 6
    assert [len(b) for b in read_batches(requests, 2**30)] == [6]
    batches = read_batches(requests, 4096 + 64)
    assert sorted(n for b in batches for n in b) == sorted(requests)
    for batch in batches:  # each batch fits the budget, or is one larger leaf
        sizes = [process_bytes(requests[n])[0][0] for n in batch]
        assert len(batch) == 1 or sum(sizes) <= 4096 + 64
    with jaxckpt.CheckpointManager(ckpt_dir, restore_inflight_bytes=1) as m:
        assert_values(m.restore(state=target).state, saved)

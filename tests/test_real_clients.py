"""jaxckpt used the way training code uses it, with the real objects: optax optimizers,
flax.nnx modules, optimizers, metrics and Rngs, grain pipelines and DataLoaders.

Each test is a bug a user met (issue 15): it failed before the fix.
"""

import json
import math
import re
import shutil

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from children import shared_pipeline
from click.testing import CliRunner
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from multihost import one_job_at_a_time, run_job

import jaxckpt
from conftest import run_python
from jaxckpt import _internals, errors
from jaxckpt.cli import main


def cli(*args):
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert "Traceback" not in result.output, result.output
    return result


class MLP(nnx.Module):
    def __init__(self, hidden: int, rngs: nnx.Rngs):
        self.linear1 = nnx.Linear(4, hidden, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)  # holds an RngStream: key and count
        self.linear2 = nnx.Linear(hidden, 2, rngs=rngs)

    def __call__(self, x):
        return self.linear2(self.dropout(nnx.relu(self.linear1(x))))


def on_mesh(x, mesh):
    """Kernels split over `model` columns, biases over `model`, scalars replicated."""
    spec = P(None, "model") if x.ndim == 2 else P("model") if x.ndim == 1 else P()
    return jax.device_put(x, NamedSharding(mesh, spec))


def batch(mesh, i):
    x = np.random.default_rng(i).normal(size=(8, 4)).astype(np.float32)
    put = lambda a: jax.device_put(a, NamedSharding(mesh, P("data")))  # noqa: E731
    return put(x), put(np.tanh(x[:, :2]))


def nnx_training(mesh):
    """A model on the mesh, its optimizer and metrics, as NNX training code makes them."""
    model = MLP(8, nnx.Rngs(0, dropout=1))
    nnx.update(model, jax.tree.map(lambda x: on_mesh(x, mesh), nnx.state(model, nnx.Param)))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    metrics = nnx.MultiMetric(loss=nnx.metrics.Average("loss"))
    return model, optimizer, metrics


@nnx.jit
def nnx_step(model, optimizer, metrics, x, y):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
    optimizer.update(model, grads)
    metrics.update(loss=loss)
    return loss


def nnx_state(model, optimizer, metrics):
    return {"model": nnx.state(model), "opt": nnx.state(optimizer), "metrics": nnx.state(metrics)}


# ------------------------------------------------------------------ one spelling of a leaf


def test_errors_name_leaves_as_inspect_lists_and_filters_them(ckpt_dir):
    with jaxckpt.CheckpointManager(ckpt_dir) as m:
        m.save(1, state={"model": nnx.state(MLP(8, nnx.Rngs(0)))})
        with pytest.raises(errors.LeafMismatchError) as info:
            m.restore(state={"model": nnx.state(MLP(16, nnx.Rngs(0)))})
    message = str(info.value)
    assert "leaf model.linear1.bias.value: shape (16,) dtype float32 in the target" in message
    assert "['model']" not in message and "].value" not in message

    listed = cli("inspect", ckpt_dir, "--filter", "model.linear1.bias.value")
    assert listed.exit_code == 0, listed.output
    assert re.search(r"^model\.linear1\.bias\.value\s+\(8,\)", listed.output, re.M)
    assert "1 leaves" in listed.output


# ------------------------------------------------------ the live state is the target (uncommitted)


def test_optax_state_restored_into_a_fresh_init_runs_the_jitted_step(mesh, ckpt_dir):
    tx = optax.adam(1e-2)
    params = {"w": on_mesh(jnp.ones((4, 8)), mesh), "b": on_mesh(jnp.zeros(8), mesh)}
    assert not tx.init(params)[0].count.committed  # what optax gives: count on device 0

    @jax.jit
    def step(params, opt, x):
        loss, grads = jax.value_and_grad(lambda p: jnp.sum((x @ p["w"] + p["b"]) ** 2))(params)
        updates, opt = tx.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt, loss

    x = batch(mesh, 0)[0]
    params, opt, _ = step(params, tx.init(params), x)
    with jaxckpt.CheckpointManager(ckpt_dir) as m:
        m.save(1, state={"params": params, "opt": opt})
        _, _, expected = step(params, opt, x)
        for target in (
            {"params": params, "opt": tx.init(params)},  # the live state is the target
            jaxckpt.target_like({"params": params, "opt": tx.init(params)}),
        ):
            restored = m.restore(state=target).state
            _, _, loss = step(restored["params"], restored["opt"], x)  # no device clash
            assert float(loss) == float(expected)
            count = restored["opt"][0].count
            assert count.sharding.is_fully_replicated and count.sharding.mesh == mesh
            assert int(count) == 1


def test_nnx_optimizer_metrics_and_rngs_restored_into_live_objects_train_on(mesh, ckpt_dir):
    model, optimizer, metrics = nnx_training(mesh)
    for i in range(2):
        nnx_step(model, optimizer, metrics, *batch(mesh, i))
    with jaxckpt.CheckpointManager(ckpt_dir) as m:
        m.save(2, state=nnx_state(model, optimizer, metrics))
        expected = [float(nnx_step(model, optimizer, metrics, *batch(mesh, i))) for i in (2, 3)]

        fresh = nnx_training(mesh)  # a new job: fresh objects, scalars uncommitted
        assert not nnx.state(fresh[1])["step"].value.committed
        restored = m.restore(state=nnx_state(*fresh))
    for obj, key in zip(fresh, ("model", "opt", "metrics"), strict=True):
        nnx.update(obj, restored.state[key])
    model2, optimizer2, metrics2 = fresh
    got = [float(nnx_step(model2, optimizer2, metrics2, *batch(mesh, i))) for i in (2, 3)]
    assert got == expected  # dropout keys, Adam's count, the metric's totals: all resumed
    for leaf in jax.tree.leaves(restored.state):
        assert leaf.sharding.mesh == mesh
    assert int(optimizer2.step.value) == 4
    assert float(metrics2.compute()["loss"]) == float(metrics.compute()["loss"])


# ------------------------------------------------------------------------- relative paths


def test_relative_directories_work_everywhere(tmp_path, monkeypatch, mesh):
    monkeypatch.chdir(tmp_path)
    state = lambda step: {"w": on_mesh(jnp.full((4, 8), step, jnp.float32), mesh)}  # noqa: E731
    with jaxckpt.CheckpointManager("rel/run") as m:
        m.save(40, state=state(40))
        monkeypatch.chdir("/")  # resolved once, where it came in: a chdir moves nothing
        m.save(60, state=state(60))
        m.wait()
        monkeypatch.chdir(tmp_path)
    assert (tmp_path / "rel/run/60").is_dir()
    with jaxckpt.CheckpointManager("rel/run", read_only=True) as m:
        assert m.all_steps() == [40, 60]
        restored = m.restore(state=jaxckpt.target_like(state(0)))
    assert float(restored.state["w"][0, 0]) == 60
    assert [r.ok for r in jaxckpt.verify("rel/run")] == [True, True]

    jaxckpt.export_safetensors("rel/run", "hf")
    jaxckpt.save_safetensors(state(7), "live")
    for source, value in (("hf", 60), ("live", 7), ("live/model.safetensors", 7)):
        loaded = jaxckpt.load_safetensors(source, {"w": np.zeros((4, 8), np.float32)})
        assert loaded["w"][0, 0] == value, source

    compared = cli("diff", "rel/run", 40, 60, "--values")
    assert compared.exit_code == 1, compared.output  # diff's convention: 1 = they differ
    assert "max |a - b| = 20" in compared.output
    exported = cli("export", "rel/run", "out")
    assert exported.exit_code == 0, exported.output
    assert (tmp_path / "out/model.safetensors").is_file()


# -------------------------------------------------------------- the body's error comes first


def test_the_with_block_raises_the_bodys_error_while_a_save_fails(mesh, ckpt_dir, caplog):
    lock = ckpt_dir / ".jaxckpt-writer.lock"

    def lose_the_lock():  # in the background, before the commit
        lock.unlink(missing_ok=True)

    with (
        _internals.on_writes_done(lose_the_lock),
        pytest.raises(FloatingPointError, match=r"^loss is nan\n") as info,
        jaxckpt.CheckpointManager(ckpt_dir) as m,
    ):
        m.save(1, state={"w": on_mesh(jnp.ones((4, 8)), mesh)})
        raise FloatingPointError("loss is nan")  # the training loop's own error
    (note,) = info.value.__notes__
    assert note.startswith(
        "jaxckpt: on leaving the with-block: SaveError: saving step 1 failed in the background"
    )
    assert "LockedError" in note
    failed = [r for r in caplog.records if r.levelname == "ERROR" and r.name == "jaxckpt"]
    assert failed and "saving step 1 failed" in failed[0].getMessage()
    assert "FloatingPointError" in failed[0].getMessage()

    # Without an error in the body, the failed save is what the with-block raises.
    with (
        _internals.on_writes_done(lose_the_lock),
        pytest.raises(errors.SaveError, match="saving step 2 failed in the background"),
        jaxckpt.CheckpointManager(ckpt_dir) as m,
    ):
        m.save(2, state={"w": on_mesh(jnp.ones((4, 8)), mesh)})


# ---------------------------------------------------------------------- a NaN loss in meta


def test_a_nan_loss_in_meta_is_saved_and_read_back_everywhere(mesh, ckpt_dir):
    loss = jnp.log(jnp.float32(-1.0))  # what a diverged training step hands back
    meta = {"loss": float(loss), "best": math.inf, "worst": [-math.inf, 0.5]}
    with jaxckpt.CheckpointManager(ckpt_dir) as m:
        m.save(1, state={"w": on_mesh(jnp.ones((4, 8)), mesh)}, meta=meta)  # no refusal
        m.wait()
        for got in (m.meta(), m.restore().meta):
            assert math.isnan(got["loss"]) and got["best"] == math.inf
            assert got["worst"] == [-math.inf, 0.5]

    fresh = run_python(
        "-c",
        "import jax; jax.config.update('jax_platforms', 'cpu'); import jaxckpt, sys; "
        "m = jaxckpt.CheckpointManager(sys.argv[1], read_only=True); "
        "print(repr(m.meta()), repr(m.restore().meta))",
        str(ckpt_dir),
    )
    expected = "{'loss': nan, 'best': inf, 'worst': [-inf, 0.5]}"
    assert fresh.stdout.split("\n")[0] == f"{expected} {expected}"

    shown = cli("inspect", ckpt_dir, "--json")
    assert shown.exit_code == 0, shown.output
    doc = json.loads(shown.output, parse_constant=lambda token: pytest.fail(token))  # strict
    assert doc["meta"] == {"loss": "NaN", "best": "Infinity", "worst": ["-Infinity", 0.5]}
    assert 'meta: {"loss": NaN' in cli("inspect", ckpt_dir).output
    assert cli("ls", ckpt_dir, "--json").exit_code == 0


# ----------------------------------------------- specs that do not fit another mesh: one rule


def test_target_on_mesh_and_plan_fall_back_to_replicated_by_the_same_rule(mesh, ckpt_dir, caplog):
    model = nnx_training(mesh)[0]
    state = {
        "model": nnx.state(model),  # kernels and biases split over `model`
        "emb": jax.device_put(jnp.ones((16, 4)), NamedSharding(mesh, P("data"))),  # 16 % 8 == 0
        "odd": jax.device_put(jnp.ones((4, 8)), NamedSharding(mesh, P("data"))),  # 4 % 8 != 0
    }
    with jaxckpt.CheckpointManager(ckpt_dir) as m:
        m.save(1, state=state)
    data_only = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))

    with caplog.at_level("WARNING", logger="jaxckpt"):
        target = jaxckpt.target_on_mesh(state, data_only)  # the live state, onto 8-way data
    (record,) = [r for r in caplog.records if "target_on_mesh" in r.getMessage()]
    fell_back = set(record.args[-1].split(", "))  # the leaves, as inspect names them
    assert fell_back == {
        "model.linear1.kernel.value",
        "model.linear1.bias.value",
        "model.linear2.kernel.value",
        "model.linear2.bias.value",
        "odd",
    }
    assert target["emb"].sharding.spec == P("data")
    assert target["model"]["linear1"]["kernel"].value.sharding.spec == P()

    with jaxckpt.CheckpointManager(ckpt_dir, read_only=True) as m:
        restored = m.restore(state=target).state
    assert restored["emb"].sharding.mesh == data_only
    np.testing.assert_array_equal(
        restored["model"]["linear1"]["kernel"].value, state["model"]["linear1"]["kernel"].value
    )

    planned = cli("plan", ckpt_dir, "--mesh", "8", "--axes", "data", "--json")
    assert planned.exit_code == 0, planned.output
    assert set(json.loads(planned.output)["planned_replicated"]) == fell_back

    # Explicit specs are not guessed at: an axis the mesh lacks names the leaf.
    with pytest.raises(errors.ConfigError, match=r"leaf w: its PartitionSpec .*'model'.*lacks"):
        jaxckpt.target_on_mesh(
            {"w": jax.ShapeDtypeStruct((4, 8), jnp.float32)}, data_only, P("model")
        )


# ------------------------------------------------------------------ nnx.Rngs passed as rng=


@nnx.jit
def dropped(x, rngs):
    return nnx.Dropout(0.5)(x, rngs=rngs)


def test_nnx_rngs_as_rng_need_a_target_of_their_kind_and_then_resume(mesh, ckpt_dir):
    rngs = nnx.Rngs(0, dropout=1)
    x = on_mesh(jnp.ones((4, 8)), mesh)
    dropped(x, rngs)  # the streams move on
    with jaxckpt.CheckpointManager(ckpt_dir) as m:
        m.save(1, state={"x": x}, rng=nnx.state(rngs))
        expected = [np.asarray(dropped(x, rngs)) for _ in range(2)]

        # Plain dicts in place of the Rngs' state: nnx.update took them, dropout then died of
        # KeyError: Ellipsis. Refused, before any array is read, saying what to pass.
        with pytest.raises(
            errors.TreeMismatchError,
            match=r"saved from a tree of .*flax\.nnx\.statelib\.State.*rng=nnx\.state\(rngs\)",
        ):
            m.restore(state={"x": x})

        fresh = nnx.Rngs(7, dropout=8)  # a new job's Rngs, with the same streams
        restored = m.restore(state={"x": x}, rng=nnx.state(fresh))
    assert isinstance(restored.rng, nnx.State)
    nnx.update(fresh, restored.rng)
    got = [np.asarray(dropped(x, fresh)) for _ in range(2)]
    for a, b in zip(got, expected, strict=True):
        np.testing.assert_array_equal(a, b)
    assert int(fresh.dropout.count.value) == int(rngs.dropout.count.value)

    # Plain trees of keys restore without a target, as before.
    with jaxckpt.CheckpointManager(ckpt_dir) as m:
        m.save(2, state={"x": x}, rng={"data": jax.random.key(3), "pair": [jax.random.key(4)]})
        plain = m.restore(state={"x": x}).rng
    assert jax.random.key_impl(plain["pair"][0]) == jax.random.key_impl(jax.random.key(4))


# --------------------------------------------------------------- data iterators, checked first


def pipeline(batch_size):
    return iter(grain.MapDataset.range(1000).batch(batch_size).to_iter_dataset())


def loader(seed):
    return iter(
        grain.DataLoader(
            data_source=list(range(100)),
            sampler=grain.samplers.IndexSampler(100, shuffle=True, seed=seed, num_epochs=1),
            operations=[grain.transforms.Batch(4)],
            worker_count=0,
        )
    )


@pytest.fixture
def saved_with_data(mesh, ckpt_dir):
    """Step 1 saved with a grain pipeline (batch 32) two batches in, step 2 with a DataLoader
    (seed 1) three batches in; and a reader of a copy whose arrays are gone, where a restore
    that reads an array fails."""
    state = {"w": on_mesh(jnp.ones((4, 8)), mesh)}
    data, batches = pipeline(32), loader(1)
    for _ in range(2):
        next(data)
    for _ in range(3):
        next(batches)
    with jaxckpt.CheckpointManager(ckpt_dir) as m:
        m.save(1, state=state, data=data)
        m.save(2, state=state, data=batches)
    no_arrays = ckpt_dir.parent / "no-arrays"
    shutil.copytree(ckpt_dir, no_arrays)
    for step in (1, 2):
        for arrays in ("state", "packed"):  # Orbax's, and packed small leaves
            shutil.rmtree(no_arrays / str(step) / arrays, ignore_errors=True)
    reader = jaxckpt.CheckpointManager(no_arrays, read_only=True, verify_on_restore=False)
    yield jaxckpt.CheckpointManager(ckpt_dir, read_only=True), reader, state
    reader.close()


def test_another_batch_size_is_refused_before_any_array_is_read(saved_with_data, caplog):
    m, reader, state = saved_with_data
    resumed = pipeline(64)
    with pytest.raises(
        errors.DataStateError,
        match=r"not built like the one saved at step 1:\n  pipeline: "
        r"BatchMapDataset\(batch_size=32, drop_remainder=False\) was saved, "
        r"BatchMapDataset\(batch_size=64, drop_remainder=False\) is given\n.*data_mismatch_ok",
    ):
        reader.restore(1, state=state, data=resumed)  # reading an array would fail here
    assert resumed.get_state() == {"next_index": 0}  # untouched

    # (what reading the arrays of that copy does: Orbax's fail, packed ones are missing)
    with pytest.raises((errors.RestoreError, errors.CorruptCheckpointError)):
        reader.restore(1, state=state, data=pipeline(32))

    same = m.restore(1, state=state, data=pipeline(32)).data
    np.testing.assert_array_equal(next(same), np.arange(64, 96))  # the third batch of 32
    with caplog.at_level("WARNING", logger="jaxckpt"):
        changed = m.restore(1, state=state, data=pipeline(64), data_mismatch_ok=True).data
    assert "batch_size=64" in caplog.text and "data_mismatch_ok=True" in caplog.text
    np.testing.assert_array_equal(next(changed), np.arange(128, 192))  # its own third batch
    m.close()


def test_a_dataloader_state_into_a_dataset_iterator_or_another_seed_is_refused_first(
    saved_with_data,
):
    m, reader, state = saved_with_data
    with pytest.raises(
        errors.DataStateError,
        match=r"type: a grain\..*DataLoaderIterator was saved, a grain\..*"
        r"PrefetchDatasetIterator is given",
    ):
        reader.restore(2, state=state, data=pipeline(4))  # was a raw TypeError
    with pytest.raises(
        errors.DataStateError,
        match=r"sampler: IndexSampler\(.*seed=1\) was saved, IndexSampler\(.*seed=2\) is given",
    ):
        reader.restore(2, state=state, data=loader(2))  # was grain's ValueError, after reading

    expected = loader(1)
    for _ in range(3):
        next(expected)
    resumed = m.restore(2, state=state, data=loader(1)).data
    np.testing.assert_array_equal(next(resumed), next(expected))
    # An explicit opt-in skips jaxckpt's check; grain's own still refuses another seed.
    with pytest.raises(errors.DataStateError, match="the data iterator refused the state"):
        m.restore(2, state=state, data=loader(2), data_mismatch_ok=True)
    m.close()


def test_an_equinox_target_partitioned_by_is_array_is_named_as_holding_no_array(ckpt_dir):
    """`eqx.is_array` is False for a ShapeDtypeStruct: partitioning `eqx.filter_eval_shape`
    by it gives an all-None target, which listed every saved leaf as missing."""
    import equinox as eqx

    def make(key):
        return eqx.nn.MLP(in_size=4, out_size=2, width_size=8, depth=1, key=key)

    params, _ = eqx.partition(make(jax.random.key(0)), eqx.is_array)
    with jaxckpt.CheckpointManager(ckpt_dir) as m:
        m.save(1, state=params)
    target, _ = eqx.partition(eqx.filter_eval_shape(make, jax.random.key(0)), eqx.is_array)
    with (
        jaxckpt.CheckpointManager(ckpt_dir, read_only=True) as m,
        pytest.raises(errors.TreeMismatchError, match=r"the state target holds no arrays.*") as e,
    ):
        m.restore(state=target)
    assert "eqx.is_array is False for a ShapeDtypeStruct" in str(e.value)
    assert "layers.0.weight" not in str(e.value)


class Records:
    """A grain data source without a `__repr__` of its own: grain records it by `repr`,
    `<test_real_clients.Records object at 0x...>`."""

    def __init__(self, n=40):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return np.int64(i * 10)


class OtherRecords(Records):
    pass


def loader_over(source):
    sampler = grain.samplers.IndexSampler(len(source), shuffle=True, seed=3, num_epochs=1)
    return iter(
        grain.DataLoader(data_source=source, sampler=sampler, operations=[], worker_count=0)
    )


def test_a_dataloader_over_a_source_without_repr_resumes(ckpt_dir, caplog):
    """Its address differs in every process, which jaxckpt compared (the docs say it does
    not) and grain's own `set_state` refused: no restore ever worked, data_mismatch_ok=True
    included. Its class is still compared."""
    data, straight = loader_over(Records()), loader_over(Records())
    for _ in range(5):
        next(data), next(straight)
    with jaxckpt.CheckpointManager(ckpt_dir) as m:
        m.save(1, state={"w": np.ones(2, np.float32)}, data=data)
    target = {"w": np.zeros(2, np.float32)}
    with jaxckpt.CheckpointManager(ckpt_dir, read_only=True) as m:
        resumed = m.restore(state=target, data=loader_over(Records())).data
        assert [int(next(resumed)) for _ in range(10)] == [int(next(straight)) for _ in range(10)]
        with pytest.raises(
            errors.DataStateError, match=r"data_source: <test_real_clients\.Records object> was"
        ):
            m.restore(state=target, data=loader_over(OtherRecords()))
        with caplog.at_level("WARNING", logger="jaxckpt"):
            m.restore(state=target)
    assert "step 1 holds each process's data-iterator state, which is not restored" in caplog.text


@one_job_at_a_time
def test_each_process_checks_its_own_pipeline_and_all_agree(tmp_path):
    """Two processes, each reading its shard of the data (`ds[process::2]`): each checks
    its own iterator against its own record, and when one refuses, both do (no process
    waits in a read the other never joins)."""
    results = run_job(
        shared_pipeline.save_then_restore_with_one_pipeline_changed,
        processes=2,
        devices=4,
        args={"dir": str(tmp_path / "ckpt")},
    )
    first, second = (r.report() for r in results)
    assert first["resumed"] == [8, 10, 12, 14] and second["resumed"] == [9, 11, 13, 15]
    assert first["error"].startswith("process(es) [1] refused their data iterator for step 1")
    assert "not built like the one saved at step 1 (process 1)" in second["error"]
    assert "batch_size=8" in second["error"]


def test_iterator_records_on_object_storage_and_damaged_ones(gcs_dir, ckpt_dir):
    for directory in (gcs_dir, ckpt_dir):
        it = pipeline(32)
        next(it)
        with jaxckpt.CheckpointManager(directory) as m:
            m.save(1, state={"x": np.ones(2)}, data=it)
            with pytest.raises(errors.DataStateError, match="batch_size=16"):
                m.restore(data=pipeline(16))
            np.testing.assert_array_equal(
                next(m.restore(data=pipeline(32)).data), np.arange(32, 64)
            )

    # A description that is not what jaxckpt writes is named, and nothing moves.
    (ckpt_dir / "1" / "data" / "iterator_0-of-1.json").write_text('{"type": 5}')
    resumed = pipeline(32)
    with (
        jaxckpt.CheckpointManager(ckpt_dir, read_only=True, verify_on_restore=False) as m,
        pytest.raises(
            errors.CorruptCheckpointError, match=r"data/iterator_0-of-1\.json is not an iterator"
        ),
    ):
        m.restore(data=resumed)
    assert resumed.get_state() == {"next_index": 0}

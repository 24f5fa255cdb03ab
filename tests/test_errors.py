"""Every bad input raises the right `jaxckpt.errors` class with a precise message, and loses
nothing already saved."""

import contextlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from conftest import Iterator
from jaxckpt import errors
from reliability import faults

# ------------------------------------------------------------------------------- helpers


def make_state(mesh, scale):
    return {
        "params": {
            "w1": jax.device_put(
                jnp.arange(64, dtype=jnp.float32).reshape(8, 8) * scale,
                NamedSharding(mesh, P("data", "model")),
            ),
            "w2": jax.device_put(
                jnp.arange(16, dtype=jnp.bfloat16) * scale, NamedSharding(mesh, P("data"))
            ),
        },
        "step": int(scale),
    }


def assert_equal_trees(actual, expected):
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        a, e = np.asarray(a), np.asarray(e)
        assert a.dtype == e.dtype and a.shape == e.shape
        np.testing.assert_array_equal(a, e)


STEPS = (1, 2, 5)


@pytest.fixture
def saved(mesh, ckpt_dir):
    """A manager holding steps 1, 2 and 5 (step 5 with data and rng), and a check that they are
    all still intact (through this manager and a fresh one)."""
    m = jaxckpt.CheckpointManager(ckpt_dir)
    for step in STEPS:
        extra = {"data": Iterator(step), "rng": jax.random.key(step)} if step == 5 else {}
        m.save(step, state=make_state(mesh, step), meta={"step": step}, **extra)
    m.wait()

    def intact(manager=None):
        managers = [manager or m, jaxckpt.CheckpointManager(ckpt_dir, read_only=True)]
        try:
            for mngr in managers:
                assert mngr.all_steps() == list(STEPS)
                for step in STEPS:
                    expected = make_state(mesh, step)
                    restored = mngr.restore(step, state=jaxckpt.target_like(expected))
                    assert restored.step == step and restored.meta == {"step": step}
                    assert_equal_trees(restored.state, expected)
                it = mngr.restore(5, data=Iterator()).data
                assert it.position == 5
        finally:
            managers[1].close()

    yield m, intact
    m.close()


def listing(directory):
    return sorted(p.name for p in directory.iterdir())


# ------------------------------------------------------------------------------- steps


def test_restore_from_an_empty_directory(ckpt_dir):
    with jaxckpt.CheckpointManager(ckpt_dir) as m:
        with pytest.raises(errors.NoCheckpointError, match=r"no committed checkpoint in .*ckpt"):
            m.restore()
        with pytest.raises(FileNotFoundError):  # also a FileNotFoundError
            m.restore(state={"x": np.zeros(2)})
        with pytest.raises(
            errors.StepNotFoundError, match=r"step 3 is not .* available steps: none"
        ):
            m.restore(3)
        assert m.latest_step() is None and m.all_steps() == []


def test_restore_a_step_that_does_not_exist(saved, ckpt_dir):
    m, intact = saved
    pattern = (
        rf"step 3 is not a committed checkpoint in {re.escape(str(ckpt_dir))}; "
        r"available steps: 1, 2, 5\. Pass one of them, or step=None for the latest\."
    )
    with pytest.raises(errors.StepNotFoundError, match=pattern) as info:
        m.restore(3)
    assert info.value.step == 3 and info.value.available == [1, 2, 5]
    assert isinstance(info.value, KeyError)
    assert str(info.value).startswith("step 3")  # not quoted like a plain KeyError
    with pytest.raises(errors.StepNotFoundError, match=r"step 6 .* 1, 2, 5"):
        m.restore(6)
    intact()


def test_step_not_found_lists_many_steps_briefly(ckpt_dir):
    with jaxckpt.CheckpointManager(ckpt_dir) as m:
        for step in range(20):
            m.save(step, state={"x": np.zeros(1)})
        m.wait()
        with pytest.raises(
            errors.StepNotFoundError, match=r"available steps: 0, 1, 2, 3, 4, \.\.\., 15, 16"
        ):
            m.restore(100)


def test_saving_an_existing_step_keeps_the_original(saved, mesh):
    m, intact = saved
    with pytest.raises(
        errors.StepExistsError, match=r"step 2 already exists in .*never overwrites"
    ):
        m.save(2, state=make_state(mesh, 99), meta={"step": 99})
    intact()


def test_saving_an_existing_step_while_it_is_still_being_written(mesh, ckpt_dir):
    with jaxckpt.CheckpointManager(ckpt_dir) as m:
        m.save(4, state=make_state(mesh, 4), meta={"v": "first"})
        # No wait(): the first save may still be in flight.
        with pytest.raises(errors.StepExistsError, match=r"step 4 already exists"):
            m.save(4, state=make_state(mesh, 7), meta={"v": "second"})
        m.wait()
        assert m.all_steps() == [4]
        restored = m.restore(state=jaxckpt.target_like(make_state(mesh, 4)))
    assert restored.meta == {"v": "first"}
    assert_equal_trees(restored.state, make_state(mesh, 4))


def test_saving_an_existing_step_from_a_new_manager(saved, mesh, ckpt_dir):
    first, intact = saved
    first.close()  # one writer per directory: the new one takes over
    with jaxckpt.CheckpointManager(ckpt_dir) as m:
        with pytest.raises(errors.StepExistsError, match=r"step 5 already exists"):
            m.save(5, state=make_state(mesh, 0))
        intact(m)


@pytest.mark.parametrize("foreign", ["hand-made", "orbax-only"])
def test_saving_over_a_step_folder_jaxckpt_did_not_write(saved, mesh, ckpt_dir, foreign):
    # A folder named like a step but written by someone else is never replaced: saving that
    # step is refused with jaxckpt's own error, and the folder is left as it was. A step
    # plain Orbax wrote is listed (and read) as one; a hand-made folder is not.
    m, intact = saved
    step_dir = ckpt_dir / "7"
    if foreign == "hand-made":
        step_dir.mkdir()
        (step_dir / "notes.txt").write_text("mine")
    else:
        import orbax.checkpoint as ocp

        with ocp.CheckpointManager(ckpt_dir, item_names=("state",)) as o:
            o.save(7, args=ocp.args.Composite(state=ocp.args.StandardSave({"a": np.ones(3)})))
    before = sorted(str(p.relative_to(step_dir)) for p in step_dir.rglob("*"))
    assert m.all_steps() == list(STEPS) + [7] * (foreign == "orbax-only")

    with pytest.raises(errors.StepExistsError, match=r"step 7"):
        m.save(7, state=make_state(mesh, 7))
    m.wait()
    assert sorted(str(p.relative_to(step_dir)) for p in step_dir.rglob("*")) == before
    if foreign == "hand-made":
        intact()


# ------------------------------------------------------------------------------- targets


def test_target_missing_a_saved_leaf(saved, mesh):
    m, intact = saved
    target = jaxckpt.target_like(make_state(mesh, 1))
    del target["params"]["w2"]
    it = Iterator(42)
    with pytest.raises(
        errors.TreeMismatchError,
        match=r"state target does not match the state saved at step 5:\n"
        r"  in the checkpoint but not in the target: params\.w2\n",
    ) as info:
        m.restore(state=target, data=it)
    assert "in the target but not in the checkpoint" not in str(info.value)
    assert it.position == 42  # the iterator is only moved after everything else succeeded
    intact()


def test_target_with_an_extra_leaf(saved, mesh):
    m, intact = saved
    target = jaxckpt.target_like(make_state(mesh, 1))
    target["params"]["w3"] = target["params"]["w1"]
    target["opt"] = [target["params"]["w1"]]
    with pytest.raises(
        errors.TreeMismatchError,
        match=r"in the target but not in the checkpoint: opt\.0, params\.w3"
        r"|in the target but not in the checkpoint: params\.w3, opt\.0",
    ) as info:
        m.restore(2, state=target)
    assert "at step 2" in str(info.value)
    assert "in the checkpoint but not in the target" not in str(info.value)
    intact()


def test_target_missing_and_extra_leaves_together(saved, mesh):
    m, intact = saved
    target = jaxckpt.target_like(make_state(mesh, 1))
    target["params"]["w3"] = target["params"].pop("w2")
    with pytest.raises(errors.TreeMismatchError) as info:
        m.restore(1, state=target)
    message = str(info.value)
    assert re.search(r"in the target but not in the checkpoint: params\.w3", message)
    assert re.search(r"in the checkpoint but not in the target: params\.w2", message)
    intact()


def test_rng_target_for_a_step_saved_without_rng(saved):
    m, intact = saved
    with pytest.raises(errors.TreeMismatchError, match=r"step 2 holds no PRNG keys.*rng="):
        m.restore(2, rng=jax.random.key(0))
    intact()


def test_shape_mismatch(saved, mesh):
    m, intact = saved
    target = jaxckpt.target_like(make_state(mesh, 1))
    target["params"]["w1"] = jax.ShapeDtypeStruct(
        (4, 8), jnp.float32, sharding=NamedSharding(mesh, P("data", "model"))
    )
    with pytest.raises(
        errors.LeafMismatchError,
        match=r"state target differs from the state saved at step 5:\n"
        r"  leaf params\.w1: shape \(4, 8\) dtype float32 in the target "
        r"but shape \(8, 8\) dtype float32 in the checkpoint",
    ):
        m.restore(state=target)
    intact()


def test_dtype_mismatch(saved, mesh):
    m, intact = saved
    target = jaxckpt.target_like(make_state(mesh, 1))
    target["params"]["w2"] = jnp.zeros(16, jnp.float32)  # a live array of another dtype
    with pytest.raises(
        errors.LeafMismatchError,
        match=r"leaf params\.w2: shape \(16,\) dtype float32 in the target "
        r"but shape \(16,\) dtype bfloat16 in the checkpoint",
    ):
        m.restore(1, state=target)
    intact()


def test_several_leaf_mismatches_are_all_reported(saved, mesh):
    m, intact = saved
    target = jaxckpt.target_like(make_state(mesh, 1))
    target["params"]["w1"] = np.zeros((8, 8), np.int32)
    target["params"]["w2"] = np.zeros((15,), jnp.bfloat16)
    target["step"] = 1.5  # a Python float where an int was saved
    with pytest.raises(errors.LeafMismatchError) as info:
        m.restore(2, state=target)
    message = str(info.value)
    assert re.search(
        r"leaf params\.w1: shape \(8, 8\) dtype int32 in the target but "
        r"shape \(8, 8\) dtype float32 in the checkpoint",
        message,
    )
    assert re.search(
        r"leaf params\.w2: shape \(15,\) dtype bfloat16 in the target but "
        r"shape \(16,\) dtype bfloat16 in the checkpoint",
        message,
    )
    assert re.search(
        r"leaf step: a Python float in the target but shape \(\) dtype int64 in the checkpoint",
        message,
    )
    intact()


def test_key_target_of_another_impl(mesh, ckpt_dir):
    with jaxckpt.CheckpointManager(ckpt_dir) as m:
        m.save(1, state={"x": np.zeros(1)}, rng={"k": jax.random.key(0, impl="rbg")})
        m.wait()
        with pytest.raises(
            errors.LeafMismatchError,
            match=r"leaf k: shape \(\) dtype key<fry> in the target "
            r"but shape \(\) dtype key<rbg> in the checkpoint",
        ):
            m.restore(rng={"k": jax.random.key(1)})
        restored = m.restore(rng={"k": jax.random.key(1, impl="rbg")})
    np.testing.assert_array_equal(
        jax.random.key_data(restored.rng["k"]),
        jax.random.key_data(jax.random.key(0, impl="rbg")),
    )


def test_shape_dtype_struct_without_sharding(saved, mesh):
    m, intact = saved
    target = jaxckpt.target_like(make_state(mesh, 1))
    target["params"]["w2"] = jax.ShapeDtypeStruct((16,), jnp.bfloat16)
    with pytest.raises(
        errors.MissingShardingError,
        match=r"state target leaves have no sharding.*: params\.w2\. "
        r"Build the target with jaxckpt\.target_on_mesh",
    ):
        m.restore(state=target)
    all_unsharded = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if hasattr(x, "sharding") else x,
        jaxckpt.target_like(make_state(mesh, 1)),
    )
    with pytest.raises(errors.MissingShardingError, match=r"params\.w1, params\.w2"):
        m.restore(1, state=all_unsharded)
    intact()


# ------------------------------------------------------------------------------- meta


def _fn():
    return 1


@pytest.mark.parametrize(
    ("meta", "pattern"),
    [
        (
            {"config": {"lr": 1e-3, "fn": _fn}},
            r"meta\['config'\]\['fn'\] is a builtins\.function \(<function _fn",
        ),
        (
            {"config": {"fn": lambda: 0}},
            r"meta\['config'\]\['fn'\] is a builtins\.function",
        ),
        (
            {"metrics": {"loss": np.float32(0.5)}},
            r"meta\['metrics'\]\['loss'\] is a numpy\.float32 .*\.item\(\) for a NumPy scalar",
        ),
        ({"config": {1: "a"}}, r"meta\['config'\] has the key 1 of type int; JSON object keys"),
        ({"config": {("a", "b"): 1}}, r"meta\['config'\] has the key \('a', 'b'\) of type tuple"),
        ({"array": np.zeros(3)}, r"meta\['array'\] is a numpy\.ndarray .*keep arrays in state="),
        ({"path": {1, 2}}, r"meta\['path'\] is a builtins\.set"),
    ],
    ids=[
        "function",
        "lambda",
        "numpy-scalar",
        "int-key",
        "tuple-key",
        "array",
        "set",
    ],
)
def test_non_json_meta_is_rejected_by_save(saved, mesh, ckpt_dir, meta, pattern):
    m, intact = saved
    before = listing(ckpt_dir)
    with pytest.raises(errors.UnsupportedValueError, match=pattern):
        m.save(9, state=make_state(mesh, 9), meta=meta)
    m.wait()  # nothing was started in the background either
    assert listing(ckpt_dir) == before
    assert 9 not in m.all_steps()
    intact()
    # The step number is still free.
    m.save(9, state={"x": np.zeros(1)}, meta={"ok": True})
    m.wait()
    assert m.all_steps() == [*STEPS, 9]


# ------------------------------------------------------------------------------- leaves


class Opaque:
    pass


@pytest.mark.parametrize(
    ("state", "pattern"),
    [
        (
            {"params": {"w": np.zeros(2)}, "cfg": {"name": "run"}},
            r"state leaf cfg\.name is a builtins\.str .*which jaxckpt cannot save",
        ),
        (
            {"layers": [np.zeros(2), Opaque()]},
            r"state leaf layers\.1 is a .*Opaque .*which jaxckpt cannot save",
        ),
        ({"z": 1 + 2j}, r"state leaf z is a builtins\.complex"),
        (
            {"objs": np.array([object()], dtype=object)},
            r"state leaf objs is a numpy\.ndarray",
        ),
        (
            {"a.b": np.zeros(1), "a": {"b": np.ones(1)}},
            r"both map to the stored name 'a\.b'",
        ),
    ],
    ids=["string", "object", "complex", "object-array", "name-clash"],
)
def test_unsupported_state_leaf(saved, ckpt_dir, state, pattern):
    m, intact = saved
    before = listing(ckpt_dir)
    with pytest.raises(errors.UnsupportedValueError, match=pattern):
        m.save(9, state=state)
    m.wait()
    assert listing(ckpt_dir) == before
    intact()


def test_unsupported_rng_leaf(saved, ckpt_dir):
    m, intact = saved
    with pytest.raises(errors.UnsupportedValueError, match=r"rng leaf seed is a builtins\.str"):
        m.save(9, state={"x": np.zeros(1)}, rng={"seed": "42"})
    intact()


def test_python_int_too_large_for_any_integer_dtype(ckpt_dir):
    # 2**70 fits no NumPy integer dtype: it must be refused by save itself, by leaf path,
    # like any other value jaxckpt cannot store, not fail later in the background.
    with jaxckpt.CheckpointManager(ckpt_dir) as m:
        m.save(1, state={"x": np.ones(2)})
        m.wait()
        try:
            with pytest.raises(errors.UnsupportedValueError, match=r"state leaf big "):
                m.save(2, state={"x": np.ones(2), "big": 2**70})
        finally:
            with contextlib.suppress(errors.SaveError):  # what save should have refused
                m.wait()
        assert m.all_steps() == [1]
        assert listing(ckpt_dir) == [".jaxckpt-writer.lock", "1"]
        np.testing.assert_array_equal(m.restore(1).state["x"], np.ones(2))


# ------------------------------------------------------------------------------- data


def test_data_without_get_state(saved, ckpt_dir):
    m, intact = saved
    before = listing(ckpt_dir)
    with pytest.raises(
        errors.DataStateError, match=r"data= takes an iterator with get_state\(\).*got a list"
    ):
        m.save(9, state={"x": np.zeros(1)}, data=[1, 2, 3])
    with pytest.raises(errors.DataStateError, match=r"got a list_iterator"):
        m.save(9, state={"x": np.zeros(1)}, data=iter([1, 2, 3]))
    m.wait()
    assert listing(ckpt_dir) == before
    intact()


def test_data_state_that_cannot_be_stored(saved, ckpt_dir):
    m, intact = saved

    class BadBytes(Iterator):
        def get_state(self):
            return b"\xff\xfe"

    class BadJson(Iterator):
        def get_state(self):
            return {"rng": np.uint32(3)}

    with pytest.raises(errors.DataStateError, match=r"bytes that are not UTF-8"):
        m.save(9, state={"x": np.zeros(1)}, data=BadBytes())
    with pytest.raises(errors.UnsupportedValueError, match=r"data\.get_state\(\)\['rng'\]"):
        m.save(9, state={"x": np.zeros(1)}, data=BadJson())
    m.wait()
    assert 9 not in m.all_steps()
    intact()


def test_restore_data_from_a_step_saved_without_data(saved):
    m, intact = saved
    it = Iterator(7)
    with pytest.raises(
        errors.DataStateError,
        match=r"step 2 holds no data-iterator state \(it was saved without data=\)",
    ):
        m.restore(2, data=it)
    assert it.position == 7
    intact()


def test_restore_data_into_an_object_without_set_state(saved):
    m, intact = saved
    with pytest.raises(errors.DataStateError, match=r"set_state\(\); got a dict"):
        m.restore(5, data={"position": 0})
    intact()


# ------------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    ("make", "pattern"),
    [
        (lambda: jaxckpt.SavePolicy(every_steps=0), r"SavePolicy\.every_steps must be positive"),
        (lambda: jaxckpt.SavePolicy(every_steps=-5), r"every_steps .* got -5"),
        (lambda: jaxckpt.SavePolicy(every_seconds=0.0), r"SavePolicy\.every_seconds .* got 0\.0"),
        (lambda: jaxckpt.SavePolicy(every_seconds=-1), r"every_seconds"),
        (
            lambda: jaxckpt.RetentionPolicy(keep_last=-1),
            r"RetentionPolicy\.keep_last must be positive or None, got -1",
        ),
        (lambda: jaxckpt.RetentionPolicy(keep_last=0), r"RetentionPolicy\.keep_last .* got 0"),
        (lambda: jaxckpt.RetentionPolicy(keep_every=0), r"RetentionPolicy\.keep_every .* got 0"),
    ],
    ids=[
        "every_steps=0",
        "every_steps<0",
        "every_seconds=0",
        "every_seconds<0",
        "keep_last<0",
        "keep_last=0",
        "keep_every=0",
    ],
)
def test_bad_policy_values(make, pattern):
    with pytest.raises(errors.ConfigError, match=pattern) as info:
        make()
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("lease", [0, -5, "60", 8 * 24 * 3600.0])  # (a week at most)
def test_bad_writer_lease(ckpt_dir, lease):
    with pytest.raises(errors.ConfigError, match=r"writer_lease_s must be a number of seconds"):
        jaxckpt.CheckpointManager(ckpt_dir, writer_lease_s=lease)
    assert not ckpt_dir.exists()  # refused before anything was made


def test_the_storage_seams_are_not_arguments(ckpt_dir):
    # what a test or a fault harness puts in (`reliability.faults.manager`), not an option
    with pytest.raises(TypeError, match="unexpected keyword argument 'store'"):
        jaxckpt.CheckpointManager(ckpt_dir, store=faults.store())
    assert not ckpt_dir.exists()


def test_unknown_compression(ckpt_dir):
    with pytest.raises(errors.ConfigError, match=r'compression must be None or "zstd", got .lz4'):
        jaxckpt.CheckpointManager(ckpt_dir, compression="lz4")
    assert not ckpt_dir.exists()  # refused before anything was made


def test_policies_of_the_wrong_type(ckpt_dir):
    with pytest.raises(errors.ConfigError, match=r"policy must be a jaxckpt\.SavePolicy"):
        jaxckpt.CheckpointManager(ckpt_dir, policy=10)
    with pytest.raises(errors.ConfigError, match=r"retention must be a jaxckpt\.RetentionPolicy"):
        jaxckpt.CheckpointManager(ckpt_dir, retention={"keep_last": 2})


@pytest.mark.parametrize(
    ("step", "pattern"),
    [
        (-1, r"step must be a non-negative int, got -1"),
        (True, r"step must be a non-negative int, got True"),
        (1.0, r"step must be an int, got float 1\.0"),
        ("3", r"step must be an int, got str '3'"),
    ],
)
def test_bad_step_numbers(saved, step, pattern):
    m, intact = saved
    with pytest.raises(errors.ConfigError, match=pattern):
        m.save(step, state={"x": np.zeros(1)})
    with pytest.raises(errors.ConfigError, match=pattern):
        m.restore(step)
    with pytest.raises(errors.ConfigError, match=pattern):
        m.should_save(step)
    intact()


def test_numpy_integer_steps_are_accepted(ckpt_dir):
    with jaxckpt.CheckpointManager(ckpt_dir) as m:
        m.save(np.int64(3), state={"x": np.zeros(1)})
        m.wait()
        assert m.all_steps() == [3]
        assert m.restore(np.int32(3)).step == 3


def test_a_closed_manager_refuses_work(saved, mesh, ckpt_dir):
    m, intact = saved
    m.close()
    m.close()  # closing twice is fine
    with pytest.raises(errors.ConfigError, match=r"closed; create a new one"):
        m.save(9, state=make_state(mesh, 9))
    with pytest.raises(errors.ConfigError, match=r"closed"):
        m.restore()
    with pytest.raises(errors.ConfigError, match=r"closed"):
        m.wait()
    with jaxckpt.CheckpointManager(ckpt_dir) as fresh:
        intact(fresh)


def test_the_context_manager_closes(ckpt_dir):
    with jaxckpt.CheckpointManager(ckpt_dir) as m:
        m.save(1, state={"x": np.zeros(1)})
    with pytest.raises(errors.ConfigError, match=r"closed"):
        m.save(2, state={"x": np.zeros(1)})
    with jaxckpt.CheckpointManager(ckpt_dir) as m:  # the pending save was committed on exit
        assert m.all_steps() == [1]


def test_every_error_is_a_jaxckpt_error():
    import inspect

    defined = [
        c
        for _, c in inspect.getmembers(errors, inspect.isclass)
        if issubclass(c, BaseException) and c.__module__ == errors.__name__
    ]
    assert len(defined) >= 17, defined  # the module as written: none skipped by the walk
    for error in defined:
        assert issubclass(error, errors.JaxckptError), error.__name__

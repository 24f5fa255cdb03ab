"""The way back to plain Orbax (docs/from-orbax.md, "Going back after switching"), with the
trees users have: optax states full of nodes without children (EmptyState, MaskedNode), empty
dicts, lists and tuples, None, Flax and Equinox containers without fields. A step saved by
jaxckpt is exported through the CLI exactly as the page shows, and restored by the real
plain Orbax onto the live state (bitwise) and without a target (as Orbax restores a
checkpoint it wrote itself of the same tree)."""

import dataclasses
import json
import logging
from typing import NamedTuple

import equinox as eqx
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from click.testing import CliRunner
from flax import nnx
from flax.core import FrozenDict
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from jaxckpt import _integrity
from jaxckpt.cli import main
from jaxckpt.errors import CorruptCheckpointError

STEP = 8


def cli(*args):
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exit_code == 0 and "Traceback" not in result.output, result.output
    return result


def export_as_documented(run, back, step=STEP):
    """`jaxckpt export /ckpt/run /ckpt/run-orbax/<step>/default --format orbax --step <step>`"""
    cli("export", run, back / str(step) / "default", "--format", "orbax", "--step", step)


def orbax_restore(directory, target=None, step=STEP):
    """What the old loop does: plain Orbax's manager, StandardRestore (of `target`)."""
    with ocp.CheckpointManager(directory) as m:
        return m.restore(step, args=ocp.args.StandardRestore(target))


def orbax_save(directory, state, step=STEP):
    with ocp.CheckpointManager(directory) as m:
        m.save(step, args=ocp.args.StandardSave(state))


def assert_bitwise(restored, state):
    assert jax.tree.structure(restored) == jax.tree.structure(state)
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True):
        assert np.asarray(got).dtype == np.asarray(want).dtype
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), strict=True)


def trained(optimizer, mesh):
    """A training state after one update: parameters on `mesh`, the optimizer's state with
    every node its init makes (optax's count and the step on one device, as optax makes them)."""
    sharded = NamedSharding(mesh, P("data", "model"))
    params = {
        "dense": {
            "kernel": jax.device_put(jnp.arange(64.0).reshape(8, 8) / 7, sharded),
            "bias": jnp.linspace(-1.0, 1.0, 8),
        },
        "embed": jax.device_put(jnp.ones((8, 4), jnp.bfloat16), NamedSharding(mesh, P("data"))),
    }
    opt_state = optimizer.init(params)
    grads = jax.tree.map(lambda p: jnp.full_like(p, 0.25), params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return {"params": optax.apply_updates(params, updates), "opt_state": opt_state, "step": 1}


def mask(params):
    return {"dense": {"kernel": True, "bias": False}, "embed": False}


OPTIMIZERS = {
    "adamw": lambda: optax.adamw(1e-3),
    "chain-clip-adamw": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)),
    "masked": lambda: optax.chain(optax.masked(optax.adamw(1e-3), mask), optax.sgd(1e-2)),
    "multi-transform": lambda: optax.multi_transform(
        {"train": optax.adam(1e-3), "frozen": optax.set_to_zero()},
        lambda params: jax.tree.map(lambda m: "train" if m else "frozen", mask(params)),
    ),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_the_documented_way_back_restores_the_live_optax_state(name, mesh, tmp_path):
    state = trained(OPTIMIZERS[name](), mesh)
    childless = lambda x: isinstance(x, tuple) and not x  # noqa: E731
    empty = [n for n in jax.tree.leaves(state, is_leaf=childless) if childless(n)]
    assert empty, "the state holds optax's nodes without children (EmptyState, MaskedNode)"
    run, back = tmp_path / "run", tmp_path / "run-orbax"
    with jaxckpt.CheckpointManager(run) as m:
        m.save(STEP, state=state)

    export_as_documented(run, back)

    restored = orbax_restore(back, state)  # the live state, as the old loop has it
    assert_bitwise(restored, state)
    kernel = state["params"]["dense"]["kernel"]
    assert restored["params"]["dense"]["kernel"].sharding == kernel.sharding  # onto the live one


class Empty(NamedTuple):
    pass


@flax.struct.dataclass
class NoFields:
    pass


class NoFieldsModule(eqx.Module):
    pass


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Registered:
    pass


class Pair:
    """A node registered without keys (its children's paths are FlattenedIndexKeys)."""

    def __init__(self, a, b):
        self.a, self.b = a, b


jax.tree_util.register_pytree_node(Pair, lambda p: ((p.a, p.b), None), lambda _, c: Pair(*c))


def every_empty_node():
    """A state holding each kind of node without children that users' trees have."""
    params = {"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.ones(3, jnp.int32)}
    optimizer = optax.chain(
        optax.clip_by_global_norm(1.0), optax.masked(optax.adamw(0.1), {"w": True, "b": False})
    )
    return {
        "params": params,
        "opt_state": optimizer.init(params),
        "dict": {},
        "list": [],
        "tuple": (),
        "none": None,
        "named_tuple": Empty(),
        "flax_struct": NoFields(),
        "equinox": NoFieldsModule(),
        "dataclass": Registered(),
        "nnx_state": nnx.State({}),
        "frozen_dict": FrozenDict({}),
        "nested": {"a": {"b": {}}, "c": [[], (), None, jnp.zeros(2)]},
        "unkeyed": [Pair(jnp.ones(2), {}), Pair(None, jnp.zeros(3))],
    }


def tree_metadata(item_dir):
    """Of an Orbax pytree item's _METADATA, each entry: its keys with their key types, and
    its value type."""
    entries = json.loads((item_dir / "_METADATA").read_text())["tree_metadata"]
    return {
        path: (
            [(k["key"], k["key_type"]) for k in entry["key_metadata"]],
            entry["value_metadata"]["value_type"],
        )
        for path, entry in entries.items()
    }


def test_every_empty_node_is_exported_as_plain_orbax_writes_it(tmp_path):
    state = every_empty_node()
    run, back, plain = tmp_path / "run", tmp_path / "run-orbax", tmp_path / "plain"
    with jaxckpt.CheckpointManager(run) as m:
        m.save(STEP, state=state)
    export_as_documented(run, back)
    orbax_save(plain, state)

    exported = tree_metadata(back / str(STEP) / "default")
    written = tree_metadata(plain / str(STEP) / "default")
    assert exported.keys() == written.keys()
    for path, (keys, kind) in written.items():
        # the arrays are read to the host: NumPy arrays where Orbax had jax.Arrays
        expected = "np.ndarray" if kind == "jax.Array" else kind
        assert exported[path] == (keys, expected), path
    assert written["('opt_state', '0')"][1] == "None"  # (optax's EmptyState)

    assert_bitwise(orbax_restore(back, state), state)
    # Without a target: what plain Orbax restores of the checkpoint it wrote itself.
    bare, bare_plain = orbax_restore(back), orbax_restore(plain)
    assert_bitwise(bare, jax.tree.map(np.asarray, bare_plain))
    assert bare["opt_state"][0] is None and bare["nested"]["c"][:3] == [[], (), None]
    # ... and so does jaxckpt's own restore without a target.
    with jaxckpt.open(run) as ckpt:
        assert_bitwise(ckpt.read(STEP).state, jax.tree.map(np.asarray, bare_plain))


def test_a_step_saved_before_empty_nodes_were_recorded_exports_as_before(tmp_path, mesh, caplog):
    """A step of an earlier jaxckpt has no record of its empty nodes: the CLI exports it as
    it did (nested dicts and lists of the leaves alone), saying so; a target writes them."""
    state = trained(optax.adamw(1e-3), mesh)
    run, back = tmp_path / "run", tmp_path / "run-orbax"
    with jaxckpt.CheckpointManager(run) as m:
        m.save(STEP, state=state)
    step_dir = run / str(STEP)
    doc = json.loads((step_dir / "jaxckpt/jaxckpt.json").read_text())
    assert doc["empty"]["state"] and doc["empty"]["rng"] == []
    del doc["empty"]  # as earlier jaxckpt wrote it
    (step_dir / "jaxckpt/jaxckpt.json").write_text(json.dumps(doc))
    _integrity.write_manifest(step_dir)

    with caplog.at_level(logging.WARNING, logger="jaxckpt"):
        export_as_documented(run, back)
    assert "saved before jaxckpt recorded a tree's empty nodes" in caplog.text
    adam = state["opt_state"][0]
    as_before = dict(state, opt_state=[adam._asdict()])  # EmptyStates and their places gone
    assert_bitwise(orbax_restore(back, as_before), as_before)

    # Its way back: the export with a target, which has every node.
    target = jax.tree.map(lambda x: x, state)
    out = tmp_path / "with-target" / str(STEP) / "default"
    assert jaxckpt.export_orbax(run, out, step=STEP, state=target) == STEP
    assert_bitwise(orbax_restore(out.parent.parent, state), state)


@pytest.mark.parametrize(
    "empty, match",
    [
        ({"state": [{"path": [], "kind": "none"}]}, "'empty.state': an empty node's path"),
        ({"state": [{"path": [["dict", "x"]], "kind": "set"}]}, "kind 'set' is not one of"),
        ({"state": {}}, "'empty.state' is not a list"),
        ({"other": []}, "'empty' is not an object"),
        ([], "'empty' is not an object"),
    ],
)
def test_a_hostile_empty_record_is_a_corrupt_checkpoint(tmp_path, empty, match):
    run = tmp_path / "run"
    with jaxckpt.CheckpointManager(run) as m:
        m.save(STEP, state={"w": np.ones(3), "e": None})
    path = run / str(STEP) / "jaxckpt/jaxckpt.json"
    path.write_text(json.dumps(dict(json.loads(path.read_text()), empty=empty)))
    _integrity.write_manifest(run / str(STEP))
    with jaxckpt.open(run) as ckpt, pytest.raises(CorruptCheckpointError, match=match):
        ckpt.read(STEP)


def test_an_empty_node_recorded_where_a_leaf_is_is_left_out(tmp_path, caplog):
    run = tmp_path / "run"
    with jaxckpt.CheckpointManager(run) as m:
        m.save(STEP, state={"w": np.ones(3), "e": [None, np.zeros(2)]})
    path = run / str(STEP) / "jaxckpt/jaxckpt.json"
    doc = json.loads(path.read_text())
    assert doc["empty"]["state"] == [{"path": [["dict", "e"], ["seq", 0]], "kind": "none"}]
    doc["empty"]["state"] += [
        {"path": [["dict", "w"]], "kind": "dict"},  # where a leaf is
        {"path": [["dict", "w"], ["dict", "x"]], "kind": "list"},  # under it
    ]
    path.write_text(json.dumps(doc))
    _integrity.write_manifest(run / str(STEP))
    with caplog.at_level(logging.WARNING, logger="jaxckpt"), jaxckpt.open(run) as ckpt:
        restored = ckpt.read(STEP).state
    assert_bitwise(restored, {"w": np.ones(3), "e": [None, np.zeros(2)]})
    assert caplog.text.count("is recorded where a leaf is: left out") == 2


def test_a_step_plain_orbax_wrote_exports_with_its_empty_nodes(tmp_path, mesh):
    """An Orbax step read by jaxckpt (a run switched in place) goes back the same way: its
    empty nodes are in Orbax's own metadata."""
    state = trained(optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)), mesh)
    run, back = tmp_path / "run", tmp_path / "run-orbax"
    orbax_save(run, state)
    export_as_documented(run, back)
    assert_bitwise(orbax_restore(back, state), state)
    assert tree_metadata(back / str(STEP) / "default").keys() == (
        tree_metadata(run / str(STEP) / "default").keys()
    )


def test_zero_size_leaves_are_refused_by_name_before_anything_is_written(tmp_path):
    # Before: Orbax's ValueError "Cannot save arrays with zero size" as a traceback, and
    # `.<out>.jaxckpt-new.orbax-checkpoint-tmp` left beside the output
    state = {"w": jnp.ones((4, 4)), "empty": {"rows": jnp.zeros((0, 8))}}
    with jaxckpt.CheckpointManager(tmp_path / "run") as m:
        m.save(STEP, state=state)
    out = tmp_path / "exports" / "orbax"
    out.parent.mkdir()
    result = CliRunner().invoke(
        main, ["export", str(tmp_path / "run"), str(out), "--format", "orbax"]
    )
    assert result.exit_code == 1 and "Traceback" not in result.output
    (line,) = result.output.strip().splitlines()
    assert "empty.rows (0, 8)" in line and "plain Orbax cannot save" in line
    assert list(out.parent.iterdir()) == []
    with pytest.raises(jaxckpt.errors.UnsupportedValueError, match=r"empty\.rows \(0, 8\)"):
        jaxckpt.export_orbax(tmp_path / "run", out)
    assert list(out.parent.iterdir()) == []

"""Checkpoints plain Orbax wrote, opened as users have them: every layout is written here by
the real orbax-checkpoint (sharded on 8 CPU devices), then listed, inspected, exported,
restored onto other meshes, and continued in place by jaxckpt, and read back by Orbax."""

import json
import os
import re
import shutil
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
import safetensors.numpy
from children import orbax_written
from click.testing import CliRunner
from etils import epath
from jax.sharding import PartitionSpec as P
from multihost import one_job_at_a_time, run_job

import jaxckpt
from conftest import REPO
from jaxckpt.cli import main
from jaxckpt.errors import ConfigError, NoCheckpointError, StepExistsError
from reliability import faults

STEP, KERNEL = orbax_written.STEP, orbax_written.KERNEL
train_state, target_on = orbax_written.train_state, orbax_written.target_on
check_restored = orbax_written.check_restored


def maxtext(directory, state):
    orbax_written.save_maxtext(directory, state)
    return directory


def single_item(directory, state, **options):
    """`ocp.CheckpointManager(dir).save(step, args=StandardSave(state))`: <step>/default."""
    with ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(**options)) as m:
        m.save(STEP, args=ocp.args.StandardSave(state))
    return directory


def layout_of(use_ocdbt, use_zarr3):
    def write(directory, state):
        handler = ocp.PyTreeCheckpointHandler(use_ocdbt=use_ocdbt, use_zarr3=use_zarr3)
        with ocp.CheckpointManager(directory, item_handlers=handler) as m:
            m.save(STEP, args=ocp.args.PyTreeSave(state))
        return directory

    return write


def without_commit_files(directory, state):
    """As older Orbax releases left a step: no _CHECKPOINT_METADATA, no commit_success.txt."""
    single_item(directory, state)
    for name in ("_CHECKPOINT_METADATA", "commit_success.txt"):
        for found in directory.rglob(name):
            found.unlink()
    return directory


def flax_checkpoints(multiprocess):
    """`flax.training.checkpoints` (Flax's imagenet, wmt and lm1b examples):
    `<workdir>/checkpoint_<step>/`, each one Orbax pytree."""

    def write(directory, state):
        from flax.training import checkpoints

        save = (
            checkpoints.save_checkpoint_multiprocess
            if multiprocess
            else checkpoints.save_checkpoint
        )
        save(directory, state, step=STEP, keep=3)
        return directory

    return write


def bare(directory, state):
    """`ocp.StandardCheckpointer().save(path, state)`: no step folders at all."""
    with ocp.StandardCheckpointer() as c:
        c.save(directory, state)
    return directory


LAYOUTS = {
    "maxtext": maxtext,
    "default": single_item,
    "prefixed": lambda d, s: single_item(d, s, step_prefix="ckpt", step_format_fixed_length=8),
    "zarr3-no-ocdbt": layout_of(use_ocdbt=False, use_zarr3=True),
    "zarr2-no-ocdbt": layout_of(use_ocdbt=False, use_zarr3=False),
    "zarr2-ocdbt": layout_of(use_ocdbt=True, use_zarr3=False),
    "no-commit-files": without_commit_files,
    "bare": bare,
    "flax": flax_checkpoints(multiprocess=False),
    "flax-multiprocess": flax_checkpoints(multiprocess=True),
}
FLAX = {"flax", "flax-multiprocess"}


# Written by orbax-checkpoint 0.2.3, the oldest release that runs here, in its own Python
# (tests/old_orbax): steps 0 and 7, or a bare tree. Its layout differs from today's.
OLD_ORBAX = REPO / ".venv-orbax-0.2.3" / "bin" / "python"
OLD = {"orbax-0.2.3-manager": "manager", "orbax-0.2.3-items": "items", "orbax-0.2.3-bare": "bare"}


@pytest.fixture(scope="module")
def old_orbax(tmp_path_factory):
    out = tmp_path_factory.mktemp("orbax-0.2.3")
    assert OLD_ORBAX.exists(), f"{OLD_ORBAX} is missing: `make test` installs it"
    subprocess.run(
        [str(OLD_ORBAX), str(REPO / "tests" / "old_orbax" / "write.py"), str(out)],
        check=True,
        timeout=300,
        env={"PATH": os.environ["PATH"], "JAX_PLATFORMS": "cpu"},
        capture_output=True,
    )
    item = out / "manager" / str(STEP) / "default"
    assert (item / "checkpoint").is_file() and not (item / "_METADATA").exists()
    assert (item / "params.params.dense.kernel" / ".zarray").is_file()  # zarr v2, a leaf each
    assert not (out / "manager" / str(STEP) / "_CHECKPOINT_METADATA").exists()
    return out


@pytest.fixture(scope="module", params=sorted(LAYOUTS) + sorted(OLD))
def written(request, tmp_path_factory, mesh):
    """(layout name, directory) of a checkpoint that plain Orbax wrote."""
    if request.param in OLD:
        return request.param, request.getfixturevalue("old_orbax") / OLD[request.param]
    directory = tmp_path_factory.mktemp(request.param) / "run"
    return request.param, LAYOUTS[request.param](directory, train_state(mesh))


def steps_of(layout):
    if layout.endswith("bare"):
        return [0]
    return [0, STEP] if layout in OLD else [STEP]


def step_of(layout):
    return steps_of(layout)[-1]


def cli(*args):
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert "Traceback" not in result.output, result.output
    # an error the CLI did not turn into its one-line message is a bug
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(
        result.exception
    )
    return result


# ------------------------------------------------------------------------------ the CLI


def test_ls_lists_the_orbax_step_marked_as_such(written):
    layout, directory = written
    result = cli("ls", "--json", directory)
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)["steps"]
    assert [r["step"] for r in rows] == steps_of(layout)
    row = rows[-1]
    assert row["written_by"] == "orbax" and row["latest"]
    assert row["leaves"] == 8 and "not checksummed" in row["status"]
    assert json.loads(result.output)["unreadable"] == []


def test_inspect_shows_leaves_shapes_dtypes_and_the_saved_sharding(written):
    layout, directory = written
    result = cli("inspect", "--json", directory)
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["written_by"] == "orbax" and doc["step"] == step_of(layout)
    leaves = {leaf["name"]: leaf for leaf in doc["leaves"]}
    assert sorted(leaves) == [
        "opt_state.0.count",
        "opt_state.0.mu.params.dense.bias",
        "opt_state.0.mu.params.dense.kernel",
        "opt_state.0.nu.params.dense.bias",
        "opt_state.0.nu.params.dense.kernel",
        "params.params.dense.bias",
        "params.params.dense.kernel",
        "step",
    ]
    kernel = leaves["params.params.dense.kernel"]
    assert kernel["shape"] == [8, 16] and kernel["dtype"] == "float32"
    text = cli("inspect", directory).output
    assert "written by plain Orbax" in text
    if layout in OLD:  # Orbax 0.2.3 recorded no sharding
        assert kernel["sharding"] is None
        return
    assert kernel["sharding"] == {"mesh": {"data": 4, "model": 2}, "spec": ["data", "model"]}
    assert "P('data', 'model') on data=4,model=2" in text


def test_verify_reads_every_array_and_says_it_is_not_checksummed(written):
    layout, directory = written
    result = cli("verify", "--json", directory)
    assert result.exit_code == 0, result.output
    reports = json.loads(result.output)["steps"]
    assert [r["step"] for r in reports] == steps_of(layout)
    assert all(r["checksummed"] is False and r["problems"] == [] for r in reports)
    assert "NOT checksummed" in cli("verify", directory).output


def test_export_applies_a_name_map_to_the_orbax_leaf_names(written, tmp_path):
    _, directory = written
    names = tmp_path / "names.yaml"
    names.write_text(
        "rules:\n"
        "  - {match: '^params\\.params\\.dense\\.kernel$', name: lm_head.weight, transpose: [1, 0]}\n"
        "  - {match: '^params\\.params\\.dense\\.bias$', name: lm_head.bias}\n"
        "  - {match: '', drop: true}\n"
    )
    out = tmp_path / "hf"
    result = cli("export", directory, out, "--names", names)
    assert result.exit_code == 0, result.output
    (shard,) = out.glob("*.safetensors")
    tensors = safetensors.numpy.load_file(shard)
    np.testing.assert_array_equal(tensors["lm_head.weight"], KERNEL.T)
    np.testing.assert_array_equal(tensors["lm_head.bias"], np.arange(16, dtype=np.float32))


def test_plan_onto_another_mesh(written):
    _, directory = written
    result = cli("plan", "--json", directory, "--mesh", "2x2", "--axes", "data,model")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["leaves"] == 8 and doc["mesh"] == {"data": 2, "model": 2}


# ------------------------------------------------------------------------------ restore


def test_read_only_restore_onto_another_mesh_and_onto_one_device(written):
    layout, directory = written
    other = jax.make_mesh((2, 4), ("data", "model"))
    one = jax.make_mesh((1, 1), ("data", "model"), devices=jax.devices()[:1])
    with jaxckpt.CheckpointManager(directory, read_only=True) as m:
        assert m.all_steps() == steps_of(layout)
        restored = m.restore(state=target_on(other, P("model", "data")))
        check_restored(restored.state, other)
        assert restored.step == step_of(layout) and restored.meta is None
        check_restored(m.restore(state=target_on(one, P())).state, one)
        untargeted = m.restore().state  # nested dicts of host arrays
        np.testing.assert_array_equal(untargeted["params"]["params"]["dense"]["kernel"], KERNEL)


def test_a_maxtext_step_restores_its_grain_iterator(tmp_path, mesh):
    directory = maxtext(tmp_path / "run", train_state(mesh))
    data = iter(orbax_written.dataset().to_iter_dataset())
    with jaxckpt.CheckpointManager(directory, read_only=True) as m:
        restored = m.restore(state=target_on(mesh, P("data", "model")), data=data)
    assert restored.data is data
    np.testing.assert_array_equal(next(data), [4, 5, 6, 7])  # one batch was consumed
    result = cli("inspect", "--data", "--json", directory)
    (saved,) = json.loads(result.output)["data_states"]
    assert saved["process"] == 0 and saved["processes"] == 1 and isinstance(saved["state"], dict)


def test_several_pytree_items_must_be_chosen(tmp_path, mesh):
    directory = tmp_path / "run"
    with ocp.CheckpointManager(directory, item_names=("params", "ema")) as m:
        tree = {"w": jnp.arange(4.0)}
        m.save(
            1,
            args=ocp.args.Composite(
                params=ocp.args.PyTreeSave(tree),
                ema=ocp.args.PyTreeSave({"w": jnp.arange(4.0) * 2}),
            ),
        )
    with jaxckpt.CheckpointManager(directory, read_only=True) as m:
        with pytest.raises(ConfigError, match=r"ema \(pytree\), params \(pytree\).*item="):
            m.restore()
        assert m.restore(item="ema").state["w"].tolist() == [0, 2, 4, 6]
        assert m.restore(item="params").state["w"].tolist() == [0, 1, 2, 3]
        with pytest.raises(ConfigError, match="no pytree item 'nope'"):
            m.restore(item="nope")
    result = cli("inspect", directory)
    assert result.exit_code != 0 and "--item" in result.output
    assert "ema" in cli("inspect", directory, "--item", "ema").output
    found = jaxckpt.diff(directory, step_a=1, step_b=1, item="ema", values=True)
    assert not found.different and found.max_abs_diff == {"w": 0.0}
    result = cli("diff", directory, 1, 1)  # "state": which one? diff(1)'s trouble status
    assert result.exit_code == 2 and "ema (pytree), params (pytree)" in result.output


# ------------------------------------------------------------------------------ switch in place


@pytest.mark.parametrize(
    "layout", sorted(set(LAYOUTS) - {"bare"}) + sorted(set(OLD) - {"orbax-0.2.3-bare"})
)
def test_a_run_switches_to_jaxckpt_in_place(layout, tmp_path, mesh, request):
    if layout in OLD:
        directory = tmp_path / "run"
        shutil.copytree(request.getfixturevalue("old_orbax") / OLD[layout], directory)
    else:
        directory = LAYOUTS[layout](tmp_path / "run", train_state(mesh))
    before = sorted(p.name for p in directory.iterdir())
    retention = jaxckpt.RetentionPolicy(keep_last=1)
    with jaxckpt.CheckpointManager(directory, retention=retention) as m:
        assert m.latest_step() == STEP
        state = m.restore(state=target_on(mesh, P("data", "model"))).state
        with pytest.raises(StepExistsError, match="plain Orbax wrote"):
            m.save(STEP, state=state)
        for step in (STEP + 1, STEP + 2, STEP + 3):
            m.save(step, state=state)
            m.wait()
        # retention never deletes Orbax's steps
        assert m.all_steps() == [*steps_of(layout), STEP + 3]
    with jaxckpt.CheckpointManager(directory, read_only=True) as m:
        assert m.latest_step() == STEP + 3 and m.meta(STEP) is None
        check_restored(m.restore(state=target_on(mesh, P())).state, mesh)
    # The jaxckpt step holds what the Orbax step did, leaf for leaf and value for value.
    result = cli("diff", directory, STEP, STEP + 3, "--values")
    assert result.exit_code == 0, result.output
    result = cli("rm", directory, STEP)
    assert result.exit_code == 1 and "never deletes such a step" in result.output
    assert set(before) <= {p.name for p in directory.iterdir()}
    # Plain Orbax still lists its own step and restores it.
    options = (
        ocp.CheckpointManagerOptions(step_prefix="ckpt", step_format_fixed_length=8)
        if layout == "prefixed"
        else None
    )
    if layout in FLAX:  # and Flax its own
        from flax.training import checkpoints

        assert checkpoints.latest_checkpoint(directory).endswith(f"checkpoint_{STEP}")
        got = checkpoints.restore_checkpoint(directory, target=None, step=STEP)
        np.testing.assert_array_equal(got["params"]["params"]["dense"]["kernel"], KERNEL)
        return
    item = {"maxtext": "items", "orbax-0.2.3-items": "state"}.get(layout)
    with ocp.CheckpointManager(directory, options=options) as m:
        assert STEP in m.all_steps()
        if item:
            args = ocp.args.Composite(**{item: ocp.args.PyTreeRestore()})
            got = m.restore(STEP, args=args)[item]
        else:
            got = m.restore(STEP, args=ocp.args.PyTreeRestore())
        kernel = got["params"]["params"]["dense"]["kernel"]
        np.testing.assert_array_equal(np.asarray(kernel), KERNEL)


def test_a_writer_refuses_a_bare_orbax_checkpoint(tmp_path, mesh):
    directory = bare(tmp_path / "ckpt", train_state(mesh))
    with pytest.raises(ConfigError, match="read_only=True"):
        jaxckpt.CheckpointManager(directory)


# ------------------------------------------------------------------------------ other hosts


@one_job_at_a_time
def test_a_step_orbax_saved_from_two_processes_restores_on_two_and_on_one(tmp_path, mesh):
    args = {"dir": str(tmp_path / "run")}
    saved = run_job(orbax_written.save, processes=2, devices=4, args=args)
    assert [r.report() for r in saved] == [{"steps": [STEP]}] * 2
    # Each process's grain iterator is back where that process saved it: one and two
    # batches into its own shard of the data.
    restored = run_job(orbax_written.restore, processes=2, devices=4, args=args)
    assert [r.report() for r in restored] == [
        {"step": STEP, "next": [4, 5, 6, 7]},
        {"step": STEP, "next": [1008, 1009, 1010, 1011]},
    ]
    result = cli("inspect", "--json", args["dir"])
    kernel = next(x for x in json.loads(result.output)["leaves"] if x["name"].endswith("kernel"))
    assert kernel["sharding"] == {"mesh": {"data": 4, "model": 2}, "spec": ["data", "model"]}
    with jaxckpt.CheckpointManager(args["dir"], read_only=True) as m:
        check_restored(m.restore(state=target_on(mesh, P(None, "model"))).state, mesh)


@one_job_at_a_time
def test_every_layout_restores_on_two_processes(tmp_path, mesh, old_orbax):
    dirs = {
        name: (str(write(tmp_path / name, train_state(mesh))), None)
        for name, write in LAYOUTS.items()
    } | {name: (str(old_orbax / folder), None) for name, folder in OLD.items()}
    results = run_job(orbax_written.restore_each, processes=2, devices=4, args={"dirs": dirs})
    assert [r.report() for r in results] == [{"steps": {n: step_of(n) for n in dirs}}] * 2


@one_job_at_a_time
def test_a_two_process_run_switches_in_place(tmp_path):
    args = {"dir": str(tmp_path / "run")}
    run_job(orbax_written.save, processes=2, devices=4, args=args)
    continued = run_job(
        orbax_written.restore, processes=2, devices=4, args=args | {"continue_in_place": True}
    )
    assert [r.report()["steps"] for r in continued] == [[STEP, STEP + 1]] * 2
    again = run_job(orbax_written.restore, processes=2, devices=4, args=args)
    # Step 8 (jaxckpt's) holds each process's iterator one batch further on.
    assert [r.report() for r in again] == [
        {"step": STEP + 1, "next": [8, 9, 10, 11]},
        {"step": STEP + 1, "next": [1012, 1013, 1014, 1015]},
    ]


def test_an_orbax_step_on_gcs(gcs_dir, mesh):
    directory = single_item(epath.Path(gcs_dir), train_state(mesh))
    other = jax.make_mesh((2, 4), ("data", "model"))
    with jaxckpt.CheckpointManager(directory, read_only=True) as m:
        assert m.all_steps() == [STEP]
        check_restored(m.restore(state=target_on(other, P("model", "data"))).state, other)
    result = cli("ls", "--json", gcs_dir)
    assert [row["written_by"] for row in json.loads(result.output)["steps"]] == ["orbax"]
    # On object storage a step is committed once commit_success.txt is in it: one without
    # it (a save in progress or cut off) is named, never read.
    (epath.Path(gcs_dir) / str(STEP) / "commit_success.txt").unlink()
    with pytest.raises(NoCheckpointError, match=r"unfinished saves of step\(s\) 7"):
        jaxckpt.CheckpointManager(directory, read_only=True).restore()


# ------------------------------------------------------------------------------ no lock-in


@pytest.fixture
def jaxckpt_step(tmp_path, mesh):
    """A jaxckpt directory whose step 3 holds the MaxText-style state."""
    directory = tmp_path / "jaxckpt-run"
    with jaxckpt.CheckpointManager(directory) as m:
        m.save(3, state=train_state(mesh), rng=jax.random.key(0))
    return directory


def test_export_format_orbax_is_read_by_plain_orbax(jaxckpt_step, tmp_path, mesh):
    out = tmp_path / "as-orbax"
    result = cli("export", jaxckpt_step, out, "--format", "orbax")
    assert result.exit_code == 0, result.output
    # Without a target the tree is nested dicts and lists, optax's EmptyState a None in it,
    # as plain Orbax writes it: the state's own target restores it.
    with ocp.StandardCheckpointer() as c:
        restored = c.restore(out, target_on(mesh, P("data", "model")))
    np.testing.assert_array_equal(
        np.asarray(restored["params"]["params"]["dense"]["kernel"]), KERNEL
    )
    assert restored["params"]["params"]["dense"]["kernel"].sharding.spec == P("data", "model")
    assert int(restored["step"]) == STEP
    # ... and jaxckpt reads it back as a bare Orbax checkpoint.
    with jaxckpt.CheckpointManager(out, read_only=True) as m:
        assert m.all_steps() == [0]


def test_the_way_back_to_plain_orbax_after_switching(tmp_path, mesh):
    """README, "Going back after switching": the old loop's restore(latest_step()) lands on
    jaxckpt's step and fails; the step exported as a plain Orbax step of a new directory is
    what the old loop restores."""
    directory = single_item(tmp_path / "run", train_state(mesh))
    with jaxckpt.CheckpointManager(directory) as m:
        m.save(STEP + 1, state=m.restore(state=target_on(mesh, P("data", "model"))).state)
    with ocp.CheckpointManager(directory) as m:
        assert m.latest_step() == STEP + 1
        with pytest.raises(Exception, match=r"jaxckpt/metadata not found|packed"):
            m.restore(m.latest_step())
    back = tmp_path / "run-orbax"
    result = cli("export", directory, back / str(STEP + 1) / "default", "--format", "orbax")
    assert result.exit_code == 0, result.output
    with ocp.CheckpointManager(back) as m:  # onto the state as the old loop builds it
        assert m.latest_step() == STEP + 1
        restored = m.restore(m.latest_step(), args=ocp.args.StandardRestore(train_state(mesh)))
    check_restored(restored, mesh)  # its optax state too (tests/test_to_orbax.py: all kinds)


def test_export_orbax_with_a_target_keeps_its_node_types(jaxckpt_step, tmp_path, mesh):
    out = tmp_path / "as-orbax"
    target = target_on(mesh, P("model", "data"))
    assert jaxckpt.export_orbax(jaxckpt_step, out, state=target) == 3
    with ocp.StandardCheckpointer() as c:
        restored = c.restore(out, target)  # the optax state itself, EmptyState included
    check_restored(restored, mesh)
    assert type(restored["opt_state"][1]).__name__ == "EmptyState"


def test_export_orbax_refuses_an_output_it_would_clobber(jaxckpt_step, tmp_path):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(jaxckpt.errors.OutputExistsError, match="not empty"):
        jaxckpt.export_orbax(jaxckpt_step, out)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    for inside in (jaxckpt_step, jaxckpt_step / "sub", jaxckpt_step.parent):
        with pytest.raises(ConfigError, match="overlaps the checkpoint directory"):
            jaxckpt.export_orbax(jaxckpt_step, inside, overwrite=True)
    assert jaxckpt.CheckpointManager(jaxckpt_step, read_only=True).all_steps() == [3]
    result = cli("export", jaxckpt_step, tmp_path / "x", "--format", "orbax", "--dtype", "bfloat16")
    assert result.exit_code != 0 and "only with --format safetensors" in result.output


def test_plain_orbax_reads_a_jaxckpt_step_directly(tmp_path, mesh):
    # A jaxckpt step is an Orbax step: its state item holds the leaves under their names,
    # every one of them when small leaves are not packed (else only those above 1 MiB).
    directory = tmp_path / "unpacked"
    with jaxckpt.CheckpointManager(directory, pack_small_leaves=False) as m:
        m.save(3, state=train_state(mesh))
    with ocp.CheckpointManager(directory) as m:
        assert m.all_steps() == [3]
        got = m.restore(3, args=ocp.args.Composite(state=ocp.args.StandardRestore()))
    flat = got["state"]
    assert "params.params.dense.kernel" in flat and "opt_state.0.mu.params.dense.bias" in flat
    np.testing.assert_array_equal(np.asarray(flat["params.params.dense.kernel"]), KERNEL)


# ------------------------------------------------------------------------------ strict, and hostile


def test_an_orbax_step_is_checked_against_the_target_like_a_jaxckpt_step(tmp_path, mesh):
    directory = maxtext(tmp_path / "run", train_state(mesh))
    with jaxckpt.CheckpointManager(directory, read_only=True) as m:
        wrong = target_on(mesh, P())
        wrong["params"]["params"]["dense"]["bias"] = jax.ShapeDtypeStruct((17,), np.float32)
        with pytest.raises(jaxckpt.errors.LeafMismatchError, match=r"params\.params\.dense\.bias"):
            m.restore(state=wrong)
        params_only = {"params": target_on(mesh, P())["params"]}
        with pytest.raises(jaxckpt.errors.TreeMismatchError, match="partial=True"):
            m.restore(state=params_only)
        restored = m.restore(state=params_only, partial=True).state
    np.testing.assert_array_equal(
        np.asarray(restored["params"]["params"]["dense"]["kernel"]), KERNEL
    )


def test_damaged_orbax_files_are_named_never_a_traceback(tmp_path, mesh):
    directory = single_item(tmp_path / "run", train_state(mesh))
    (directory / str(STEP) / "default" / "_METADATA").write_text("{not json")
    damaged = "default/_METADATA is unreadable"  # (the newest step's metadata, read first)
    reader = jaxckpt.CheckpointManager(directory, read_only=True)
    with pytest.raises(jaxckpt.errors.CorruptCheckpointError, match=damaged):
        reader.restore(STEP)
    with pytest.raises(jaxckpt.errors.NoCheckpointError, match=damaged):
        reader.restore()  # the only step: none to resume from
    result = cli("inspect", directory)
    assert result.exit_code != 0 and damaged in result.output


def test_missing_array_data_fails_verify_and_restore(tmp_path, mesh):
    directory = layout_of(use_ocdbt=False, use_zarr3=True)(tmp_path / "run", train_state(mesh))
    shutil.rmtree(directory / str(STEP) / "default" / "params.params.dense.kernel")
    result = cli("verify", directory)
    assert result.exit_code == 1 and "params.params.dense.kernel" in result.output
    with pytest.raises(jaxckpt.errors.JaxckptError, match=r"params\.params\.dense\.kernel"):
        jaxckpt.CheckpointManager(directory, read_only=True).restore()


def test_links_in_an_orbax_step_are_refused_and_never_followed(tmp_path, mesh):
    directory = single_item(tmp_path / "run", train_state(mesh))
    elsewhere = single_item(tmp_path / "elsewhere", train_state(mesh))
    item = directory / str(STEP) / "default"
    shutil.rmtree(item)
    item.symlink_to(elsewhere / str(STEP) / "default")
    with pytest.raises(NoCheckpointError, match="no Orbax pytree item"):
        jaxckpt.CheckpointManager(directory, read_only=True).restore()
    # A step folder that is a link is never a step either.
    shutil.rmtree(directory / str(STEP))
    (directory / "ckpt_9").symlink_to(elsewhere / str(STEP))
    with pytest.raises(NoCheckpointError, match="ckpt_9: a symbolic link"):
        jaxckpt.CheckpointManager(directory, read_only=True).restore()
    # A link deeper inside an item is refused before anything is read.
    inner = elsewhere / str(STEP) / "default" / "_sharding"
    inner.unlink()
    inner.symlink_to(tmp_path / "outside.json")
    with pytest.raises(jaxckpt.errors.CorruptCheckpointError, match="symbolic link"):
        jaxckpt.CheckpointManager(elsewhere, read_only=True).restore()


def test_typed_and_raw_prng_keys_orbax_saved_come_back_as_saved(tmp_path, mesh):
    keys = {
        "dropout": jax.random.key(3),
        "rbg": jax.random.key(4, impl="rbg"),
        "raw": jax.random.PRNGKey(5),
        "w": jnp.ones(2),
    }
    directory = single_item(tmp_path / "run", keys)
    inspected = {
        x["name"]: x for x in json.loads(cli("inspect", "--json", directory).output)["leaves"]
    }
    assert inspected["dropout"]["dtype"] == "key<fry>" and inspected["dropout"]["shape"] == []
    assert inspected["rbg"]["key_impl"] == "rbg" and inspected["raw"]["dtype"] == "uint32"
    target = {
        "dropout": jax.random.key(0),
        "rbg": jax.random.key(0, impl="rbg"),
        "raw": jax.random.PRNGKey(0),
        "w": jnp.zeros(2),
    }
    with jaxckpt.CheckpointManager(directory, read_only=True) as m:
        restored = m.restore(state=target).state
    for name in ("dropout", "rbg"):
        assert restored[name].dtype == keys[name].dtype
        np.testing.assert_array_equal(
            jax.random.key_data(restored[name]), jax.random.key_data(keys[name])
        )
    np.testing.assert_array_equal(restored["raw"], keys["raw"])


# ------------------------------------------------------------------------------ review: hostile


def test_a_step_whose_pytree_metadata_is_gone_is_named_not_listed(tmp_path, mesh):
    # MaxText's step without items/_METADATA keeps only its grain item: no step to restore.
    directory = maxtext(tmp_path / "run", train_state(mesh))
    (directory / str(STEP) / "items" / "_METADATA").unlink()
    result = cli("ls", directory)
    assert result.exit_code == 0 and f"{STEP}: not a step jaxckpt can read" in result.output
    result = cli("verify", directory)
    assert result.exit_code == 1 and "no Orbax pytree item" in result.output
    with pytest.raises(NoCheckpointError, match="no Orbax pytree item"):
        jaxckpt.CheckpointManager(directory, read_only=True).restore()


def test_links_and_hostile_metadata_are_refused_by_every_reader(tmp_path, mesh):
    directory = single_item(tmp_path / "run", train_state(mesh))
    sharding = directory / str(STEP) / "default" / "_sharding"
    saved = sharding.read_bytes()
    sharding.unlink()
    (tmp_path / "outside.json").write_bytes(saved)
    sharding.symlink_to(tmp_path / "outside.json")
    for command in (["inspect"], ["verify"], ["plan", "--mesh", "2x4"], ["diff", STEP, STEP]):
        result = cli(command[0], directory, *command[1:])
        trouble = 2 if command[0] == "diff" else 1  # diff's exit status is diff(1)'s
        assert result.exit_code == trouble and "symbolic link" in result.output, result.output
    sharding.unlink()
    sharding.write_bytes(saved)
    metadatas = directory / str(STEP) / "default" / "array_metadatas" / "process_0"
    metadatas.write_text("{not json")
    result = cli("inspect", directory)
    assert result.exit_code == 1 and "cannot read the metadata of its item" in result.output


def test_a_legacy_leaf_name_that_leaves_the_item_is_refused(tmp_path, old_orbax):
    directory = tmp_path / "run"
    shutil.copytree(old_orbax / "bare", directory)
    tree = {"params": {"params": {"w": "PLACEHOLDER://../../outside"}}}
    (directory / "checkpoint").write_bytes(ocp.msgpack_utils.msgpack_serialize(tree))
    with pytest.raises(jaxckpt.errors.CorruptCheckpointError, match="no folder of the item"):
        jaxckpt.CheckpointManager(directory, read_only=True).restore()


def test_a_missing_chunk_of_a_legacy_step_fails_verify(tmp_path, old_orbax):
    # Orbax reads a missing chunk of such a step as zeros: verify counts the chunk files.
    directory = tmp_path / "run"
    shutil.copytree(old_orbax / "manager", directory)
    (directory / str(STEP) / "default" / "params.params.dense.kernel" / "1.1").unlink()
    result = cli("verify", directory)
    assert result.exit_code == 1
    assert "params.params.dense.kernel: 1 of 8 chunk files are missing" in result.output


def test_a_writer_refused_on_a_bare_checkpoint_writes_nothing_there(tmp_path, mesh):
    directory = bare(tmp_path / "ckpt", train_state(mesh))
    before = sorted(str(p.relative_to(directory)) for p in directory.rglob("*"))
    with pytest.raises(ConfigError, match="read_only=True"):
        jaxckpt.CheckpointManager(directory)
    assert sorted(str(p.relative_to(directory)) for p in directory.rglob("*")) == before


def test_a_grain_state_for_another_process_count_is_refused_before_any_read(tmp_path, mesh):
    directory = maxtext(tmp_path / "run", train_state(mesh))
    saved = directory / str(STEP) / "iter" / "process_0-of-1.json"
    saved.rename(saved.with_name("process_0-of-2.json"))
    reads = []
    counted = faults.store(read_arrays=lambda read, *a: reads.append(a) or read(*a))
    with faults.manager(directory, read_only=True, store=counted) as m:
        data = iter(orbax_written.dataset().to_iter_dataset())
        with pytest.raises(jaxckpt.errors.DataStateError, match=r"process_0-of-2\.json"):
            m.restore(state=target_on(mesh, P()), data=data)
    assert reads == []


def test_export_orbax_replaces_only_what_it_was_told_to(jaxckpt_step, tmp_path):
    out = tmp_path / "as-orbax"
    jaxckpt.export_orbax(jaxckpt_step, out)
    jaxckpt.export_orbax(jaxckpt_step, out, overwrite=True)  # replaced whole, renamed in place
    assert sorted(p.name for p in tmp_path.iterdir()) == ["as-orbax", "jaxckpt-run"]
    with ocp.StandardCheckpointer() as c:
        np.testing.assert_array_equal(c.restore(out)["params"]["params"]["dense"]["kernel"], KERNEL)
    a_file = tmp_path / "a-file"
    a_file.write_text("mine")
    with pytest.raises(jaxckpt.errors.OutputExistsError, match="not a directory"):
        jaxckpt.export_orbax(jaxckpt_step, a_file, overwrite=True)
    assert a_file.read_text() == "mine"


def test_a_writer_on_gcs_removes_only_its_own_unfinished_saves(gcs_dir, mesh):
    root = epath.Path(gcs_dir)
    single_item(root, train_state(mesh))
    (root / "notes").mkdir(parents=True)
    (root / "notes" / "todo.txt").write_text("mine")  # no commit_success.txt: not a step
    (root / "ckpt_12" / "default").mkdir(parents=True)  # an Orbax save under a prefix, unfinished
    (root / "ckpt_12" / "default" / "_METADATA").write_text("{}")
    with jaxckpt.CheckpointManager(gcs_dir, retention=jaxckpt.RetentionPolicy(keep_last=1)) as m:
        assert m.latest_step() == STEP
        m.save(STEP + 1, state={"x": np.arange(3)})
        m.wait()
        m.save(STEP + 2, state={"x": np.arange(3)})
    assert (root / "notes" / "todo.txt").read_text() == "mine"
    assert (root / "ckpt_12" / "default" / "_METADATA").exists()
    with jaxckpt.CheckpointManager(gcs_dir, read_only=True) as m:
        assert m.all_steps() == [STEP, STEP + 2]


def _side_by_side() -> list[tuple[str, str]]:
    """The rows of "The calls, side by side" in docs/from-orbax.md: (Orbax's, jaxckpt's)."""
    page = (REPO / "docs" / "from-orbax.md").read_text()
    part = page[page.index("## The calls, side by side") :].split("\n## ")[0]
    rows = re.findall(r"^\| `(.+?)` \| `(.+?)` \|$", part, flags=re.M)
    assert len(rows) >= 8, rows
    return rows


def _run_column(cells: list[str], directory) -> tuple[list, object]:
    """Each cell of one side in order, in one namespace: what each expression answers, and
    the iterator's next batch after them all (the restore moved it to where it was saved)."""
    import grain

    dataset = grain.MapDataset.range(64).batch(4)
    state = {"params": {"w": jnp.arange(32.0).reshape(8, 4)}, "count": jnp.asarray(3)}
    ns = {
        "grain": grain, "ocp": ocp, "jaxckpt": jaxckpt, "DIR": str(directory), "step": 10,
        "state": state, "it": iter(dataset.to_iter_dataset()),
        "target": jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state),
    }  # fmt: skip
    next(ns["it"])  # one batch read before the save
    answers = []
    for cell in cells:
        try:
            code = compile(cell, "<cell>", "eval")
        except SyntaxError:
            exec(cell, ns)
            answers.append(None)
        else:
            answers.append(eval(code, ns))
    return answers, next(ns["it"])


def test_each_row_of_the_side_by_side_table_answers_the_same_on_both_sides(tmp_path):
    # an action answers nothing in jaxckpt, and None or True ("done") in Orbax; a query
    # answers the same on both sides, bitwise; the iterator is where both restores put it
    rows = _side_by_side()
    orbax, orbax_next = _run_column([o for o, _ in rows], tmp_path / "orbax")
    ours, our_next = _run_column([j for _, j in rows], tmp_path / "jaxckpt")
    assert np.array_equal(orbax_next, our_next) and our_next.tolist() == [4, 5, 6, 7]
    for (cell, _), a, b in zip(rows, orbax, ours, strict=True):
        if b is None:
            assert a in (None, True), cell
            continue
        assert jax.tree.structure(a) == jax.tree.structure(b), cell
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
            assert np.asarray(x).tobytes() == np.asarray(y).tobytes(), cell

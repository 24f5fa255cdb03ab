"""Checkpoints plain Orbax wrote, opened as users have them: every layout is written here by
the real orbax-checkpoint (sharded on 8 CPU devices), then listed, inspected, exported,
restored onto other meshes, and continued in place by jaxckpt, and read back by Orbax."""

import json

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
from multihost import run_job

import jaxckpt
from jaxckpt.cli import main
from jaxckpt.errors import ConfigError, NoCheckpointError, StepExistsError

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
}


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def written(request, tmp_path_factory, mesh):
    """(layout name, directory) of a checkpoint that plain Orbax wrote."""
    directory = tmp_path_factory.mktemp(request.param) / "run"
    return request.param, LAYOUTS[request.param](directory, train_state(mesh))


def step_of(layout):
    return 0 if layout == "bare" else STEP


def cli(*args):
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert "Traceback" not in result.output, result.output
    return result


# ------------------------------------------------------------------------------ the CLI


def test_ls_lists_the_orbax_step_marked_as_such(written):
    layout, directory = written
    result = cli("ls", "--json", directory)
    assert result.exit_code == 0, result.output
    (row,) = json.loads(result.output)["steps"]
    assert row["step"] == step_of(layout) and row["written_by"] == "orbax" and row["latest"]
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
    assert kernel["sharding"] == {"mesh": {"data": 4, "model": 2}, "spec": ["data", "model"]}
    text = cli("inspect", directory).output
    assert "written by plain Orbax" in text and "P('data', 'model') on data=4,model=2" in text


def test_verify_reads_every_array_and_says_it_is_not_checksummed(written):
    _, directory = written
    result = cli("verify", "--json", directory)
    assert result.exit_code == 0, result.output
    (report,) = json.loads(result.output)["steps"]
    assert report["checksummed"] is False and report["problems"] == []
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
    result = cli("plan", "--json", directory, "--mesh", "2x2")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["leaves"] == 8 and doc["mesh"] == {"data": 2, "model": 2}


# ------------------------------------------------------------------------------ restore


def test_read_only_restore_onto_another_mesh_and_onto_one_device(written):
    layout, directory = written
    other = jax.make_mesh((2, 4), ("data", "model"))
    one = jax.make_mesh((1, 1), ("data", "model"), devices=jax.devices()[:1])
    with jaxckpt.CheckpointManager(directory, read_only=True) as m:
        assert m.all_steps() == [step_of(layout)]
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


# ------------------------------------------------------------------------------ switch in place


@pytest.mark.parametrize("layout", sorted(set(LAYOUTS) - {"bare"}))
def test_a_run_switches_to_jaxckpt_in_place(layout, tmp_path, mesh):
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
        assert m.all_steps() == [STEP, STEP + 3]  # retention never deletes Orbax's step
    with jaxckpt.CheckpointManager(directory, read_only=True) as m:
        assert m.latest_step() == STEP + 3
        check_restored(m.restore(state=target_on(mesh, P())).state, mesh)
    assert set(before) <= {p.name for p in directory.iterdir()}
    # Plain Orbax still lists its own step and restores it.
    options = (
        ocp.CheckpointManagerOptions(step_prefix="ckpt", step_format_fixed_length=8)
        if layout == "prefixed"
        else None
    )
    names = {"item_names": ("items", "iter")} if layout == "maxtext" else {}
    with ocp.CheckpointManager(directory, options=options, **names) as m:
        assert STEP in m.all_steps()
        if layout == "maxtext":
            args = ocp.args.Composite(items=ocp.args.PyTreeRestore())
            got = m.restore(STEP, args=args)["items"]
        else:
            got = m.restore(STEP, args=ocp.args.PyTreeRestore())
        kernel = got["params"]["params"]["dense"]["kernel"]
        np.testing.assert_array_equal(np.asarray(kernel), KERNEL)


def test_a_writer_refuses_a_bare_orbax_checkpoint(tmp_path, mesh):
    directory = bare(tmp_path / "ckpt", train_state(mesh))
    with pytest.raises(ConfigError, match="read_only=True"):
        jaxckpt.CheckpointManager(directory)


# ------------------------------------------------------------------------------ never silent


def test_step_like_folders_nobody_can_read_are_named_with_why(tmp_path):
    directory = tmp_path / "run"
    (directory / "ckpt_3").mkdir(parents=True)
    (directory / "ckpt_3" / "notes.txt").write_text("x")
    (directory / "ckpt_4").mkdir()
    with pytest.raises(NoCheckpointError, match=r"ckpt_3: no Orbax pytree item.*notes\.txt"):
        jaxckpt.CheckpointManager(directory, read_only=True).restore()
    result = cli("ls", directory)
    assert "ckpt_3: not a step jaxckpt can read" in result.output
    assert "ckpt_4: not a step jaxckpt can read" in result.output


# ------------------------------------------------------------------------------ other hosts


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


def test_every_layout_restores_on_two_processes(tmp_path, mesh):
    dirs = {
        name: (str(write(tmp_path / name, train_state(mesh))), None)
        for name, write in LAYOUTS.items()
    }
    results = run_job(orbax_written.restore_each, processes=2, devices=4, args={"dirs": dirs})
    assert [r.report() for r in results] == [{"steps": {n: step_of(n) for n in LAYOUTS}}] * 2


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

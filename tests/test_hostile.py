"""Hostile files and shared directories: links, FIFOs, stray folders, damaged metadata, a lost
lock, a step deleted under a reader. Whatever is planted, jaxckpt raises a `JaxckptError` (the
CLI one line and a non-zero exit), never reads or writes outside the directory, and loses no
committed step."""

import json
import os
import re
import shutil
import subprocess
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from click.testing import CliRunner
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from conftest import Iterator
from jaxckpt import _integrity, errors
from jaxckpt.cli import main as cli_main
from reliability import faults, hostile


def state_at(mesh, step):
    return {
        "params": {
            "w": jax.device_put(jnp.full((8, 8), step, jnp.float32), NamedSharding(mesh, P("data")))
        },
        "b": np.full(4, step, np.float32),
    }


def target(mesh):
    return {
        "params": {
            "w": jax.ShapeDtypeStruct((8, 8), jnp.float32, sharding=NamedSharding(mesh, P()))
        },
        "b": np.zeros(4, np.float32),
    }


@pytest.fixture(scope="module")
def pristine(tmp_path_factory, mesh):
    """Steps 1 and 2 with state, rng, data and meta; copied for each test."""
    directory = tmp_path_factory.mktemp("hostile") / "ckpt"
    with jaxckpt.CheckpointManager(directory) as m:
        for step in (1, 2):
            m.save(
                step,
                state=state_at(mesh, step),
                rng=jax.random.key(step),
                data=Iterator(step),
                meta={"step": step},
            )
    return directory


@pytest.fixture
def outside(tmp_path):
    """A folder beside the checkpoint that nothing may read or write: a precious file, and a
    FIFO that blocks whoever opens it (a test reading it would time out)."""
    folder = tmp_path / "outside"
    folder.mkdir()
    (folder / "precious").write_text("keep me")
    os.mkfifo(folder / "fifo")
    return folder


@pytest.fixture
def ckpt(pristine, tmp_path):
    directory = tmp_path / "ckpt"
    shutil.copytree(pristine, directory, symlinks=True)
    (directory / ".jaxckpt-writer.lock").unlink()  # (a writer released it: empty)
    return directory


def edit_info(step_dir, change, *, rehash=True):
    path = step_dir / "jaxckpt" / "jaxckpt.json"
    info = json.loads(path.read_text())
    change(info)
    path.write_text(json.dumps(info))
    if rehash:  # an attacker who can write the step can also rewrite its manifest
        _integrity.write_manifest(step_dir)


def set_manifest_entry(step_dir, name, value):
    path = step_dir / "jaxckpt" / "manifest.json"
    doc = json.loads(path.read_text())
    doc["files"][name] = value
    path.write_text(json.dumps(doc))


# ------------------------------------------------------------------------- what is planted


def _ghost_leaf(info):
    (w,) = [s for s in info["items"]["state"] if s["name"] == "params.w"]
    info["items"]["state"].append(dict(w, name="ghost", path=[["dict", "ghost"]]))


def _garbage_data_state(step_dir):
    (step_dir / "data" / "process_0-of-1.json").write_text("{oops")
    _integrity.write_manifest(step_dir)


HOSTILE = {
    "json-garbage": lambda d, out: (d / "2/jaxckpt/jaxckpt.json").write_text("{garbage"),
    "json-shape-not-a-list": lambda d, out: edit_info(
        d / "2", lambda i: i["items"]["state"][0].update(shape="big")
    ),
    "json-dtype-unknown": lambda d, out: edit_info(
        d / "2", lambda i: i["items"]["state"][0].update(dtype="float128x")
    ),
    "json-deep": lambda d, out: (d / "2/jaxckpt/jaxckpt.json").write_text(
        "[" * 100_000 + "]" * 100_000
    ),
    "json-huge-int": lambda d, out: (d / "2/jaxckpt/jaxckpt.json").write_text(
        '{"format": ' + "9" * 5000 + "}"
    ),
    "json-newer-format": lambda d, out: edit_info(d / "2", lambda i: i.update(format=99)),
    "json-items-missing": lambda d, out: edit_info(d / "2", lambda i: i.pop("items")),
    "manifest-entry-int": lambda d, out: set_manifest_entry(d / "2", "packed/0-of-1.json", 5),
    "manifest-size-str": lambda d, out: set_manifest_entry(
        d / "2", "packed/0-of-1.json", {"size": "big", "xxh3_128": "0"}
    ),
    "manifest-not-json": lambda d, out: (d / "2/jaxckpt/manifest.json").write_text("]["),
    "unicode-digit-folders": lambda d, out: [
        (d / "²").mkdir(),
        (d / "①").mkdir(),
        shutil.copytree(d / "2", d / "00002"),
    ],
    "symlinked-step-folder": lambda d, out: [
        shutil.copytree(d / "2", out / "step"),
        (d / "7").symlink_to(out / "step"),
    ],
    "link-in-step": lambda d, out: (d / "2/packed/d.link").symlink_to(out / "fifo"),
    "linked-folder-in-step": lambda d, out: (d / "2/packed/linked").symlink_to(out),
    "info-is-a-link": lambda d, out: [
        (d / "2/jaxckpt/jaxckpt.json").unlink(),
        (d / "2/jaxckpt/jaxckpt.json").symlink_to(out / "fifo"),
    ],
    "fifo-in-step": lambda d, out: os.mkfifo(d / "2/packed/fifo"),
    "ghost-leaf": lambda d, out: edit_info(d / "2", _ghost_leaf),
    "data-state-garbage": lambda d, out: _garbage_data_state(d / "2"),
    "empty-step-folder": lambda d, out: (d / "3").mkdir(),
    "file-named-like-a-step": lambda d, out: (d / "4").write_text("not a step"),
    "lock-symlink": lambda d, out: (d / ".jaxckpt-writer.lock").symlink_to(out / "precious"),
    "lock-fifo": lambda d, out: os.mkfifo(d / ".jaxckpt-writer.lock"),
    "lock-hardlink": lambda d, out: os.link(out / "precious", d / ".jaxckpt-writer.lock"),
}


def entry_points(d, tmp, mesh):
    """Every public entry point, as a user calls it on this directory."""

    def reader():
        return jaxckpt.CheckpointManager(d, read_only=True)

    def writer_save():
        with jaxckpt.CheckpointManager(d) as m:
            m.save(10, state=state_at(mesh, 10))

    def cli(*args):
        def run():
            result = CliRunner().invoke(cli_main, [str(a) for a in args])
            assert "Traceback" not in result.output, result.output
            assert result.exception is None or isinstance(result.exception, SystemExit), (
                f"{args}: {result.exception!r}"
            )
            if result.exit_code and (args[0], result.exit_code) != ("diff", 1):  # 1: differ
                lines = [ln for ln in result.output.splitlines() if ln.startswith("jaxckpt:")]
                assert lines, result.output

        return run

    return {
        "reader.all_steps": lambda: reader().all_steps(),
        "reader.restore()": lambda: reader().restore(),
        "reader.restore(fallback)": lambda: reader().restore(fallback=True),
        "reader.restore(2, target)": lambda: reader().restore(
            2, state=target(mesh), rng=jax.random.key(0), data=Iterator()
        ),
        "reader.restore(2, no verify)": lambda: jaxckpt.CheckpointManager(
            d, read_only=True, verify_on_restore=False
        ).restore(2, state=target(mesh)),
        "reader.meta(2)": lambda: reader().meta(2),
        "reader.plan(2)": lambda: reader().plan(2, state=target(mesh)),
        "writer.save": writer_save,
        "verify": lambda: jaxckpt.verify(d),
        "export": lambda: jaxckpt.export_safetensors(d, tmp / "hf", step=2, overwrite=True),
        "cli ls": cli("ls", d),
        "cli ls --verify": cli("ls", "--verify", d),
        "cli inspect": cli("inspect", d, "--step", 2),
        "cli inspect --data": cli("inspect", d, "--step", 2, "--data"),
        "cli diff --values": cli("diff", d, 1, 2, "--values"),
        "cli plan": cli("plan", d, "--step", 2, "--mesh", 8, "--axes", "data"),
        "cli verify": cli("verify", d),
        "cli export": cli("export", d, tmp / "hf-cli", "--step", 2, "--overwrite"),
        "cli rm": cli("rm", d, 2),  # last: step 2 goes (writer.save made step 10 the latest)
    }


@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_every_entry_point_survives_hostile_files(case, ckpt, outside, mesh, tmp_path):
    HOSTILE[case](ckpt, outside)
    for name, call in entry_points(ckpt, tmp_path, mesh).items():
        try:
            call()
        except errors.JaxckptError:
            pass
        except Exception as e:  # anything else is a bug: name the entry point
            raise AssertionError(f"{case}: {name} raised {type(e).__name__}: {e}") from e
        assert (outside / "precious").read_text() == "keep me", f"{case}: {name}"
    # Nothing committed was lost: step 1 is untouched by any of it.
    restored = jaxckpt.CheckpointManager(ckpt, read_only=True).restore(1, state=target(mesh))
    assert np.asarray(restored.state["params"]["w"]).tolist() == [[1.0] * 8] * 8


# ------------------------------------------------------------------ links and FIFOs in a step


@pytest.mark.timeout(60)
def test_verify_and_restore_never_follow_a_link_out_of_a_step(ckpt, outside, mesh):
    (ckpt / "2/packed/evil").symlink_to(outside)  # holds a FIFO: opening it would hang
    (report,) = jaxckpt.verify(ckpt, 2)
    assert report.problems == (
        "packed/evil: a symbolic link (jaxckpt reads nothing through a link)",
    )
    reader = jaxckpt.CheckpointManager(ckpt, read_only=True, verify_on_restore=False)
    with pytest.raises(errors.CorruptCheckpointError, match="packed/evil: a symbolic link"):
        reader.restore(2, state=target(mesh))
    with pytest.raises(errors.CorruptCheckpointError, match="packed/evil: a symbolic link"):
        jaxckpt.export_safetensors(ckpt, ckpt.parent / "hf", step=2)
    assert jaxckpt.CheckpointManager(ckpt, read_only=True).restore(fallback=True).step == 1


@pytest.mark.timeout(60)
def test_a_fifo_in_a_step_is_reported_not_opened(ckpt):
    os.mkfifo(ckpt / "2/packed/fifo")
    (report,) = jaxckpt.verify(ckpt, 2)
    assert report.problems == ("packed/fifo: not a regular file (a FIFO, socket or device)",)


def test_a_symlinked_step_folder_is_not_a_step(ckpt, outside):
    shutil.copytree(ckpt / "2", outside / "step")
    (ckpt / "7").symlink_to(outside / "step")
    reader = jaxckpt.CheckpointManager(ckpt, read_only=True)
    assert reader.all_steps() == [1, 2]
    with pytest.raises(errors.CorruptCheckpointError, match="step folder is a symbolic link"):
        reader.restore(7)
    reports = {r.step: r.problems for r in jaxckpt.verify(ckpt)}
    assert reports[7] == ("the step folder is a symbolic link, which jaxckpt never follows",)


# ------------------------------------------------------------------------- damaged metadata


def test_a_step_with_garbage_metadata_is_listed_as_damaged(ckpt, mesh):
    (ckpt / "2/jaxckpt/jaxckpt.json").write_text("{garbage")
    result = CliRunner().invoke(cli_main, ["ls", str(ckpt)])
    assert result.exit_code == 0, result.output
    row = next(line for line in result.output.splitlines() if line.split()[:1] == ["2"])
    assert "damaged: jaxckpt/jaxckpt.json is unreadable" in row
    for args in (
        ["inspect", "--step", "2"],
        ["plan", "--step", "2", "--mesh", "8", "--axes", "data"],
    ):
        result = CliRunner().invoke(cli_main, [args[0], str(ckpt), *args[1:]])
        assert result.exit_code == 1
        assert result.output.startswith("jaxckpt: error: step 2 in")
        assert "jaxckpt.json is unreadable" in result.output
    reader = jaxckpt.CheckpointManager(ckpt, read_only=True)
    with pytest.raises(errors.CorruptCheckpointError, match=r"jaxckpt\.json is unreadable"):
        reader.meta(2)
    assert reader.restore(state=target(mesh), fallback=True).step == 1


@pytest.mark.parametrize(
    ("entry", "field"),
    [
        (5, "files\\['packed/0-of-1.json'\\] is not an object"),
        (
            {"size": "big", "xxh3_128": "0"},
            "files\\['packed/0-of-1.json'\\].size is not a byte count",
        ),
        ({"size": 3}, "files\\['packed/0-of-1.json'\\].xxh3_128 is not a hex digest"),
    ],
)
def test_a_malformed_manifest_entry_is_reported_by_name(ckpt, mesh, entry, field):
    set_manifest_entry(ckpt / "2", "packed/0-of-1.json", entry)
    (report,) = jaxckpt.verify(ckpt, 2)
    assert len(report.problems) == 1 and re.search(field, report.problems[0])
    assert jaxckpt.CheckpointManager(ckpt, read_only=True).restore(fallback=True).step == 1


def test_a_newer_format_is_named(ckpt):
    edit_info(ckpt / "2", lambda i: i.update(format=99))
    with pytest.raises(
        errors.CorruptCheckpointError, match="format 99, written by a newer jaxckpt"
    ):
        jaxckpt.CheckpointManager(ckpt, read_only=True).meta(2)


@pytest.mark.parametrize("verify_on_restore", [True, False])
@pytest.mark.parametrize("sharded", [True, False])
def test_a_leaf_the_arrays_lack_is_an_error(ckpt, mesh, verify_on_restore, sharded):
    edit_info(ckpt / "2", _ghost_leaf)
    reader = jaxckpt.CheckpointManager(ckpt, read_only=True, verify_on_restore=verify_on_restore)
    wanted = None
    if sharded:
        wanted = {**target(mesh), "ghost": target(mesh)["params"]["w"]}
    with pytest.raises(
        errors.CorruptCheckpointError, match="'ghost' is not among the stored arrays"
    ):
        reader.restore(2, state=wanted)
    with pytest.raises(
        errors.CorruptCheckpointError, match="'ghost' is not among the stored arrays"
    ):
        jaxckpt.export_safetensors(ckpt, ckpt.parent / "hf", step=2)


def test_a_host_leaf_stored_in_another_shape_is_an_error(ckpt, mesh):
    def grow(info):
        (b,) = [s for s in info["items"]["state"] if s["name"] == "b"]
        b["shape"] = [6]

    edit_info(ckpt / "2", grow)
    reader = jaxckpt.CheckpointManager(ckpt, read_only=True)
    wanted = {**target(mesh), "b": np.zeros(6, np.float32)}
    with pytest.raises(
        errors.CorruptCheckpointError,
        match=r"'b' is stored with shape \(4,\).* records shape \(6,\)",
    ):
        reader.restore(2, state=wanted)


# -------------------------------------------------------------------- bad input, refused early


@pytest.mark.parametrize(
    ("leaf", "pattern"),
    [
        (np.array(["a", "bc"]), "dtype <U2"),
        (np.array([b"ab"]), "dtype |S2"),
        (np.array(["2020-01-01"], dtype="datetime64[D]"), "dtype datetime64"),
        (np.zeros(2, dtype=[("a", "i4")]), "dtype"),
        (np.ones(4, jnp.uint4), "dtype uint4"),
        (jnp.ones(4, jnp.uint4), "dtype uint4"),
    ],
)
def test_dtypes_the_storage_cannot_hold_are_refused_by_save(ckpt, leaf, pattern):
    with jaxckpt.CheckpointManager(ckpt) as m:
        with pytest.raises(errors.UnsupportedValueError, match=re.escape(pattern)):
            m.save(3, state={"x": leaf})
        assert not (ckpt / "3").exists()
        m.save(3, state={"x": np.ones(2, jnp.int4)})  # what tensorstore holds still saves
    assert jaxckpt.CheckpointManager(ckpt, read_only=True).all_steps() == [1, 2, 3]


@pytest.mark.parametrize(
    ("meta", "pattern"),
    [
        ({"n": 10**5000}, r"meta\['n'\] is an integer of more than 4300 digits"),
        (
            {"deep": __import__("functools").reduce(lambda x, _: [x], range(5000), 0)},
            "nested more than 200 levels",
        ),
    ],
)
def test_meta_json_readers_refuse_is_refused_by_save(ckpt, mesh, meta, pattern):
    with jaxckpt.CheckpointManager(ckpt) as m:
        with pytest.raises(errors.UnsupportedValueError, match=pattern):
            m.save(3, state=state_at(mesh, 3), meta=meta)
        assert not (ckpt / "3").exists()


def test_restore_target_keys_that_collide_after_joining(ckpt, mesh):
    wanted = {
        "params.w": np.zeros((8, 8), np.float32),
        "params": {"w": np.zeros((8, 8), np.float32)},
    }
    with pytest.raises(
        errors.TreeMismatchError, match=r"\['params'\]\['w'\] and \['params.w'\] both stand for"
    ):
        jaxckpt.CheckpointManager(ckpt, read_only=True).restore(2, state=wanted, partial=True)


@pytest.mark.parametrize("mesh_arg", ["100000", "8x8x8x8x8x8x8x8", "9" * 5000])
def test_plan_bounds_the_mesh(pristine, mesh_arg):
    result = CliRunner().invoke(
        cli_main, ["plan", str(pristine), "--mesh", mesh_arg, "--axes", "data"]
    )
    assert result.exit_code == 2, result.output
    assert result.output.startswith("jaxckpt: error:") and len(result.output.splitlines()) == 1


# ---------------------------------------------------------------- a reader racing retention


def test_a_step_deleted_under_a_reader_is_restored_again_or_named(ckpt, mesh):
    """Another job's retention deletes the step being read: restore(step=None) reads the new
    latest step; an explicit step is a StepNotFoundError naming it, never a raw OS error."""
    deleted = threading.Event()

    def writer_deletes_first(read_arrays, info, item, requests):
        if not deleted.is_set():
            deleted.set()
            with jaxckpt.CheckpointManager(
                ckpt, retention=jaxckpt.RetentionPolicy(keep_last=1)
            ) as w:
                step = info.step + 1  # commits, then deletes the rest
                w.save(step, state=state_at(mesh, step))
        return read_arrays(info, item, requests)

    reader = faults.manager(
        ckpt, read_only=True, store=faults.store(read_arrays=writer_deletes_first)
    )
    restored = reader.restore(state=target(mesh))
    assert restored.step == 3
    assert np.asarray(restored.state["b"]).tolist() == [3.0] * 4

    deleted.clear()
    with pytest.raises(errors.StepNotFoundError, match=r"step 3 .* deleted while it was read"):
        reader.restore(3, state=target(mesh))


@pytest.mark.parametrize("name", ["0-of-1.json", "0-of-1.bin"])
def test_a_store_failing_under_a_read_is_no_damage_and_no_reason_to_pass_over(ckpt, mesh, name):
    # Before: the index's OSError was filed as "unreadable": CorruptCheckpointError, and
    # fallback=True silently restored step 1
    def failing(open_file, folder, rel, size=None):
        if rel == name and folder.parent.name == "2":
            raise ConnectionResetError(104, "Connection reset by peer")
        return open_file(folder, rel, size)

    reader = faults.manager(
        ckpt, read_only=True, verify_on_restore=False, store=faults.store(open_file=failing)
    )
    for fallback in (False, True):
        with pytest.raises(errors.RestoreError, match="Connection reset by peer") as raised:
            reader.restore(state=target(mesh), fallback=fallback)
        assert not isinstance(raised.value, errors.CorruptCheckpointError)
    reader.close()


# ------------------------------------------------------- the stress script's hostile trials


@pytest.mark.timeout(200)
@pytest.mark.parametrize("how", ["immutable", "interrupt"])
def test_a_process_exits_promptly_after_a_failed_or_interrupted_save(how):
    """Orbax's writer threads used to wait 300 s for a folder that a failed save never made,
    keeping the process alive past any preemption grace period (`chattr +i` on ext4)."""
    assert hostile.exit_after_failed_save(how, seed=0, timeout_s=10) is None


def test_ctrl_c_inside_wait_keeps_the_save_in_flight(ckpt, mesh):
    """A KeyboardInterrupt in wait() leaves the save in flight: close() still waits for it,
    applies retention, and would report its failure."""
    armed = threading.Event()

    def ctrl_c_once(wait):
        if armed.is_set():
            armed.clear()
            raise KeyboardInterrupt
        wait()

    m = faults.manager(
        ckpt,
        retention=jaxckpt.RetentionPolicy(keep_last=2),
        store=faults.store(wait=ctrl_c_once),
    )
    m.save(3, state=state_at(mesh, 3))
    armed.set()
    with pytest.raises(KeyboardInterrupt):
        m.wait()
    m.close()
    assert jaxckpt.CheckpointManager(ckpt, read_only=True).all_steps() == [2, 3]


def test_a_leftover_that_cannot_be_removed_does_not_stop_saves(ckpt, mesh, caplog):
    """Orbax removes unfinished saves at start-up; when it cannot (here an immutable file,
    in the stress trial a second writer still writing into it) saves go on and say so."""
    leftover = ckpt / "3.orbax-checkpoint-tmp"
    leftover.mkdir()
    (leftover / "stuck").write_text("x")
    subprocess.run(["chattr", "+i", str(leftover / "stuck")], check=True, timeout=30)
    try:
        with jaxckpt.CheckpointManager(ckpt) as m:
            m.save(4, state=state_at(mesh, 4))
            m.save(5, state=state_at(mesh, 5))
        assert jaxckpt.CheckpointManager(ckpt, read_only=True).all_steps() == [1, 2, 4, 5]
        assert "could not remove an unfinished save's leftovers" in caplog.text
    finally:  # (set aside as 3.orbax-checkpoint-tmp.jaxckpt-deleting before the removal)
        for stuck in ckpt.glob("3.orbax-checkpoint-tmp*/stuck"):
            subprocess.run(["chattr", "-i", str(stuck)], check=True, timeout=30)


def test_reading_a_directory_that_is_not_there(tmp_path):
    missing = tmp_path / "nowhere"
    for call in (
        lambda: jaxckpt.CheckpointManager(missing, read_only=True),
        lambda: jaxckpt.verify(missing),
        lambda: jaxckpt.export_safetensors(missing, tmp_path / "hf"),
    ):
        with pytest.raises(errors.NoCheckpointError, match="nowhere does not exist"):
            call()
    assert not missing.exists()

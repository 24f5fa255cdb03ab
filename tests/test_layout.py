"""How a checkpoint directory is listed (its layout: `docs/layout.md`), as users'
directories are: many steps, stray and hostile step folders, nothing readable. jaxckpt lists a directory itself (`_listing.Listing`),
never through Orbax's listing, which read every step's metadata."""

import logging
import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from click.testing import CliRunner

import jaxckpt
from jaxckpt.cli import main
from jaxckpt.errors import NoCheckpointError


def save(directory, *steps):
    with jaxckpt.CheckpointManager(directory) as m:
        for step in steps:
            m.save(step, state={"w": jnp.full(4, float(step))})


@pytest.fixture
def ckpt(tmp_path):
    """Steps 1 and 2, each with its meta."""
    directory = tmp_path / "ckpt"
    with jaxckpt.CheckpointManager(directory) as m:
        for step in (1, 2):
            m.save(step, state={"w": jnp.full(4, float(step))}, meta={"step": step})
    return directory


def stray(directory, name, metadata):
    """A step-like folder holding only an Orbax step-metadata file (`metadata`, its text)."""
    (directory / name).mkdir()
    (directory / name / "_CHECKPOINT_METADATA").write_text(metadata)


@pytest.mark.parametrize(
    "metadata",
    ["[1, 2, 3]", "[" * 100_000 + "]" * 100_000, "not json"],
    ids=["list", "deep", "text"],
)
def test_one_stray_folder_is_named_and_the_rest_works(tmp_path, metadata, caplog):
    """A folder `7/` whose `_CHECKPOINT_METADATA` Orbax cannot read made opening a writer,
    every restore and `jaxckpt ls` fail with Orbax's bare ValueError (RecursionError)."""
    directory = tmp_path / "ckpt"
    save(directory, 1, 2)
    stray(directory, "7", metadata)
    with (
        caplog.at_level(logging.WARNING, logger="jaxckpt"),
        jaxckpt.CheckpointManager(directory) as m,
    ):
        assert m.latest_step() == 2 and m.all_steps() == [1, 2]
        restored = m.restore(state={"w": np.zeros(4, np.float32)})
        assert restored.step == 2 and restored.state["w"].tolist() == [2.0] * 4
        m.save(3, state={"w": jnp.ones(4)})
    assert "step folder '7' cannot be read: no Orbax pytree item" in caplog.text
    result = CliRunner().invoke(main, ["ls", str(directory)])
    assert result.exit_code == 0, result.output
    assert "7: not a step jaxckpt can read" in result.output
    assert (directory / "7" / "_CHECKPOINT_METADATA").read_text() == metadata  # untouched


def test_a_writer_that_finds_only_unreadable_step_folders_says_a_resume_starts_over(
    tmp_path, caplog
):
    directory = tmp_path / "ckpt"
    directory.mkdir()
    stray(directory, "checkpoint_3000", "{}")
    (directory / "5").mkdir()
    (directory / "5" / "jaxckpt").mkdir()  # a damaged jaxckpt step
    with (
        caplog.at_level(logging.WARNING, logger="jaxckpt"),
        jaxckpt.CheckpointManager(directory) as m,
    ):
        assert m.latest_step() is None
        assert m.latest_step() is None  # logged once, not at every call
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 3, warnings
    assert "step folder 'checkpoint_3000' cannot be read: no Orbax pytree item" in warnings[0]
    assert "step folder 5 cannot be read: damaged: jaxckpt/jaxckpt.json is missing" in warnings[1]
    assert "latest_step() is None, and a run that resumes from it starts over" in warnings[2]
    with pytest.raises(NoCheckpointError, match="checkpoint_3000: no Orbax pytree item"):
        jaxckpt.CheckpointManager(directory, read_only=True).restore()


def test_a_hostile_folder_name_is_logged_escaped(tmp_path, caplog):
    directory = tmp_path / "ckpt"
    directory.mkdir()
    stray(directory, "x\x1b]0;pwned\x07_9", "{}")
    with caplog.at_level(logging.WARNING, logger="jaxckpt"):
        assert jaxckpt.CheckpointManager(directory, read_only=True).latest_step() is None
    assert "\x1b" not in caplog.text and "\x07" not in caplog.text
    assert r"'x\x1b]0;pwned\x07_9'" in caplog.text


def test_latest_step_looks_only_down_to_the_newest_committed_step(tmp_path, caplog):
    """At 10,000 steps, opening a manager took 34 s and latest_step() 17 s (Orbax's
    listing). Now opening and latest_step() look into the folders from the newest down to
    the newest committed one: unreadable folders below it are not even looked at (no
    warning), while all_steps() and restore(fallback=True) still see them."""
    directory = tmp_path / "ckpt"
    save(directory, 1)
    for step in range(2, 401):  # the same step, 400 times, as links to its files
        shutil.copytree(directory / "1", directory / str(step), copy_function=os.link)
    stray(directory, "0", "[1]")
    stray(directory, "ckpt_401", "[1]")  # above the newest: met, and named
    with (
        caplog.at_level(logging.WARNING, logger="jaxckpt"),
        jaxckpt.CheckpointManager(directory) as m,
    ):
        assert m.latest_step() == 400
        assert "'ckpt_401' cannot be read" in caplog.text
        assert "'0' cannot be read" not in caplog.text
        assert m.restore(state={"w": np.zeros(4, np.float32)}).step == 400
        assert "'0' cannot be read" not in caplog.text
        assert m.all_steps() == list(range(1, 401))
        assert m.restore(state={"w": np.zeros(4, np.float32)}, fallback=True).step == 400
        assert "'0' cannot be read" in caplog.text
        m.save(401, state={"w": jnp.ones(4)})
    assert jaxckpt.CheckpointManager(directory, read_only=True).latest_step() == 401


@pytest.mark.parametrize("garbage", [b"0123456789", b"[1, 2]", b"{" * 50_000, b""])
def test_a_checkpoint_folder_whose_tree_metadata_is_garbage_is_never_the_latest_step(
    tmp_path, caplog, garbage
):
    """A `checkpoint_<N>` folder holding a 10-byte `_METADATA` counted as the newest
    committed step: latest_step() named it, a resumed writer started at N + 1, and its
    restore raised. Now the newest step is read before it is named (its tree metadata,
    O(1) reads): the folder is logged as damaged, passed over, and never resumed from."""
    from flax.training import checkpoints

    directory = tmp_path / "ckpt"
    checkpoints.save_checkpoint(directory, {"w": np.full(4, 1.0)}, step=1)
    checkpoints.save_checkpoint(directory, {"w": np.full(4, 2.0)}, step=2, keep=3)
    (directory / "checkpoint_9").mkdir()
    (directory / "checkpoint_9" / "_METADATA").write_bytes(garbage)
    target = {"w": np.zeros(4)}
    with caplog.at_level(logging.WARNING, logger="jaxckpt"):
        reader = jaxckpt.CheckpointManager(directory, read_only=True)
        assert reader.latest_step() == 2
        assert "'checkpoint_9' cannot be read" not in caplog.text  # a damaged step: by number
        assert "step folder 9 cannot be read: damaged: checkpoint_9: _METADATA" in caplog.text
        assert reader.restore(state=target).state["w"].tolist() == [2.0] * 4
        assert reader.restore(state=target, fallback=True).step == 2
        assert reader.all_steps() == [1, 2]
        with pytest.raises(jaxckpt.errors.CorruptCheckpointError, match="checkpoint_9: _METAD"):
            reader.restore(9, state=target)
    result = CliRunner().invoke(main, ["ls", str(directory)])
    assert result.exit_code == 0 and "damaged" in result.output, result.output


def test_a_jaxckpt_step_whose_metadata_is_garbage_is_never_the_latest_step(ckpt, caplog):
    """The same for a jaxckpt step: its jaxckpt.json unreadable, the step before it is the
    latest, and a writer resumes from it (the damaged folder is never saved over)."""
    (ckpt / "2" / "jaxckpt" / "jaxckpt.json").write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="jaxckpt"), jaxckpt.CheckpointManager(ckpt) as m:
        assert m.latest_step() == 1 and m.all_steps() == [1]
        assert "step folder 2 cannot be read: damaged: jaxckpt/jaxckpt.json is unreadable" in (
            caplog.text
        )
        assert m.restore(state={"w": np.zeros(4, np.float32)}).step == 1
        with pytest.raises(jaxckpt.errors.StepExistsError):
            m.save(2, state={"w": jnp.ones(4)})
        m.save(3, state={"w": jnp.ones(4)})
        m.wait()
        assert m.latest_step() == 3


def test_a_flax_folder_below_the_newest_step_is_never_saved_beside(tmp_path):
    """Saving a step whose number a `checkpoint_<step>` folder of plain Orbax holds (below
    the newest step, which opening did not look into) is refused, as at the newest."""
    from flax.training import checkpoints

    directory = tmp_path / "ckpt"
    checkpoints.save_checkpoint(directory, {"w": np.ones(2)}, step=5)
    save(directory, 9)
    with jaxckpt.CheckpointManager(directory) as m:
        with pytest.raises(jaxckpt.errors.StepExistsError, match="plain Orbax wrote"):
            m.save(5, state={"w": jnp.ones(4)})
        assert m.all_steps() == [5, 9]


@pytest.mark.parametrize("name", ["²", "①", "٣", "00002", "+2", " 2"])
def test_folders_that_only_look_like_steps_are_ignored(ckpt, name):
    if name == "00002":
        shutil.copytree(ckpt / "2", ckpt / name)
    else:
        (ckpt / name).mkdir()
    reader = jaxckpt.CheckpointManager(ckpt, read_only=True)
    assert reader.all_steps() == [1, 2]
    assert reader.restore(fallback=True).step == 2
    assert reader.meta() == {"step": 2}
    assert [r.step for r in jaxckpt.verify(ckpt)] == [1, 2]
    assert all(r.ok for r in jaxckpt.verify(ckpt))
    result = CliRunner().invoke(main, ["ls", str(ckpt)])
    assert result.exit_code == 0 and "damaged" not in result.output, result.output


def test_step_like_folders_nobody_can_read_are_named_with_why(tmp_path):
    directory = tmp_path / "run"
    (directory / "ckpt_3").mkdir(parents=True)
    (directory / "ckpt_3" / "notes.txt").write_text("x")
    (directory / "ckpt_4").mkdir()
    with pytest.raises(NoCheckpointError, match=r"ckpt_3: no Orbax pytree item.*notes\.txt"):
        jaxckpt.CheckpointManager(directory, read_only=True).restore()
    result = CliRunner().invoke(main, ["ls", str(directory)])
    assert "ckpt_3: not a step jaxckpt can read" in result.output
    assert "ckpt_4: not a step jaxckpt can read" in result.output

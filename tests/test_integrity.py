"""Integrity: manifests, verify, corruption detected by verify and by restore, one writer."""

import json
import logging
import re

import numpy as np
import pytest
from children.spread import io_counts
from click.testing import CliRunner

import jaxckpt
from conftest import Iterator
from jaxckpt import errors
from jaxckpt.cli import main
from reliability.faults import CORRUPTIONS, flip_byte, flip_middle_byte, largest_data_file

BIG = np.random.default_rng(0).standard_normal(256 * 1024).astype(np.float32)  # 1 MiB


@pytest.fixture
def two_steps(ckpt_dir):
    with jaxckpt.CheckpointManager(ckpt_dir) as m:
        for step in (1, 2):
            m.save(step, state={"w": BIG + step, "b": np.ones(3) * step}, data=Iterator(step))
    return ckpt_dir


def test_every_committed_step_carries_a_manifest_that_verifies(two_steps):
    reports = jaxckpt.verify(two_steps)
    assert [(r.step, r.ok) for r in reports] == [(1, True), (2, True)]
    manifest = json.loads((two_steps / "2" / "jaxckpt" / "manifest.json").read_text())
    assert manifest["hash"].startswith("xxh3_128")
    listed = set(manifest["files"])
    on_disk = {
        str(p.relative_to(two_steps / "2")) for p in (two_steps / "2").rglob("*") if p.is_file()
    }
    # Everything but the manifest itself and Orbax's own commit files is covered.
    assert on_disk - listed == {
        "jaxckpt/manifest.json",
        "_CHECKPOINT_METADATA",
        "commit_success.txt",
    }
    # verify read every listed byte; the array data is in there.
    assert reports[1].bytes == sum(f["size"] for f in manifest["files"].values()) > BIG.nbytes / 2
    proc = CliRunner().invoke(main, ["verify", str(two_steps)])  # as `jaxckpt verify` runs
    assert proc.exit_code == 0, proc.output
    assert proc.stdout.splitlines()[0].startswith("step 1: ok (")


@pytest.mark.parametrize("corrupt", CORRUPTIONS.values(), ids=CORRUPTIONS.keys())
def test_corruption_is_detected_by_verify_and_restore(two_steps, corrupt, caplog):
    expected = corrupt(two_steps)
    # verify: step 2 named with the file and what is wrong; step 1 fine; exit code 1.
    reports = {r.step: r for r in jaxckpt.verify(two_steps)}
    assert reports[1].ok and not reports[2].ok
    assert any(__import__("re").search(expected, p) for p in reports[2].problems), reports[
        2
    ].problems
    proc = CliRunner().invoke(main, ["verify", str(two_steps)])
    assert proc.exit_code == 1 and "step 2: CORRUPT" in proc.stdout
    assert "1 of 2 steps failed verification: [2]" in proc.stderr

    target = {"w": np.zeros_like(BIG), "b": np.zeros(3)}
    with jaxckpt.CheckpointManager(two_steps, read_only=True) as m:
        with pytest.raises(
            errors.CorruptCheckpointError, match=r"step 2 .* is corrupt: " + expected
        ):
            m.restore(2, state=target)
        with caplog.at_level(logging.WARNING, logger="jaxckpt"):
            it = Iterator()
            restored = m.restore(state=target, data=it, fallback=True)
        assert restored.step == 1 and it.position == 1
        np.testing.assert_array_equal(restored.state["w"], BIG + 1)
    assert re.search(r"step (folder )?2", caplog.text)  # the skip or the damaged folder, logged


def test_without_fallback_the_latest_corrupt_step_is_an_error(two_steps):
    flip_byte(two_steps)
    with (
        jaxckpt.CheckpointManager(two_steps, read_only=True) as m,
        pytest.raises(errors.CorruptCheckpointError, match="fallback=True"),
    ):
        m.restore(state={"w": np.zeros_like(BIG), "b": np.zeros(3)})


def test_a_save_hashes_its_packed_file_as_it_writes_it_never_reading_it_back(ckpt_dir):
    # 16 MiB of small leaves in one packed file: its manifest digest is made from the bytes
    # as they are written (on object storage, reading it back was a download of the file).
    rng = np.random.default_rng(2)
    state = {f"s{i}": rng.standard_normal(128 * 1024).astype(np.float32) for i in range(32)}
    with jaxckpt.CheckpointManager(ckpt_dir) as m:
        before = io_counts()["rchar"]
        m.save(1, state=state)
        m.wait()
        read = io_counts()["rchar"] - before
    assert read < 2**20, read
    assert [r.ok for r in jaxckpt.verify(ckpt_dir)] == [True]


@pytest.mark.parametrize("where", ["state", "packed"], ids=["orbax-array", "packed-leaves"])
def test_a_verified_restore_reads_each_byte_once_and_still_names_a_damaged_file(ckpt_dir, where):
    # 8 MiB in one Orbax array, 2 MiB in small (packed) leaves: every byte checked as it is
    # read (chunk CRC-32Cs, piece digests), none read a second time to hash the files.
    rng = np.random.default_rng(1)
    state = {"w": rng.standard_normal((1024, 2048)).astype(np.float32)}
    state |= {f"s{i}": rng.standard_normal(64 * 1024).astype(np.float32) for i in range(8)}
    size = sum(v.nbytes for v in state.values())
    with jaxckpt.CheckpointManager(ckpt_dir, incremental=False) as m:  # `w` an Orbax array
        for step in (1, 2):
            m.save(step, state={k: v + step for k, v in state.items()})
    target = {k: np.zeros_like(v) for k, v in state.items()}
    with jaxckpt.CheckpointManager(ckpt_dir, read_only=True) as m:
        before = io_counts()["rchar"]
        restored = m.restore(2, state=target)
        read = io_counts()["rchar"] - before
    assert size <= read <= 1.1 * size, read / size
    np.testing.assert_array_equal(restored.state["w"], state["w"] + 2)

    victim = largest_data_file(ckpt_dir / "2", within=(where,))
    flip_middle_byte(victim)
    rel = re.escape(str(victim.relative_to(ckpt_dir / "2")))
    with jaxckpt.CheckpointManager(ckpt_dir, read_only=True) as m:
        with pytest.raises(errors.CorruptCheckpointError, match=rel + ": contents changed"):
            m.restore(2, state=target)
        assert m.restore(state=target, fallback=True).step == 1

"""A step copied to stand alone (`jaxckpt.copy_step`, `jaxckpt copy`): an incremental step's
shared pieces copied into its own folder, every byte checked, the copy restoring bitwise
where the steps it shared bytes with are gone; local and on object storage, either way; a
step plain Orbax wrote as it is; damage, an absent owner and an occupied output refused
leaving no step behind."""

import json
import os
import shutil

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from click.testing import CliRunner
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from jaxckpt.cli import main
from jaxckpt.errors import (
    ConfigError,
    CorruptCheckpointError,
    IncompleteStepError,
    OutputExistsError,
)

CODECS = pytest.mark.parametrize("compression", [None, "zstd"], ids=["raw", "zstd"])


def _state(mesh, step):
    """A frozen base (the same arrays at every step: shared by later steps) and a small
    leaf that changes."""
    rng = np.random.default_rng(0)
    sharding = NamedSharding(mesh, P("data", "model"))
    base = rng.standard_normal((1024, 512), np.float32)  # 2 MiB: shared by later steps
    return {
        "base": jax.device_put(base, sharding),
        "small": jax.device_put(np.full((64, 64), step, np.float32), sharding),
        "count": np.int32(step),
    }


def _save(mesh, directory, steps=3, **options):
    saved = {}
    with jaxckpt.CheckpointManager(directory, **options) as m:
        base = _state(mesh, 0)["base"]
        for step in range(1, steps + 1):
            saved[step] = dict(_state(mesh, step), base=base)
            m.save(step, state=saved[step], rng=jax.random.key(step), meta={"step": step})
            m.wait()
    return saved


def _assert_restores(directory, step, state):
    with jaxckpt.open(directory) as ckpt:
        restored = ckpt.read(step)
    assert restored.step == step and restored.meta == {"step": step}
    for name, value in state.items():
        assert np.asarray(restored.state[name]).tobytes() == np.asarray(value).tobytes(), name
    want = jax.random.key_data(jax.random.key(step))
    assert np.asarray(jax.random.key_data(restored.rng)).tobytes() == np.asarray(want).tobytes()


def _shares(directory, step):
    return json.loads((directory / str(step) / "jaxckpt" / "shares.json").read_text())["steps"]


@CODECS
def test_a_copied_step_stands_alone_bitwise_and_a_run_resumes_from_it(mesh, tmp_path, compression):
    source, out = tmp_path / "run", tmp_path / "published"
    saved = _save(mesh, source, compression=compression)
    assert _shares(source, 3) == [1]  # step 3's base is step 1's bytes
    assert jaxckpt.copy_step(source, out) == 3  # the latest
    shutil.rmtree(source)  # the steps it shared bytes with gone
    assert sorted(os.listdir(out)) == [".jaxckpt-writer.lock", "3"]
    assert _shares(out, 3) == []
    _assert_restores(out, 3, saved[3])
    assert [(r.step, r.ok) for r in jaxckpt.verify(out)] == [(3, True)]
    listing = json.loads(CliRunner().invoke(main, ["ls", str(out), "--verify", "--json"]).output)
    assert [(s["step"], s["status"]) for s in listing["steps"]] == [(3, "verified")]
    # a run resumes there: its next save refers to the copy's pieces
    with jaxckpt.CheckpointManager(out, compression=compression) as m:
        restored = m.restore(state=saved[3], rng=jax.random.key(0))  # onto the same shards
        m.save(4, state=dict(restored.state, count=np.int32(4)), rng=restored.rng)
    assert _shares(out, 4) == [3]
    with jaxckpt.open(out) as ckpt:
        again = ckpt.read(4).state
    assert np.asarray(again["base"]).tobytes() == np.asarray(saved[3]["base"]).tobytes()


def test_each_step_copies_into_one_directory_and_a_step_there_is_never_replaced(mesh, tmp_path):
    source, out = tmp_path / "run", tmp_path / "out"
    saved = _save(mesh, source)
    for step in (3, 1, 2):
        assert jaxckpt.copy_step(source, out, step=step) == step
    before = {f: (out / "2" / f).read_bytes() for f in ("jaxckpt/manifest.json",)}
    with pytest.raises(OutputExistsError, match=r"out/2 exists: .*jaxckpt rm"):
        jaxckpt.copy_step(source, out, step=2)
    assert {f: (out / "2" / f).read_bytes() for f in before} == before
    shutil.rmtree(source)
    for step in (1, 2, 3):
        _assert_restores(out, step, saved[step])
        assert _shares(out, step) == []


def test_a_damaged_shared_piece_is_refused_and_no_step_is_left(mesh, tmp_path):
    source, out = tmp_path / "run", tmp_path / "out"
    _save(mesh, source)
    data = source / "1" / "packed" / "0-of-1.bin"  # the base's bytes, which step 3 shares
    raw = bytearray(data.read_bytes())
    raw[100] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(CorruptCheckpointError, match="do not match their checksum"):
        jaxckpt.copy_step(source, out, step=3)
    assert os.listdir(out) == [".jaxckpt-writer.lock"]  # no step, no half-written folder


def test_a_changed_file_of_the_step_itself_is_refused(mesh, tmp_path):
    source, out = tmp_path / "run", tmp_path / "out"
    _save(mesh, source)
    info = source / "3" / "jaxckpt" / "jaxckpt.json"
    info.write_text(info.read_text().replace('"step": 3', '"step":  3'))
    with pytest.raises(CorruptCheckpointError, match=r"jaxckpt\.json: contents changed"):
        jaxckpt.copy_step(source, out, step=3)
    assert os.listdir(out) == [".jaxckpt-writer.lock"]


def test_a_step_copied_without_its_owner_is_incomplete_and_the_output_must_not_overlap(
    mesh, tmp_path
):
    source, alone = tmp_path / "run", tmp_path / "alone"
    _save(mesh, source)
    shutil.copytree(source / "3", alone / "3")  # what `cp -r run/3 alone/` makes
    with pytest.raises(IncompleteStepError, match="jaxckpt copy"):
        jaxckpt.copy_step(alone, tmp_path / "out")
    with pytest.raises(ConfigError, match="overlaps"):
        jaxckpt.copy_step(source, source / "inside")


def test_a_step_plain_orbax_wrote_is_copied_as_it_is(tmp_path):
    source, out = tmp_path / "orbax", tmp_path / "out"
    state = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.ones(4, np.int32)}
    with ocp.CheckpointManager(source) as m:
        m.save(5, args=ocp.args.StandardSave(state))
    assert jaxckpt.copy_step(source, out) == 5
    files = {p.relative_to(source / "5") for p in (source / "5").rglob("*") if p.is_file()}
    assert files == {p.relative_to(out / "5") for p in (out / "5").rglob("*") if p.is_file()}
    for rel in files:
        assert (out / "5" / rel).read_bytes() == (source / "5" / rel).read_bytes(), rel
    with ocp.CheckpointManager(out) as m:
        restored = m.restore(5, args=ocp.args.StandardRestore(state))
    for name, value in state.items():
        np.testing.assert_array_equal(restored[name], value)


def test_copy_to_and_from_object_storage(mesh, bucket_dir, tmp_path):
    saved = _save(mesh, tmp_path / "run")
    remote = f"{bucket_dir}-copy"
    result = CliRunner().invoke(main, ["copy", str(tmp_path / "run"), remote, "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output) == {"step": 3, "out_dir": remote}
    shutil.rmtree(tmp_path / "run")
    _assert_restores(remote, 3, saved[3])
    back = tmp_path / "back"
    assert jaxckpt.copy_step(remote, back) == 3
    _assert_restores(back, 3, saved[3])
    assert [(r.step, r.ok) for r in jaxckpt.verify(remote)] == [(3, True)]


def test_the_command_says_what_it_copied_and_refuses_in_one_line(mesh, tmp_path):
    _save(mesh, tmp_path / "run", steps=2)
    runner = CliRunner()
    done = runner.invoke(main, ["copy", str(tmp_path / "run"), str(tmp_path / "out")])
    assert (
        done.exit_code == 0 and done.output == f"copied step 2 to {tmp_path}/out, standing alone\n"
    )
    again = runner.invoke(main, ["copy", str(tmp_path / "run"), str(tmp_path / "out")])
    assert again.exit_code == 1
    assert again.output.startswith("jaxckpt: error: ") and again.output.count("\n") == 1
    missing = runner.invoke(
        main, ["copy", str(tmp_path / "run"), str(tmp_path / "x"), "--step", "7"]
    )
    assert missing.exit_code == 1 and "step 7" in missing.output

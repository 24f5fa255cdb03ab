"""Incremental steps (`incremental=True`, `jaxckpt._incremental`): a save writes only the
pieces whose bytes changed since the newest committed step; restore, resharding, retention,
verify and hostile indexes of steps that refer to earlier bytes.

A fine-tune-like state: a frozen base of four 4 MiB leaves (sharded over the (4, 2) mesh:
eight pieces each) and small adapters that change at every save. With compression="zstd"
each piece is a zstd frame (`jaxckpt._codec`): the same cases hold, and what is special to
frames (their stored sizes, hostile frames, a restart with the other codec) is tested here."""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from children import incremental_job
from click.testing import CliRunner
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from multihost import one_job_at_a_time, run_job

import jaxckpt
from conftest import run_python
from jaxckpt.cli import main
from jaxckpt.errors import ConfigError, CorruptCheckpointError

BASE_BYTES = 4 * 4 * 2**20


def _base(mesh):
    rng = np.random.default_rng(0)
    sharding = NamedSharding(mesh, P("data", "model"))
    return {
        f"b{i}": jax.device_put(rng.standard_normal((1024, 1024), np.float32), sharding)
        for i in range(4)
    }


def _adapters(mesh, step):
    sharding = NamedSharding(mesh, P("data", "model"))
    a = jnp.full((64, 64), float(step), jnp.float32)
    return {"a": jax.device_put(a, sharding), "count": jnp.asarray(step)}


def _own_bytes(ckpt_dir, step):
    """The bytes of a step's own packed data files."""
    folder = ckpt_dir / str(step) / "packed"
    return sum(f.stat().st_size for f in folder.iterdir() if f.suffix == ".bin")


def _shares(ckpt_dir, step):
    return json.loads((ckpt_dir / str(step) / "jaxckpt" / "shares.json").read_text())["steps"]


def _saved(mesh, ckpt_dir, steps=3, *, fresh_arrays=False, **kwargs):
    base = _base(mesh)
    with jaxckpt.CheckpointManager(ckpt_dir, incremental=True, **kwargs) as m:
        for step in range(steps):
            frozen = {k: v * 1.0 for k, v in base.items()} if fresh_arrays else base
            m.save(step, state={"base": frozen, "adapters": _adapters(mesh, step)})
            m.wait()
    return base


def _assert_bitwise(got, want):
    for k, v in want.items():
        assert np.asarray(got[k]).tobytes() == np.asarray(v).tobytes(), k


def _first_step_bytes(compression):
    """The bounds of step 0's own bytes: the base raw, or compressed (random normal float32:
    zstd takes ~7.4% off)."""
    fractions = (1, 1.01) if compression is None else (0.88, 0.96)
    return fractions[0] * BASE_BYTES, fractions[1] * BASE_BYTES


CODECS = pytest.mark.parametrize("compression", [None, "zstd"], ids=["raw", "zstd"])


@CODECS
@pytest.mark.parametrize("fresh_arrays", [False, True], ids=["same arrays", "same bytes"])
def test_a_later_step_writes_only_what_changed(mesh, ckpt_dir, fresh_arrays, compression):
    # the same jax.Array objects (an NNX model's frozen Params), or new arrays of the same
    # bytes (a Linen fine-tune whose optax.multi_transform zeroes the base's updates)
    _saved(mesh, ckpt_dir, fresh_arrays=fresh_arrays, compression=compression)
    low, high = _first_step_bytes(compression)
    assert low < _own_bytes(ckpt_dir, 0) < high
    for step in (1, 2):
        assert _own_bytes(ckpt_dir, step) < 20_000  # the adapters: 16 KiB and a count
        assert _shares(ckpt_dir, step) == [0]  # the base's bytes, where step 0 wrote them


def test_a_changed_leaf_is_written_again(mesh, ckpt_dir):
    base = _base(mesh)
    with jaxckpt.CheckpointManager(ckpt_dir, incremental=True) as m:
        m.save(0, state={"base": base})
        m.wait()
        base = dict(base, b2=base["b2"].at[0, 0].add(1.0))  # one piece of one leaf changed
        m.save(1, state={"base": base})
        m.wait()
        restored = m.restore(1, state={"base": base}).state["base"]
    assert 512 * 1024 <= _own_bytes(ckpt_dir, 1) < 600_000  # that one piece (an eighth)
    _assert_bitwise(restored, base)


@CODECS
def test_a_step_sharing_bytes_restores_bitwise_in_a_fresh_process_on_another_mesh(
    mesh, ckpt_dir, compression
):
    base = _saved(mesh, ckpt_dir, compression=compression)
    np.savez(ckpt_dir.parent / "want.npz", **{k: np.asarray(v) for k, v in base.items()})
    code = f"""
import jax, numpy as np, jaxckpt
from jax.sharding import NamedSharding, PartitionSpec as P
jax.config.update("jax_num_cpu_devices", 8)
mesh = jax.make_mesh((2, 4), ("data", "model"))
want = np.load({str(ckpt_dir.parent / "want.npz")!r})
m = jaxckpt.CheckpointManager({str(ckpt_dir)!r}, read_only=True)
target = {{k: jax.ShapeDtypeStruct(want[k].shape, want[k].dtype,
           sharding=NamedSharding(mesh, P("data", "model"))) for k in want.files}}
got = m.restore(2, state={{"base": target}}, partial=True).state["base"]
assert all(np.asarray(got[k]).tobytes() == want[k].tobytes() for k in want.files)
assert got["b0"].sharding.mesh.shape == {{"data": 2, "model": 4}}
print("bitwise")
"""
    assert "bitwise" in run_python("-c", code).stdout


def test_retention_keeps_the_steps_a_kept_step_shares_bytes_with(mesh, ckpt_dir):
    base = _saved(mesh, ckpt_dir, steps=5, retention=jaxckpt.RetentionPolicy(keep_last=2))
    with jaxckpt.CheckpointManager(ckpt_dir, incremental=True) as m:
        assert m.all_steps() == [3, 4]  # step 0 retired: out of the listing, kept
        assert (ckpt_dir / "0").is_dir() and (ckpt_dir / "0.jaxckpt-retired").exists()
        assert not (ckpt_dir / "1").exists()  # held no byte a kept step uses
        _assert_bitwise(m.restore(3, state={"base": base}, partial=True).state["base"], base)
        assert all(r.ok for r in jaxckpt.verify(ckpt_dir))
        m.delete(3)
        assert (ckpt_dir / "0").is_dir()  # step 4 still shares its bytes
        m.delete(4)
        m.close()
    assert sorted(p.name for p in ckpt_dir.iterdir() if not p.name.startswith(".")) == []


def test_ls_shows_each_steps_own_bytes_what_it_shares_and_why_a_step_is_kept(mesh, ckpt_dir):
    _saved(mesh, ckpt_dir, steps=4, retention=jaxckpt.RetentionPolicy(keep_last=2))
    result = CliRunner().invoke(main, ["ls", "--json", "--verify", str(ckpt_dir)])
    assert result.exit_code == 0, result.output
    rows = {r["step"]: r for r in json.loads(result.output)["steps"]}
    assert rows[0]["status"] == "retired: kept for step(s) 2, 3"
    assert rows[0]["bytes"] > BASE_BYTES
    for step in (2, 3):
        assert rows[step]["status"] == "verified; shares bytes with step(s) 0"
        assert rows[step]["shares"] == [0] and rows[step]["bytes"] < 64 * 1024
    assert 1 not in rows  # deleted: it held no byte a kept step uses
    result = CliRunner().invoke(main, ["rm", str(ckpt_dir), "2"])
    assert result.exit_code == 0, result.output
    assert "deleted step 2" in result.output  # no kept step shares its bytes
    assert (ckpt_dir / "0").is_dir()  # step 3 still shares step 0's


def _flip(ckpt_dir, step):
    """One byte of the base's first piece in step `step`'s own data file flipped (raw or a
    zstd frame: its stored bytes)."""
    place = _first_piece(_index(ckpt_dir, step)[1])[0]  # offset, or [offset, stored]
    at = (place[0] if isinstance(place, list) else place) + 1000
    with open(ckpt_dir / str(step) / "packed" / "0-of-1.bin", "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))


@CODECS
def test_a_damaged_shared_file_is_reported_for_every_step_that_uses_it(mesh, ckpt_dir, compression):
    _saved(mesh, ckpt_dir, compression=compression)
    _flip(ckpt_dir, 0)  # in the base's bytes
    reports = {r.step: r for r in jaxckpt.verify(ckpt_dir)}
    assert "packed/0-of-1.bin: contents changed" in " ".join(reports[0].problems)
    for step in (1, 2):
        (problem,) = reports[step].problems
        assert "shared with step 0" in problem and "0/packed/0-of-1.bin" in problem
    base = _base(mesh)
    with jaxckpt.CheckpointManager(ckpt_dir, read_only=True, verify_on_restore=False) as m:
        for target in (None, {"base": base}):  # to the host; shard by shard onto devices
            with pytest.raises(CorruptCheckpointError, match=r"0/packed/0-of-1\.bin"):
                m.restore(2, state=target, partial=target is not None)


def _index(ckpt_dir, step):
    """A step's packed index: its path and its document."""
    path = ckpt_dir / str(step) / "packed" / "0-of-1.json"
    return path, json.loads(path.read_text())


def _first_piece(doc):
    return doc["leaves"]["state"]["base.b0"]["pieces"][0]


def _edit_index(ckpt_dir, step, edit, **fields):
    """`edit` of the first piece of base.b0 in the step's index; its `fields` set (None:
    dropped)."""
    path, doc = _index(ckpt_dir, step)
    edit(_first_piece(doc))
    for key, value in fields.items():
        doc.pop(key) if value is None else doc.__setitem__(key, value)
    path.write_text(json.dumps(doc))


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda p: p.__setitem__(3, 3), "not \\[offset"),  # a step later than its own
        (lambda p: p.__setitem__(4, "../../x.bin"), "not \\[offset"),  # out of the folder
        (lambda p: p.__setitem__(4, "7-of-8.bin"), "is missing"),  # no such file there
        (lambda p: p.__setitem__(0, 2**40), "fewer than"),  # past the file's end
    ],
    ids=["later step", "path", "absent file", "past the end"],
)
def test_a_hostile_reference_is_a_corrupt_checkpoint(mesh, ckpt_dir, edit, match):
    _saved(mesh, ckpt_dir)
    _edit_index(ckpt_dir, 2, edit)
    with (
        jaxckpt.CheckpointManager(ckpt_dir, read_only=True, verify_on_restore=False) as m,
        pytest.raises(CorruptCheckpointError, match=match),
    ):
        m.restore(2)


def _frame_in_place(ckpt_dir, frame):
    """Step 0's first piece of base.b0 (512 KiB raw) replaced by `frame`, its stored size
    in the index made the frame's (it must fit where the piece was)."""

    def edit(piece):
        place = piece[0]
        assert len(frame) <= place[1]
        with open(ckpt_dir / "0" / "packed" / "0-of-1.bin", "r+b") as f:
            f.seek(place[0])
            f.write(frame)
        place[1] = len(frame)

    _edit_index(ckpt_dir, 0, edit)


def _zstd(data):
    import zstandard

    return zstandard.ZstdCompressor().compress(data)


def _wide():
    # a frame whose header asks for a 128 MiB window (zstd's own limit), its size unsaid
    import zstandard

    params = zstandard.ZstdCompressionParameters(window_log=27, write_content_size=False)
    stream = zstandard.ZstdCompressor(compression_params=params).compressobj()
    return stream.compress(bytes(1000)) + stream.flush()


def _bomb():
    import zstandard

    frame = zstandard.ZstdCompressor().compressobj(size=2**30)
    zeros = bytes(2**24)
    return b"".join([*(frame.compress(zeros) for _ in range(64)), frame.flush()])


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda d: _edit_index(d, 0, lambda p: None, codec="lz4"), "not an index of packed"),
        (lambda d: _edit_index(d, 0, lambda p: None, codec=None), "is not \\[offset"),
        (lambda d: _edit_index(d, 0, lambda p: p.__setitem__(0, p[0][0])), "stored bytes"),
        (lambda d: _edit_index(d, 0, lambda p: p[0].__setitem__(1, 2**40)), "past the file"),
        (
            lambda d: _edit_index(d, 0, lambda p: p[0].__setitem__(1, p[0][1] - 9)),
            "decompresses to",
        ),
        (lambda d: _frame_in_place(d, bytes(range(250)) * 4), "not a zstd frame"),
        (lambda d: _frame_in_place(d, _zstd(bytes(1000))), "to 1000 bytes, not"),
        (lambda d: _frame_in_place(d, _bomb()), "to more bytes, not the piece's 524288"),
        (lambda d: _frame_in_place(d, _wide()), "not a zstd frame jaxckpt wrote"),
        (lambda d: _frame_in_place(d, _zstd(bytes(2**19))), "checksum"),
    ],
    ids=[
        "unknown codec",
        "codec dropped",
        "offset alone",
        "stored past the end",
        "frame cut short",
        "not a frame",
        "frame of fewer bytes",
        "frame of a GiB",
        "window of 128 MiB",
        "other bytes",
    ],
)
def test_a_hostile_frame_or_codec_is_a_corrupt_checkpoint(mesh, ckpt_dir, edit, match):
    # every frame decoded into the piece's own bytes, never sized by what the frame claims
    _saved(mesh, ckpt_dir, steps=1, compression="zstd")
    edit(ckpt_dir)
    with jaxckpt.CheckpointManager(ckpt_dir, read_only=True, verify_on_restore=False) as m:
        for target in (None, {"base": _base(mesh)}):  # to the host; shard by shard onto devices
            with pytest.raises(CorruptCheckpointError, match=match):
                m.restore(0, state=target, partial=target is not None)


@CODECS
def test_a_restarted_job_writes_only_what_changed_since_the_newest_step(
    mesh, ckpt_dir, compression
):
    # a new process has no arrays of the last save: its base is its own index of the newest
    # committed step, and equal bytes are found by their XXH3-128s
    _saved(mesh, ckpt_dir, steps=2, compression=compression)
    base = _base(mesh)  # new arrays, the same bytes
    with jaxckpt.CheckpointManager(ckpt_dir, incremental=True, compression=compression) as m:
        m.save(2, state={"base": base, "adapters": _adapters(mesh, 2)})
        m.wait()
    assert _own_bytes(ckpt_dir, 2) < 2**20
    assert _shares(ckpt_dir, 2) == [0]
    with jaxckpt.CheckpointManager(ckpt_dir) as m:
        got = m.restore(2)
    _assert_bitwise(got.state["base"], base)
    _assert_bitwise(got.state["adapters"], _adapters(mesh, 2))


def _restarted_save_bytes(mesh, ckpt_dir, compression=None):
    with jaxckpt.CheckpointManager(ckpt_dir, incremental=True, compression=compression) as m:
        m.save(1, state={"base": _base(mesh), "adapters": _adapters(mesh, 1)})
        m.wait()
    return _own_bytes(ckpt_dir, 1)


def test_a_restarted_job_after_a_full_step_writes_every_piece(mesh, ckpt_dir):
    with jaxckpt.CheckpointManager(ckpt_dir, incremental=False) as m:  # format 2: no base
        m.save(0, state={"base": _base(mesh), "adapters": _adapters(mesh, 0)})
        m.wait()
    assert _restarted_save_bytes(mesh, ckpt_dir) > BASE_BYTES
    assert _shares(ckpt_dir, 1) == []


def test_a_restarted_job_never_refers_to_a_file_shorter_than_its_index_says(mesh, ckpt_dir):
    _saved(mesh, ckpt_dir, steps=1)
    data = ckpt_dir / "0" / "packed" / "0-of-1.bin"
    os.truncate(data, data.stat().st_size - 1)
    assert _restarted_save_bytes(mesh, ckpt_dir) > BASE_BYTES
    assert _shares(ckpt_dir, 1) == []


@pytest.mark.parametrize("before", [None, "zstd"], ids=["raw then zstd", "zstd then raw"])
def test_a_restarted_job_with_the_other_codec_writes_every_piece(mesh, ckpt_dir, before):
    # a piece is never referred to as stored otherwise than the index that names it says
    after = "zstd" if before is None else None
    _saved(mesh, ckpt_dir, steps=1, compression=before)
    assert _restarted_save_bytes(mesh, ckpt_dir, after) > _first_step_bytes(after)[0]
    assert _shares(ckpt_dir, 1) == []
    with jaxckpt.CheckpointManager(ckpt_dir, read_only=True) as m:
        for step in (0, 1):
            _assert_bitwise(m.restore(step).state["base"], _base(mesh))


def test_incremental_takes_no_option_that_keeps_leaves_out_of_the_packed_files(ckpt_dir):
    with pytest.raises(ConfigError, match="incremental=True packs every leaf"):
        jaxckpt.CheckpointManager(ckpt_dir, incremental=True, pack_small_leaves=False)
    assert not os.path.exists(ckpt_dir / "0")


@one_job_at_a_time
@CODECS
def test_two_processes_each_write_only_their_changed_pieces(tmp_path, compression):
    # each process decides for the pieces it writes (the replicated leaf's by one of them),
    # with no collective, after a restart too; the last step restores onto another mesh, each process checking
    # the shards it holds
    run = tmp_path / "run"
    args = {"dir": str(run), "compression": compression}
    results = run_job(incremental_job.save_three_then_restore, processes=2, devices=4, args=args)
    own = [r.report()["own_bytes"] for r in results]
    # step 0: the base's 6 MiB between them (zstd: ~7% less)
    assert sum(o[0] for o in own) > (6 if compression is None else 5.3) * 2**20
    # ... a half each: the replicated leaf too, cut in two (each process writes one)
    assert abs(own[0][0] - own[1][0]) < 2**20 / 4, own
    # step 3 by new managers (no base in memory): from each process's own index of step 2
    for later in (1, 2, 3):
        assert all(o[later] < 16_384 for o in own), own  # the adapter's 16 KiB, in halves
    for step in (2, 3):
        shares = json.loads((run / str(step) / "jaxckpt" / "shares.json").read_text())
        assert shares == {"steps": [0]}
    # the step copied to stand alone: each process's shared pieces into a file of its own,
    # each process's index and the merged one pointing there
    out = tmp_path / "published"
    assert jaxckpt.copy_step(run, out, step=3) == 3
    shutil.rmtree(run)
    assert sorted(os.listdir(out / "3" / "packed")) == [
        "0-of-2.1.bin", "0-of-2.bin", "0-of-2.json", "1-of-2.1.bin", "1-of-2.bin",
        "1-of-2.json", "commit_success.txt", "index.json",
    ]  # fmt: skip
    with jaxckpt.open(out) as ckpt:
        restored = ckpt.read(3).state
    _assert_bitwise(restored["base"], incremental_job.BASE)
    assert np.asarray(restored["adapter"]).tobytes() == np.full((64, 64), 3, np.float32).tobytes()


def test_the_orbax_export_of_a_step_sharing_bytes_stands_alone(mesh, ckpt_dir, tmp_path):
    import orbax.checkpoint as ocp

    base = _saved(mesh, ckpt_dir)
    out = tmp_path / "plain"
    assert jaxckpt.export_orbax(ckpt_dir, out, step=2) == 2
    shutil.rmtree(ckpt_dir)  # the steps it shared bytes with gone: the export holds them
    target = {"base": base, "adapters": _adapters(mesh, 2)}
    with ocp.StandardCheckpointer() as plain:
        restored = plain.restore(out, target)
    _assert_bitwise(restored["base"], base)


def test_incremental_steps_on_object_storage(mesh, bucket_dir):
    # each piece read from the object that holds it; a retired step is an object beside
    # the step's objects, its objects kept; verify checks the shared pieces there too
    from etils import epath

    from jaxckpt._storage import file_sizes

    base = _base(mesh)
    policy = jaxckpt.RetentionPolicy(keep_last=2)
    with jaxckpt.CheckpointManager(bucket_dir, incremental=True, retention=policy) as m:
        for step in range(4):
            m.save(step, state={"base": base, "adapters": _adapters(mesh, step)})
            m.wait()
        assert m.all_steps() == [2, 3]
        _assert_bitwise(m.restore(3, state={"base": base}, partial=True).state["base"], base)
    root = epath.Path(bucket_dir)
    assert (root / "0.jaxckpt-retired").exists() and (root / "0" / "packed").exists()
    sizes = file_sizes(root / "3" / "packed")
    assert sum(n for name, n in sizes.items() if name.endswith(".bin")) < 20_000
    assert all(r.ok for r in jaxckpt.verify(bucket_dir))


@CODECS
def test_on_object_storage_a_step_is_uploaded_in_parts_and_read_in_few_requests(
    mesh, bucket, bucket_dir, compression
):
    # 64 pieces of 512 KiB (8 leaves of 4 MiB, 8 shards each): uploaded as 2 objects at
    # once (one for each 16 MiB), read back in one request per object, not one a piece
    # (compressed: each piece a frame, decoded from the bytes of its object read at once)
    from etils import epath

    rng = np.random.default_rng(5)
    sharding = NamedSharding(mesh, P("data", "model"))
    state = {
        f"w{i}": jax.device_put(rng.standard_normal((1024, 1024), np.float32), sharding)
        for i in range(8)
    }
    target = {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding) for k, v in state.items()
    }
    with jaxckpt.CheckpointManager(bucket_dir, compression=compression) as m:
        m.save(1, state=state)
    names = sorted(p.name for p in (epath.Path(bucket_dir) / "1" / "packed").iterdir())
    assert [n for n in names if n.endswith(".bin")] == ["0-of-1.1.bin", "0-of-1.bin"], names
    since = bucket.mark()
    with jaxckpt.CheckpointManager(bucket_dir, read_only=True) as m:
        got = m.restore(1, state=target)
    _assert_bitwise(got.state, state)
    reads = [o for kind, o in bucket.requests(since) if kind == "read" and ".bin" in o]
    assert len(reads) == 2 and len(set(reads)) == 2, reads


def test_a_fresh_manager_never_deletes_bytes_an_older_kept_step_shares(mesh, ckpt_dir):
    # step 1 shares step 0's bytes; step 2, the first save of another process, shares none:
    # a manager that only looked at the newest step must still find step 1 before deleting
    _saved(mesh, ckpt_dir, steps=2)
    base = _base(mesh)
    with jaxckpt.CheckpointManager(ckpt_dir, incremental=True) as m:
        m.save(2, state={"base": base, "adapters": _adapters(mesh, 2)})
    with jaxckpt.CheckpointManager(ckpt_dir, incremental=True) as m:
        m.delete(0)
        assert m.all_steps() == [1, 2]
        _assert_bitwise(m.restore(1, state={"base": base}, partial=True).state["base"], base)
    assert (ckpt_dir / "0.jaxckpt-retired").exists()


def test_a_restarted_job_never_refers_to_bytes_damaged_since(mesh, ckpt_dir):
    # Before: the restarted job took step 2's index as proof that step 0's file still held
    # the base; step 3 referred to the flipped byte and never restored.
    base = _saved(mesh, ckpt_dir, steps=3)
    _flip(ckpt_dir, 0)
    with jaxckpt.CheckpointManager(ckpt_dir, incremental=True) as m:
        m.save(3, state={"base": base, "adapters": _adapters(mesh, 3)})
    assert _shares(ckpt_dir, 3) == [0]  # the other pieces, read back whole, referred to
    # the damaged piece (one of 32) written again, the rest not
    assert BASE_BYTES / 32 <= _own_bytes(ckpt_dir, 3) < BASE_BYTES / 4
    with jaxckpt.CheckpointManager(ckpt_dir, read_only=True) as m:
        _assert_bitwise(m.restore(3, state={"base": base}, partial=True).state["base"], base)


def test_a_restarted_job_never_refers_to_a_step_linked_out_of_the_directory(
    mesh, ckpt_dir, tmp_path
):
    # Before: step 3 referred to step 0, a link to a folder elsewhere; keep_last=1 deleted
    # steps 1 and 2, and the one step left raised RestoreError.
    base = _saved(mesh, ckpt_dir, steps=3)
    elsewhere = tmp_path / "elsewhere"
    (ckpt_dir / "0").rename(elsewhere)
    (ckpt_dir / "0").symlink_to(elsewhere)
    with jaxckpt.CheckpointManager(
        ckpt_dir, incremental=True, retention=jaxckpt.RetentionPolicy(keep_last=1)
    ) as m:
        m.save(3, state={"base": base, "adapters": _adapters(mesh, 3)})
        m.wait()
        assert m.all_steps() == [3]
    assert _shares(ckpt_dir, 3) == [] and _own_bytes(ckpt_dir, 3) > BASE_BYTES
    with jaxckpt.CheckpointManager(ckpt_dir, read_only=True) as m:
        _assert_bitwise(m.restore(3, state={"base": base}, partial=True).state["base"], base)


def test_one_damaged_file_reaches_at_most_full_save_every_steps(mesh, ckpt_dir):
    # Before: every step referred to step 0's base however many saves followed, so one
    # flipped byte there made every step unrestorable, fallback=True included.
    base = _saved(mesh, ckpt_dir, steps=7, full_save_every=3)
    shares = {s: _shares(ckpt_dir, s) for s in range(7)}
    assert shares == {0: [], 1: [0], 2: [0], 3: [], 4: [3], 5: [3], 6: []}
    assert _own_bytes(ckpt_dir, 3) > BASE_BYTES and _own_bytes(ckpt_dir, 4) < 20_000
    _flip(ckpt_dir, 3)
    damaged = {r.step for r in jaxckpt.verify(ckpt_dir) if not r.ok}
    assert damaged == {3, 4, 5}  # its chain: the step that wrote the file, and those after
    with jaxckpt.CheckpointManager(ckpt_dir, read_only=True) as m:
        for step in (2, 6):
            _assert_bitwise(m.restore(step, state={"base": base}, partial=True).state["base"], base)


def test_the_default_writes_every_piece_every_tenth_save(mesh, ckpt_dir):
    _saved(mesh, ckpt_dir, steps=11)
    assert _shares(ckpt_dir, 9) == [0] and _shares(ckpt_dir, 10) == []


def test_without_full_saves_every_step_refers_to_the_first(mesh, ckpt_dir):
    _saved(mesh, ckpt_dir, steps=4, full_save_every=None)
    assert [_shares(ckpt_dir, s) for s in range(4)] == [[], [0], [0], [0]]


def test_a_restarted_job_goes_on_with_its_chain_as_the_steps_on_disk_tell_it(mesh, ckpt_dir):
    # the saves since the last full one are counted across a restart: without, a job
    # restarted more often than every full_save_every saves would never write one
    base = _saved(mesh, ckpt_dir, steps=2, full_save_every=3)  # 0 full, 1 refers to it
    with jaxckpt.CheckpointManager(ckpt_dir, incremental=True, full_save_every=3) as m:
        for step in (2, 3):
            m.save(step, state={"base": base, "adapters": _adapters(mesh, step)})
            m.wait()
    assert _shares(ckpt_dir, 2) == [0] and _shares(ckpt_dir, 3) == []


@pytest.mark.parametrize("every", [0, -1, 2.5, "3", True])
def test_full_save_every_is_a_number_of_saves(ckpt_dir, every):
    with pytest.raises(ConfigError, match="full_save_every must be a number of saves"):
        jaxckpt.CheckpointManager(ckpt_dir, full_save_every=every)


def test_a_step_copied_without_the_step_it_shares_bytes_with_is_named_incomplete(
    mesh, ckpt_dir, tmp_path
):
    # Before: `ls` said "committed" (exit 0), and a restore called the step corrupt ("the
    # file ... is missing"), advising fallback=True; nothing was damaged
    base = _saved(mesh, ckpt_dir)
    out = tmp_path / "published"
    out.mkdir()
    shutil.copytree(ckpt_dir / "2", out / "2")  # `cp -r ckpt/2 published/`
    result = CliRunner().invoke(main, ["ls", "--json", str(out)])
    (row,) = json.loads(result.output)["steps"]
    assert row["status"].startswith("INCOMPLETE: shares bytes with step(s) 0, not in this")
    want = "incomplete: it shares bytes with step 0, which is not in this directory"
    with jaxckpt.CheckpointManager(out, read_only=True) as m:
        with pytest.raises(jaxckpt.errors.IncompleteStepError, match=want) as raised:
            m.restore(2, state={"base": base}, partial=True)
        assert "copy step 0 beside it" in str(raised.value) and "corrupt" not in str(raised.value)
    (report,) = jaxckpt.verify(out)
    assert [p.split(":")[0] for p in report.problems] == [
        "it shares bytes with step 0, which is not in this directory (was this step copied without it?)"
    ]
    shutil.copytree(ckpt_dir / "0", out / "0")  # as the message says
    with jaxckpt.CheckpointManager(out, read_only=True) as m:
        _assert_bitwise(m.restore(2, state={"base": base}, partial=True).state["base"], base)


@pytest.mark.parametrize("size", ["same size", "shorter"])
def test_a_step_beside_another_runs_step_of_the_same_number_is_named_so_not_damaged(
    mesh, ckpt_dir, tmp_path, size
):
    # Before: "the file is damaged" (CorruptCheckpointError): step 0 there is whole, just
    # not the step 2 was saved beside
    base = _saved(mesh, ckpt_dir)
    other = tmp_path / "other-run"
    state = {"base": {k: v + 1.0 for k, v in base.items()}}  # another run's step 0: other bytes
    if size == "same size":  # (its pieces where this run's are: their digests disagree)
        state["adapters"] = _adapters(mesh, 0)
    with jaxckpt.CheckpointManager(other) as m:
        m.save(0, state=state)
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    shutil.copytree(other / "0", mixed / "0")
    shutil.copytree(ckpt_dir / "2", mixed / "2")
    want = "incomplete: it shares bytes with step 0, but the step 0 in this directory is another"
    with (
        jaxckpt.CheckpointManager(mixed, read_only=True) as m,
        pytest.raises(jaxckpt.errors.IncompleteStepError, match=want),
    ):
        m.restore(2, state={"base": base}, partial=True)
    reports = {r.step: r for r in jaxckpt.verify(mixed)}
    assert reports[0].ok and "is another one" in " ".join(reports[2].problems)
    _flip(ckpt_dir, 0)  # a byte flipped in the step's true owner is still damage
    with jaxckpt.CheckpointManager(ckpt_dir, read_only=True, verify_on_restore=False) as m:
        with pytest.raises(CorruptCheckpointError, match="the file is damaged") as raised:
            m.restore(2, state={"base": base}, partial=True)
        assert not isinstance(raised.value, jaxckpt.errors.IncompleteStepError)


def _rewrite_manifest(ckpt_dir, step):
    """The step's manifest made to agree with its files as they are now (a summary edited
    by hand or by a tool: no checksum then says anything is wrong)."""
    from jaxckpt import _integrity

    folder = ckpt_dir / str(step)
    manifest = json.loads((folder / "jaxckpt" / "manifest.json").read_text())
    for rel in list(manifest["files"]):
        if not (folder / rel).exists():
            del manifest["files"][rel]
            continue
        size, found = _integrity.digest(folder, rel)
        manifest["files"][rel].update(size=size, **{_integrity.HASH: found})
    (folder / "jaxckpt" / "manifest.json").write_text(json.dumps(manifest))


def _unsummarised(ckpt_dir, summary):
    """Step 2's shares.json (it reads step 0's bytes) "missing", or "emptied" (and its
    manifest made to agree, "emptied, manifest agreeing")."""
    shares = ckpt_dir / "2" / "jaxckpt" / "shares.json"
    if summary == "missing":
        shares.unlink()
    else:
        shares.write_text(json.dumps({"steps": []}))
    if summary.endswith("agreeing"):
        _rewrite_manifest(ckpt_dir, 2)


@pytest.mark.parametrize("summary", ["missing", "emptied", "emptied, manifest agreeing"])
def test_retention_follows_the_index_not_its_summary(mesh, ckpt_dir, summary):
    # Before: a missing shares.json read as "shares nothing", and retention deleted step 0,
    # whose bytes step 2 reads ("0/packed/0-of-1.bin ... is missing").
    base = _saved(mesh, ckpt_dir, steps=3)
    _unsummarised(ckpt_dir, summary)
    new_base = {k: v + 1 for k, v in base.items()}  # step 3 shares nothing: step 2 alone needs 0
    with jaxckpt.CheckpointManager(
        ckpt_dir, incremental=True, retention=jaxckpt.RetentionPolicy(keep_last=2)
    ) as m:
        m.save(3, state={"base": new_base, "adapters": _adapters(mesh, 3)})
        m.wait()
        assert m.all_steps() == [2, 3]
        assert (ckpt_dir / "0").is_dir() and (ckpt_dir / "0.jaxckpt-retired").exists()
    with jaxckpt.CheckpointManager(ckpt_dir, read_only=True, verify_on_restore=False) as m:
        _assert_bitwise(m.restore(2, state={"base": base}, partial=True).state["base"], base)


@pytest.mark.parametrize("summary", ["missing", "emptied, manifest agreeing"])
def test_rm_and_verify_follow_the_index_not_its_summary(mesh, ckpt_dir, summary):
    base = _saved(mesh, ckpt_dir, steps=3)
    _unsummarised(ckpt_dir, summary)
    problems = " ".join({r.step: r for r in jaxckpt.verify(ckpt_dir)}[2].problems)
    want = "jaxckpt/shares.json is missing" if summary == "missing" else "refers to step(s) [0]"
    assert want in problems, problems
    result = CliRunner().invoke(main, ["ls", "--json", str(ckpt_dir)])
    rows = {r["step"]: r for r in json.loads(result.output)["steps"]}
    assert rows[2]["shares"] == [0], rows[2]  # as the index says
    for step in (1, 0):
        result = CliRunner().invoke(main, ["rm", str(ckpt_dir), str(step)])
        assert result.exit_code == 0, result.output
    assert (ckpt_dir / "0").is_dir()  # retired: step 2 reads its bytes
    with jaxckpt.CheckpointManager(ckpt_dir, read_only=True, verify_on_restore=False) as m:
        _assert_bitwise(m.restore(2, state={"base": base}, partial=True).state["base"], base)


@pytest.mark.parametrize("kind", ["swollen", "nested"])
def test_a_hostile_summary_is_a_problem_verify_names_and_retention_survives(mesh, ckpt_dir, kind):
    # Before: a raw SizeError from verify (swollen), a raw RecursionError from retention,
    # ls and verify (nested).
    base = _saved(mesh, ckpt_dir, steps=2)
    shares = ckpt_dir / "1" / "jaxckpt" / "shares.json"
    if kind == "swollen":
        os.truncate(shares, 3 * 2**29)  # 1.5 GiB, sparse
    else:
        shares.write_text('{"steps": ' + "[" * 100_000 + "]" * 100_000 + "}")
    problems = " ".join({r.step: r for r in jaxckpt.verify(ckpt_dir)}[1].problems)
    assert "jaxckpt/shares.json" in problems, problems
    result = CliRunner().invoke(main, ["ls", str(ckpt_dir)])
    assert result.exit_code == 0, result.output
    with jaxckpt.CheckpointManager(
        ckpt_dir, incremental=True, retention=jaxckpt.RetentionPolicy(keep_last=1)
    ) as m:
        m.save(2, state={"base": base, "adapters": _adapters(mesh, 2)})
        m.wait()  # (retention deletes step 1, whose summary it needs no longer read)
        assert m.all_steps() == [2] and (ckpt_dir / "0.jaxckpt-retired").exists()
        _assert_bitwise(m.restore(2, state={"base": base}, partial=True).state["base"], base)


def test_a_large_step_spreads_its_pieces_over_files_written_at_once(mesh, ckpt_dir):
    # 136 MiB of pieces: two data files (a new file's blocks are slow to come: several are
    # written at once), each piece read back from the one that holds it
    rng = np.random.default_rng(1)
    sharding = NamedSharding(mesh, P("data", "model"))
    big = {
        f"w{i}": jax.device_put(rng.standard_normal((4352, 2048), np.float32), sharding)
        for i in range(4)
    }
    with jaxckpt.CheckpointManager(ckpt_dir, incremental=True) as m:
        m.save(0, state=big)
        m.wait()
        m.save(1, state=dict(big, w3=big["w3"] + 1))  # one leaf changed
        m.wait()
        for step in (0, 1):
            want = big if step == 0 else dict(big, w3=big["w3"] + 1)
            _assert_bitwise(m.restore(step, state=want).state, want)
    files = sorted(p.name for p in (ckpt_dir / "0" / "packed").glob("*.bin"))
    assert files == ["0-of-1.1.bin", "0-of-1.bin"]
    assert _shares(ckpt_dir, 1) == [0]
    assert 34 * 2**20 <= _own_bytes(ckpt_dir, 1) < 35 * 2**20  # w3 alone
    assert all(r.ok for r in jaxckpt.verify(ckpt_dir))

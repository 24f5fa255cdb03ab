"""Small leaves packed per process (format 2), and steps of format 1 (an Orbax array per
leaf) restoring as they always did."""

import json
import shutil
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from jaxckpt import _packed
from reliability import faults

FIXTURES = Path(__file__).parent / "fixtures"
sys.path.insert(0, str(FIXTURES))
import write_format1  # noqa: E402


@pytest.fixture
def format1(tmp_path):
    """A copy of the checked-in format-1 step (readers never write, but a test's copy is
    its own)."""
    out = tmp_path / "format1"
    shutil.copytree(FIXTURES / "format1", out)
    return out


def test_the_fixture_is_format_1(format1):
    doc = json.loads((format1 / "3/jaxckpt/jaxckpt.json").read_text())
    assert doc["format"] == 1


@pytest.mark.parametrize("onto", ["same", "other", "one"])
def test_a_format_1_step_restores_bitwise(format1, mesh, onto):
    v = write_format1.values()
    shapes = {"same": ((4, 2), P("data", "model")), "other": ((2, 4), P("model", "data"))}
    if onto == "one":
        sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        replicated = sharding
    else:
        shape, spec = shapes[onto]
        m = jax.make_mesh(shape, ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
        sharding, replicated = NamedSharding(m, spec), NamedSharding(m, P())
    params = v["state"]["params"]

    def target(x, s):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)

    state = {
        "params": {
            "w": target(params["w"], sharding),
            "b": target(params["b"], replicated),
            "emb": target(params["emb"], replicated),
        },
        "step": v["state"]["step"],
        "counts": v["state"]["counts"],
    }
    data = write_format1.Data()
    data.state = None
    with jaxckpt.CheckpointManager(format1, read_only=True) as m:
        r = m.restore(state=state, rng=v["rng"], data=data)
    assert r.step == 3 and r.meta == {"written_by": "format 1"}
    for name in ("w", "b", "emb"):
        got = r.state["params"][name]
        assert got.sharding == state["params"][name].sharding
        np.testing.assert_array_equal(np.asarray(got), params[name], strict=True)
    assert int(r.state["step"]) == 41
    np.testing.assert_array_equal(r.state["counts"], v["state"]["counts"])
    assert jax.random.key_data(r.rng).tolist() == jax.random.key_data(v["rng"]).tolist()
    assert data.state == v["data"]


def test_a_format_1_step_verifies(format1):
    (report,) = jaxckpt.verify(format1)
    assert report.ok and report.checksummed and report.files > 10


# --- format 2: small leaves packed -------------------------------------------------------


def _mesh(shape):
    return jax.make_mesh(shape, ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


def _small_and_big(mesh):
    """Leaves of every kind packing meets, and one above the packing limit."""
    rng = np.random.default_rng(0)

    def put(x, spec):
        return jax.device_put(x, NamedSharding(mesh, spec))

    return {
        "sharded": put(rng.standard_normal((16, 8), np.float32), P("data", "model")),
        "rows": put(rng.standard_normal((12, 5), np.float32), P("data")),  # 12 rows on 4
        "replicated": put(rng.standard_normal((7,), np.float32), P()),
        "bf16": put(rng.standard_normal((8, 8)).astype(jax.numpy.bfloat16), P(None, "model")),
        "flags": put(rng.random((8, 4)) > 0.5, P("data")),
        "int8": put(rng.integers(-100, 100, (4, 4), dtype=np.int8), P("model")),
        "one_device": jax.device_put(np.arange(6, dtype=np.int32), jax.devices()[3]),
        "host": np.arange(10, dtype=np.float64),
        "scalar": 3.5,
        "big": put(rng.standard_normal((1024, 512), np.float32), P("data", "model")),  # 2 MiB
    }


def _target(state, mesh=None):
    def leaf(x):
        if not isinstance(x, jax.Array):
            return x
        sharding = x.sharding
        if mesh is not None:
            spec = sharding.spec if isinstance(sharding, NamedSharding) else P()
            sharding = NamedSharding(mesh, spec)
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    return jax.tree.map(leaf, state)


def _assert_bitwise(got, want):
    for name, w in want.items():
        g = got[name]
        if isinstance(w, jax.Array | np.ndarray):
            assert np.asarray(g).dtype == np.asarray(w).dtype, name
            assert np.asarray(g).tobytes() == np.asarray(w).tobytes(), name
        else:
            assert g == w, name


def test_small_leaves_are_packed_and_restore_bitwise_anywhere(mesh, ckpt_dir):
    state = _small_and_big(mesh)
    with jaxckpt.CheckpointManager(ckpt_dir, incremental=False) as m:  # format 2
        m.save(1, state=state, rng=jax.random.key(3))
    doc = json.loads((ckpt_dir / "1/jaxckpt/jaxckpt.json").read_text())
    assert doc["format"] == 2
    assert doc["packed"]["state"] == sorted(set(state) - {"big"})
    assert len(doc["packed"]["rng"]) == 1  # the key's data
    assert sorted(p.name for p in (ckpt_dir / "1/packed").iterdir()) == [
        "0-of-1.bin",
        "0-of-1.json",
        "commit_success.txt",
    ]
    with jaxckpt.CheckpointManager(ckpt_dir, read_only=True) as m:
        same = m.restore(state=_target(state), rng=jax.random.key(0))
        other = m.restore(state=_target(state, _mesh((2, 4))))
        host = m.restore()
    _assert_bitwise(same.state, state)
    assert jax.random.key_data(same.rng).tolist() == jax.random.key_data(jax.random.key(3)).tolist()
    for name, leaf in state.items():
        if isinstance(leaf, jax.Array):
            assert same.state[name].sharding == leaf.sharding, name
    _assert_bitwise(other.state, state)
    assert other.state["sharded"].sharding.mesh.devices.shape == (2, 4)
    _assert_bitwise(host.state, state)
    assert isinstance(host.state["sharded"], np.ndarray)
    host.state["sharded"][0, 0] = 1.0  # a host array restored is the caller's to change


def test_packed_leaves_whose_names_json_must_escape_restore_bitwise(mesh, ckpt_dir):
    # The packed index is written as JSON text leaf by leaf (`HostPieces.index_json`).
    rng = np.random.default_rng(5)
    names = ['quote"d', "back\\slash", "new\nline", "tab\t", "caf\u00e9 \u540d", "{}[]:,", "\u2028"]
    state = {
        n: jax.device_put(rng.standard_normal((8, 4), np.float32), NamedSharding(mesh, P("data")))
        for n in names
    }
    with jaxckpt.CheckpointManager(ckpt_dir) as m:
        m.save(1, state=state)
    doc = json.loads((ckpt_dir / "1/jaxckpt/jaxckpt.json").read_text())
    assert len(doc["packed"]["state"]) == len(names)
    with jaxckpt.CheckpointManager(ckpt_dir, read_only=True) as m:
        got = m.restore(state=_target(state)).state
    _assert_bitwise(got, state)


def test_a_partial_restore_reads_only_the_packed_leaves_asked_for(mesh, ckpt_dir):
    state = _small_and_big(mesh)
    with jaxckpt.CheckpointManager(ckpt_dir) as m:
        m.save(1, state=state)
    target = {k: v for k, v in _target(state).items() if k in ("rows", "big")}
    with jaxckpt.CheckpointManager(ckpt_dir, read_only=True) as m:
        got = m.restore(state=target, partial=True).state
    assert set(got) == {"rows", "big"}
    _assert_bitwise(got, {k: state[k] for k in got})


def test_pack_small_leaves_false_writes_every_leaf_as_an_orbax_array(mesh, ckpt_dir):
    import orbax.checkpoint as ocp

    state = {"w": _small_and_big(mesh)["sharded"], "b": np.arange(3.0)}
    with jaxckpt.CheckpointManager(ckpt_dir, pack_small_leaves=False) as m:
        m.save(1, state=state)
    assert not (ckpt_dir / "1/packed").exists()
    assert json.loads((ckpt_dir / "1/jaxckpt/jaxckpt.json").read_text())["packed"] == {}
    with ocp.CheckpointManager(ckpt_dir) as plain:
        got = plain.restore(1, args=ocp.args.Composite(state=ocp.args.StandardRestore()))
    np.testing.assert_array_equal(got["state"]["w"], np.asarray(state["w"]))
    with jaxckpt.CheckpointManager(ckpt_dir, read_only=True) as m:
        _assert_bitwise(m.restore(state=_target(state)).state, state)


def _saved(mesh, ckpt_dir):
    with jaxckpt.CheckpointManager(ckpt_dir, incremental=False) as m:  # format 2
        m.save(1, state=_small_and_big(mesh))
    return ckpt_dir / "1/packed"


def test_a_truncated_packed_file_fails_verify_and_restore(mesh, ckpt_dir):
    packed = _saved(mesh, ckpt_dir)
    blob = packed / "0-of-1.bin"
    blob.write_bytes(blob.read_bytes()[:-100])
    (report,) = jaxckpt.verify(ckpt_dir)
    assert not report.ok and any("0-of-1.bin" in p for p in report.problems)
    m = jaxckpt.CheckpointManager(ckpt_dir, read_only=True, verify_on_restore=False)
    with (
        m,
        pytest.raises(
            jaxckpt.errors.CorruptCheckpointError,
            match=r"0-of-1\.bin holds 968 bytes, fewer than the 1068",
        ),
    ):
        m.restore(state=_target(_small_and_big(mesh)))


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda d: "not json", "0-of-1.json is unreadable"),
        (lambda d: {**d, "format": 9}, "is not an index of packed leaves"),
        (lambda d: {**d, "leaves": {"state": {"rows": {"dtype": "float32"}}}}, "entry"),
        (lambda d: _shrink_piece(d, "rows"), "hold 45 of its 60 elements"),
        (lambda d: _shift_piece(d, "rows", 10**9), "ends past the file"),
        (lambda d: _set(d, "rows", "dtype", "no-such-type"), "is not a dtype"),
        (lambda d: _set(d, "rows", "dtype", "int32"), "dtype int32, but .* dtype float32"),
        (lambda d: _twice(d, "rows"), "two pieces overlap at byte"),
        (lambda d: "[" * 100_000 + "]" * 100_000, "0-of-1.json is unreadable"),
    ],
)
def test_a_damaged_packed_index_is_a_corrupt_checkpoint(mesh, ckpt_dir, edit, match):
    packed = _saved(mesh, ckpt_dir)
    index = packed / "0-of-1.json"
    edited = edit(json.loads(index.read_text()))
    index.write_text(edited if isinstance(edited, str) else json.dumps(edited))
    m = jaxckpt.CheckpointManager(ckpt_dir, read_only=True, verify_on_restore=False)
    with m, pytest.raises(jaxckpt.errors.CorruptCheckpointError, match=match):
        m.restore(state=_target(_small_and_big(mesh)))


def _shrink_piece(doc, name):
    (piece,) = doc["leaves"]["state"][name]["pieces"]  # one process holds all of the leaf
    piece[1][0][1] -= 3
    return doc


def _shift_piece(doc, name, by):
    doc["leaves"]["state"][name]["pieces"][0][0] += by
    return doc


def _twice(doc, name):  # its first half listed twice: as many elements, half of them unread
    (piece,) = doc["leaves"]["state"][name]["pieces"]
    piece[1][0][1] //= 2
    doc["leaves"]["state"][name]["pieces"] = [piece, piece]
    return doc


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda i: i["packed"].update(state=[["rows"]]), "'packed.state' is not a list"),
        (lambda i: i["packed"].update(state=["no-such-leaf"]), "'packed.state' is not a list"),
        (lambda i: i["packed"].update(other=[]), "'packed.other' is not a list"),
        (lambda i: i.update(process_count=0), "'process_count' is not a process count"),
        (lambda i: i.update(process_count=10**9), "'process_count' is not a process count"),
    ],
)
def test_a_hostile_packed_entry_in_jaxckpt_json_is_a_corrupt_checkpoint(
    mesh, ckpt_dir, change, match
):
    _saved(mesh, ckpt_dir)
    path = ckpt_dir / "1/jaxckpt/jaxckpt.json"
    info = json.loads(path.read_text())
    change(info)
    path.write_text(json.dumps(info))
    m = jaxckpt.CheckpointManager(ckpt_dir, read_only=True, verify_on_restore=False)
    with m, pytest.raises(jaxckpt.errors.CorruptCheckpointError, match=match):
        m.restore(1, state=_target(_small_and_big(mesh)))
    assert m.latest_step() is None  # (a step whose metadata is unreadable is none to resume)


def test_a_partial_read_of_far_apart_pieces_reads_little_more_than_asked(ckpt_dir):
    # Small leaves between bigger ones (a 512 KiB "w" and a 128-byte "b" per layer): reading
    # the "b"s alone must not read the "w"s between them in merged requests.
    state = {
        f"layer{i:02d}": {"w": np.zeros(2**17, np.float32), "b": np.ones(16)} for i in range(8)
    }
    with jaxckpt.CheckpointManager(ckpt_dir) as m:
        m.save(1, state=state)
    read = []  # the bytes of each read of a packed file

    def measured_open(open_file, folder, name, **kw):
        f = open_file(folder, name, **kw)
        real_readinto = f.readinto
        f.readinto = lambda b: read.append(len(b)) or real_readinto(b)
        return f

    measured = faults.store(open_file=measured_open)
    wanted = {k: {"b": v["b"]} for k, v in state.items()}
    with faults.manager(ckpt_dir, read_only=True, store=measured) as m:
        got = m.restore(state=wanted, partial=True).state
    assert all(np.array_equal(got[k]["b"], np.ones(16)) for k in got)
    assert read == [16 * 8] * 8  # each "b" alone: 512 KiB apart, never one merged read


def _set(doc, name, key, value):
    doc["leaves"]["state"][name][key] = value
    return doc


def test_a_step_deleted_and_saved_again_restores_its_new_leaves(mesh, ckpt_dir):
    # One manager reads step 1, deletes it, saves step 1 anew: the packed index it read
    # first must not be used for the new files.
    state = _small_and_big(mesh)
    with jaxckpt.CheckpointManager(ckpt_dir) as m:
        m.save(1, state=state)
        m.wait()
        _assert_bitwise(m.restore(state=_target(state)).state, state)
        m.delete(1)
        changed = {k: v for k, v in state.items() if k != "bf16"}  # the others move up
        changed["rows"] = changed["rows"] * 2
        m.save(1, state=changed)
        m.wait()
        _assert_bitwise(m.restore(state=_target(changed)).state, changed)


def test_a_merged_index_is_read_instead_of_each_processs(mesh, ckpt_dir):
    # Process 0 of a job of several writes it at the commit (tests/test_spread.py); here
    # one process's step gets one by the same function, and its own index is removed.
    state = _small_and_big(mesh)
    with jaxckpt.CheckpointManager(ckpt_dir) as m:
        m.save(1, state=state)
    folder = ckpt_dir / "1/packed"
    _packed.merge(folder, 1)
    (folder / "0-of-1.json").unlink()
    with jaxckpt.CheckpointManager(ckpt_dir, read_only=True, verify_on_restore=False) as m:
        _assert_bitwise(m.restore(state=_target(state)).state, state)


@pytest.mark.parametrize(
    "doc, match",
    [
        ({"format": 2, "indexes": {}}, "is not an index of 1 processes'"),
        ({"format": 1, "indexes": [None]}, "is not an index of 1 processes'"),
        ({"format": 2, "indexes": [None, None]}, "is not an index of 1 processes'"),
        ({"format": 2, "indexes": [[]]}, r"index.json: process 0's is not an"),
        ({"format": 2, "indexes": [None]}, "holds no process's index"),
    ],
)
def test_a_merged_index_that_is_not_one_is_refused(mesh, ckpt_dir, doc, match):
    with jaxckpt.CheckpointManager(ckpt_dir) as m:
        m.save(1, state=_small_and_big(mesh))
    (ckpt_dir / "1/packed/index.json").write_text(json.dumps(doc))
    (ckpt_dir / "1/packed/0-of-1.json").unlink()  # (else its own is read, never the merged)
    m = jaxckpt.CheckpointManager(ckpt_dir, read_only=True, verify_on_restore=False)
    with m, pytest.raises(jaxckpt.errors.CorruptCheckpointError, match=match):
        m.restore(state=_target(_small_and_big(mesh)))

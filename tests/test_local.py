"""The host-local tier in one process: which tier a save goes to and a restore comes from,
what passes a local step over (a wiped directory, a corrupted file, another process's part),
its retention, and that a local save never waits for a persistent one. Several processes:
tests/test_local_multihost.py."""

import json
import logging
import os
import shutil
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from conftest import Iterator
from jaxckpt import _integrity, _internals
from jaxckpt.errors import ConfigError, SaveError
from reliability import faults


def _state(mesh, step):
    sharded = NamedSharding(mesh, P("data", "model"))
    w = np.arange(64 * 16, dtype=np.float32).reshape(64, 16) + step
    big = np.random.default_rng(step).standard_normal((512, 1024)).astype(np.float32)  # 2 MiB
    return {
        "w": jax.device_put(w, sharded),
        "big": jax.device_put(big, sharded),
        "b": jax.device_put(jnp.full(3, step, jnp.bfloat16), NamedSharding(mesh, P())),
        "count": np.int64(step),
        "table": np.arange(5) * step,
    }


def _target(state):
    return jax.tree.map(
        lambda x: (
            jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
            if isinstance(x, jax.Array)
            else x
        ),
        state,
    )


def _assert_bitwise(got, want):
    for k in want:
        g, w = np.asarray(got[k]), np.asarray(want[k])
        assert g.dtype == w.dtype and g.shape == w.shape and g.tobytes() == w.tobytes(), k


def _manager(tmp_path, stores=None, **local):
    """A manager with a local tier; `stores`: the classes doing each tier's storage work
    (`faults.manager`'s `store=` and `local_store=`)."""
    tier = jaxckpt.LocalTier(tmp_path / "local", **{"every_steps": 2, **local})
    return faults.manager(
        tmp_path / "persistent",
        policy=jaxckpt.SavePolicy(every_steps=10),
        local=tier,
        **(stores or {}),
    )


def _train(mngr, mesh, steps, data=None):
    """Saves what should_save asks for, each step's state the step's own."""
    data = data or Iterator()
    for step in steps:
        data.position = step * 3
        if mngr.should_save(step):
            mngr.save(step, state=_state(mesh, step), rng=jax.random.key(step), data=data)
    mngr.wait()


def test_local_steps_are_saved_often_and_restored_first_bitwise(mesh, tmp_path):
    with _manager(tmp_path) as m:
        _train(m, mesh, range(1, 16))
        assert m.all_steps() == [10]  # the persistent tier, on its own cadence
        assert sorted(os.listdir(tmp_path / "local")) == ["12", "14"]  # keep_last=2
        assert m.latest_step() == 14
    with _manager(tmp_path) as m:  # a restarted job
        data = Iterator()
        r = m.restore(state=_target(_state(mesh, 0)), data=data)
        assert (r.step, r.tier, data.position) == (14, "local", 42)
        _assert_bitwise(r.state, _state(mesh, 14))
        assert r.state["w"].sharding == _state(mesh, 0)["w"].sharding
        assert np.array_equal(jax.random.key_data(r.rng), jax.random.key_data(jax.random.key(14)))
        r = m.restore(10, state=_target(_state(mesh, 0)))  # a persistent step, asked for
        assert (r.step, r.tier) == (10, "persistent")


@pytest.mark.parametrize("onto", [(2, 4), (1,)])
def test_a_local_step_restores_onto_another_mesh_of_the_same_devices(mesh, tmp_path, onto):
    with _manager(tmp_path) as m:
        _train(m, mesh, range(1, 5))
    devices = jax.devices()[: int(np.prod(onto))]
    other = jax.make_mesh(onto, ("data", "model")[: len(onto)], devices=devices)
    target = jax.tree.map(
        lambda x: (
            jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(other, P()))
            if isinstance(x, jax.Array)
            else x
        ),
        _state(mesh, 0),
    )
    with _manager(tmp_path) as m:
        r = m.restore(state=target)
    assert (r.step, r.tier) == (4, "local")
    _assert_bitwise(r.state, _state(mesh, 4))
    assert r.state["big"].sharding == NamedSharding(other, P())


def test_a_wiped_local_directory_falls_back_to_the_persistent_tier(mesh, tmp_path):
    with _manager(tmp_path) as m:
        _train(m, mesh, range(1, 16))
    shutil.rmtree(tmp_path / "local")  # a replaced host: its local disk is new
    with _manager(tmp_path) as m:
        assert m.latest_step() == 10
        r = m.restore(state=_target(_state(mesh, 0)))
    assert (r.step, r.tier) == (10, "persistent")
    _assert_bitwise(r.state, _state(mesh, 10))


def test_a_corrupted_local_file_passes_its_step_over(mesh, tmp_path, caplog):
    with _manager(tmp_path) as m:
        _train(m, mesh, range(1, 16))
    data = tmp_path / "local" / "14" / "packed" / "0-of-1.bin"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    with _manager(tmp_path) as m, caplog.at_level(logging.WARNING, "jaxckpt"):
        r = m.restore(state=_target(_state(mesh, 0)))
    assert (r.step, r.tier) == (12, "local")  # the older local step, newer than persistent 10
    _assert_bitwise(r.state, _state(mesh, 12))
    assert "local step 14" in caplog.text and "checksum mismatch" in caplog.text


def test_a_newer_persistent_step_is_restored_over_an_older_local_one(mesh, tmp_path):
    with _manager(tmp_path, every_steps=3) as m:
        _train(m, mesh, range(1, 11))  # local 6, 9; persistent 10
        assert m.latest_step() == 10
        r = m.restore(state=_target(_state(mesh, 0)))
    assert (r.step, r.tier) == (10, "persistent")


def test_another_process_part_is_passed_over(mesh, tmp_path, caplog):
    """A local directory moved from another host (its part.json names that process; the
    manifest was remade to match, so only the part itself tells)."""
    with _manager(tmp_path) as m:
        _train(m, mesh, range(1, 13))
    folder = tmp_path / "local" / "12"
    part = folder / "jaxckpt" / "part.json"
    part.write_text(json.dumps({**json.loads(part.read_text()), "process": 1, "processes": 2}))
    (folder / "jaxckpt" / "manifest.json").unlink()
    _integrity.write_manifest(folder)
    with _manager(tmp_path) as m, caplog.at_level(logging.WARNING, "jaxckpt"):
        r = m.restore(state=_target(_state(mesh, 0)))
    assert (r.step, r.tier) == (10, "local")  # local 10 is kept too: it is not older
    assert "holds the part of process 1 of 2" in caplog.text


def test_restoring_an_older_step_drops_the_newer_local_steps(mesh, tmp_path):
    """The run goes on from the restored step: a later crash must not bring back a local
    step of the timeline it left."""
    with _manager(tmp_path) as m:
        _train(m, mesh, range(1, 16))
        r = m.restore(10, state=_target(_state(mesh, 0)))
        assert r.tier == "persistent"
        assert os.listdir(tmp_path / "local") == []
        assert m.latest_step() == 10
        _train(m, mesh, range(11, 13))
        assert m.latest_step() == 12


def test_keep_last_and_every_steps_of_the_local_tier(mesh, tmp_path):
    with _manager(tmp_path, every_steps=1, keep_last=3) as m:
        _train(m, mesh, range(1, 9))
    assert sorted(int(n) for n in os.listdir(tmp_path / "local")) == [6, 7, 8]


def test_a_local_save_does_not_wait_for_a_persistent_save_in_flight(mesh, tmp_path):
    release = threading.Event()
    with (
        _manager(tmp_path) as m,
        _internals.on_writes_done(lambda: release.wait(60)),  # the persistent write, frozen
    ):
        m.save(10, state=_state(mesh, 10))  # persistent (and local: 10 is even)
        start = time.monotonic()
        m.save(12, state=_state(mesh, 12))  # local alone
        blocked = time.monotonic() - start
        deadline = time.monotonic() + 60
        while not (tmp_path / "local" / "12").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        written = (tmp_path / "local" / "12").exists()
        assert m.all_steps() == []  # the persistent step 10 is still frozen
        release.set()
    assert written and blocked < 30
    with _manager(tmp_path) as m:
        assert m.all_steps() == [10] and m.latest_step() == 12


def test_a_failed_local_save_is_a_save_error_and_the_next_one_works(mesh, tmp_path):
    disk_full = threading.Event()

    def full(write_part, tmp, *args):
        if not disk_full.is_set():
            return write_part(tmp, *args)
        (tmp / "packed").mkdir(parents=True)
        (tmp / "packed" / "process_0.bin").write_bytes(b"half")  # as far as it got
        raise OSError(28, "No space left on device")

    with _manager(tmp_path, {"local_store": faults.local_store(write_part=full)}) as m:
        disk_full.set()
        m.save(2, state=_state(mesh, 2))
        with pytest.raises(SaveError, match=r"local step 2 .*No space left on device"):
            m.wait()
        assert not any(p.name.startswith("2") for p in (tmp_path / "local").iterdir())
        disk_full.clear()
        m.save(4, state=_state(mesh, 4))
        m.wait()
        assert m.latest_step() == 4


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"every_steps": 0}, "every_steps must be a positive int"),
        ({"every_steps": 2, "keep_last": 0}, "keep_last must be a positive int"),
        ({"every_steps": True}, "every_steps must be a positive int"),
        ({"every_steps": 2, "copy_timeout_s": 0}, "copy_timeout_s must be a positive number"),
        ({"every_steps": 2, "copy_timeout_s": True}, "copy_timeout_s must be a positive number"),
    ],
)
def test_local_tier_options_are_checked(tmp_path, kwargs, match):
    with pytest.raises(ConfigError, match=match):
        jaxckpt.LocalTier(tmp_path, **kwargs)


def test_the_local_tier_is_host_local(tmp_path):
    with pytest.raises(ConfigError, match="host-local path"):
        jaxckpt.LocalTier("gs://bucket/run", every_steps=5)
    with pytest.raises(ConfigError, match=r"must be a jaxckpt\.LocalTier"):
        jaxckpt.CheckpointManager(tmp_path, local=str(tmp_path / "l"))


def test_a_local_directory_that_cannot_be_made_leaves_nothing_held(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    tier = jaxckpt.LocalTier(tmp_path / "file" / "local", every_steps=2)
    with pytest.raises(ConfigError, match=r"LocalTier\.directory .*/file/local cannot be made"):
        jaxckpt.CheckpointManager(tmp_path / "persistent", local=tier)
    with jaxckpt.CheckpointManager(tmp_path / "persistent") as m:  # the lock was released
        m.save(1, state={"x": np.zeros(3)})

"""Checkpoints on object storage, each test on gs:// and on s3:// alike: against real
servers on 127.0.0.1 (fake-gcs-server, moto's S3 server; tests/conftest.py's `bucket`).

A step is committed without a rename (Orbax's commit marker, written last), deleted behind a
tombstone, written by one leaseholder, read with requests that do not grow with the
processes of a job, and exported and imported in place.
"""

import http.server
import json
import os
import re
import socket
import subprocess
import threading
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from children import multihost_checkpoints as job
from click.testing import CliRunner
from etils import epath
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from multihost import one_job_at_a_time, run_job

import jaxckpt
from conftest import run_python
from jaxckpt import _storage, cli
from reliability import faults, gcs, launch, s3
from reliability.faults import REMOTE_CORRUPTIONS
from reliability.stress import Tally, kill_trial


def test_save_and_resharded_restore_on_object_storage(mesh, bucket_dir):
    state = {
        "w": jax.device_put(
            np.arange(64 * 16, dtype=np.float32).reshape(64, 16), NamedSharding(mesh, P("data"))
        ),
        "step": 3,
    }
    with jaxckpt.CheckpointManager(bucket_dir) as m:
        m.save(1, state=state, rng=jax.random.key(0), meta={"where": "remote"})
        m.wait()
        assert m.all_steps() == [1]
    # Orbax commits on GCS with a marker file rather than a rename.
    assert (epath.Path(bucket_dir) / "1" / "commit_success.txt").exists()
    (report,) = jaxckpt.verify(bucket_dir)
    assert report.ok and report.files > 3, report

    other = jax.make_mesh((2, 4), ("data", "model"))
    target = jaxckpt.target_on_mesh(jaxckpt.target_like(state), other, P("model", "data"))
    with jaxckpt.CheckpointManager(bucket_dir, read_only=True) as m:
        restored = m.restore(state=target)
    np.testing.assert_array_equal(np.asarray(restored.state["w"]), np.asarray(state["w"]))
    assert restored.state["w"].sharding == NamedSharding(other, P("model", "data"))
    assert restored.meta == {"where": "remote"} and restored.state["step"] == 3


@one_job_at_a_time
def test_a_two_process_save_restores_on_two_processes_with_another_mesh(bucket_dir):
    # Real jax.distributed processes (gloo on 127.0.0.1), each writing its shards to the
    # bucket; then each of two new processes reads its half onto a (2, 4) mesh.
    saved = run_job(job.save, processes=2, devices=4, args={"dir": bucket_dir})
    assert [r.report() for r in saved] == [{"steps": [5]}] * 2
    names = {p.name for p in (epath.Path(bucket_dir) / "5" / "data").iterdir()}
    assert {"process_0-of-2.json", "process_1-of-2.json"} <= names
    (report,) = jaxckpt.verify(bucket_dir)
    assert report.ok, report
    results = run_job(
        job.plan_and_restore_onto_2_4, processes=2, devices=4, args={"dir": bucket_dir}
    )
    reports = [r.report() for r in results]
    assert [r["position"] for r in reports] == [100, 101]
    half = (64 * 16 * 4 + 16 * 4) // 2 + 8  # each reads its half of w and b, and the step
    assert all(r["plan_reads"] == [half, half] for r in reports)


def test_retention_on_object_storage_deletes_old_steps_in_the_background(bucket_dir):
    state = {"x": np.arange(1000, dtype=np.float32)}
    retention = jaxckpt.RetentionPolicy(keep_last=1)
    with jaxckpt.CheckpointManager(bucket_dir, retention=retention) as m:
        for step in (1, 2, 3):
            m.save(step, state=state)
        m.wait()
        assert m.all_steps() == [3]
    names = sorted(p.name for p in epath.Path(bucket_dir).iterdir())
    assert names == ["3"], names  # deleted steps are gone once the manager closed
    with jaxckpt.CheckpointManager(bucket_dir, read_only=True) as m:
        np.testing.assert_array_equal(m.restore().state["x"], state["x"])


def test_slow_deletes_on_object_storage_never_block_a_save(bucket_dir):
    """Retention hides a step with a tombstone object and deletes it in the background: with
    the deleting thread stalled (an object store slow to delete), saves still commit."""
    stalled, release = threading.Event(), threading.Event()

    def slow_remove(remove, path, *args):
        stalled.set()
        assert release.wait(60), "the test never released the deleter"
        return remove(path, *args)

    state = {"x": np.arange(1000, dtype=np.float32)}
    root = epath.Path(bucket_dir)
    m = faults.manager(
        bucket_dir,
        retention=jaxckpt.RetentionPolicy(keep_last=1),
        store=faults.store(remove=slow_remove),
    )
    try:
        m.save(1, state=state)
        m.save(2, state=state)  # commits step 1, then step 2: retention deletes step 1
        m.save(3, state=state)
        m.wait()
        assert stalled.is_set()
        assert m.all_steps() == [3]
        # Steps 1 and 2 are still there, hidden by their tombstones, from every reader.
        names = sorted(p.name for p in root.iterdir())
        assert names == [
            ".jaxckpt-writer.lock",
            *("1", "1.jaxckpt-tombstone", "2", "2.jaxckpt-tombstone", "3"),
        ], names
        with jaxckpt.CheckpointManager(bucket_dir, read_only=True) as reader:
            assert reader.all_steps() == [3]
        assert [r.step for r in jaxckpt.verify(bucket_dir)] == [3]
    finally:
        release.set()
        m.close()
    assert sorted(p.name for p in root.iterdir()) == ["3"]


def test_a_delete_left_unfinished_on_object_storage_is_finished_by_the_next_writer(bucket_dir):
    state = {"x": np.arange(1000, dtype=np.float32)}
    with jaxckpt.CheckpointManager(bucket_dir) as m:
        m.save(1, state=state)
        m.save(2, state=state)
    # What a writer killed right after retention's tombstone leaves behind.
    root = epath.Path(bucket_dir)
    (root / "1.jaxckpt-tombstone").write_bytes(b"")
    with jaxckpt.CheckpointManager(bucket_dir, read_only=True) as reader:
        assert reader.all_steps() == [2]  # hidden at once; a reader deletes nothing
    assert (root / "1" / "commit_success.txt").exists()
    with jaxckpt.CheckpointManager(bucket_dir) as m:
        assert m.all_steps() == [2]
    assert sorted(p.name for p in root.iterdir()) == ["2"]


def test_a_writer_killed_mid_save_leaves_no_visible_step_on_object_storage(bucket_dir, caplog):
    proc = launch.start("-m", "children.remote_freezer", bucket_dir, stderr=subprocess.DEVNULL)
    try:
        status = launch.wait_stopped(proc, timeout=180)
        assert os.WIFSTOPPED(status)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    # No rename on GCS: the unfinished step sits at its final path without a commit marker.
    assert (epath.Path(bucket_dir) / "2").exists()
    assert not (epath.Path(bucket_dir) / "2" / "commit_success.txt").exists()
    # Readers see it as a save that never finished, not as damage.
    assert [(r.step, r.ok) for r in jaxckpt.verify(bucket_dir)] == [(1, True)]
    listing = json.loads(CliRunner().invoke(cli.main, ["ls", bucket_dir, "--json"]).output)
    assert [(s["step"], s["status"].split()[0]) for s in listing["steps"]] == [
        (1, "committed"),
        (2, "uncommitted"),
    ]

    # jaxckpt removes the leftover in the background from start-up: made slow here, so the
    # save of the same step number below must wait for it.
    def slow_remove(remove, path, *args):
        time.sleep(1)
        return remove(path, *args)

    # The dead writer's lease (2 s) runs out, and the next writer takes it over.
    with faults.manager(bucket_dir, store=faults.store(remove=slow_remove)) as m:
        assert f"took over the writer lease of host {socket.gethostname()} pid {proc.pid}" in (
            caplog.text
        )
        assert m.all_steps() == [1]
        np.testing.assert_array_equal(m.restore().state["x"], np.arange(1 << 20) + 1)
        m.save(2, state={"x": np.zeros(4, np.float32)})  # the step number is free again
        m.wait()
        assert m.all_steps() == [1, 2]


@pytest.mark.parametrize("corrupt", REMOTE_CORRUPTIONS.values(), ids=REMOTE_CORRUPTIONS.keys())
def test_corruption_on_object_storage_is_named_by_verify_and_restore(bucket_dir, corrupt):
    big = np.random.default_rng(0).standard_normal(256 * 1024).astype(np.float32)  # 1 MiB
    with jaxckpt.CheckpointManager(bucket_dir) as m:
        for step in (1, 2):
            m.save(step, state={"w": big + step, "b": np.ones(3) * step})
    expected = corrupt(epath.Path(bucket_dir))
    reports = {r.step: r for r in jaxckpt.verify(bucket_dir)}
    assert reports[1].ok and not reports[2].ok
    assert any(re.search(expected, p) for p in reports[2].problems), reports[2].problems
    target = {"w": np.zeros_like(big), "b": np.zeros(3)}
    with jaxckpt.CheckpointManager(bucket_dir, read_only=True) as m:
        with pytest.raises(jaxckpt.errors.CorruptCheckpointError, match=expected):
            m.restore(2, state=target)
        restored = m.restore(state=target, fallback=True)
    assert restored.step == 1 and restored.state["w"].tobytes() == (big + 1).tobytes()


def test_kill_at_a_random_moment_of_a_save_loop_on_object_storage(bucket):
    # The stress script's gs:// trial (python -m reliability.stress runs 10 of them).
    tally = Tally()
    kill_trial(2000, 1, tally, bucket=bucket.url)
    assert tally.trials == 1 and tally.failures == []


def test_export_from_object_storage_to_local_safetensors(bucket_dir, tmp_path):
    import safetensors.numpy

    weights = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.ones(4, np.float32)}
    with jaxckpt.CheckpointManager(bucket_dir) as m:
        m.save(7, state=weights)
    result = jaxckpt.export_safetensors(bucket_dir, tmp_path / "hf")  # verified, then written
    assert result.step == 7 and result.tensors == 2
    exported = safetensors.numpy.load_file(tmp_path / "hf" / "model.safetensors")
    for name, value in weights.items():
        np.testing.assert_array_equal(exported[name], value)


def test_cli_reads_a_checkpoint_on_object_storage(bucket_dir):
    main = cli.main
    with jaxckpt.CheckpointManager(bucket_dir) as m:
        m.save(5, state={"w": np.ones((4, 4), np.float32)})
    runner = CliRunner()
    listing = json.loads(runner.invoke(main, ["ls", bucket_dir, "--verify", "--json"]).output)
    (step,) = listing["steps"]
    assert step["step"] == 5 and step["status"] == "verified" and step["bytes"] > 64
    rows = runner.invoke(main, ["inspect", bucket_dir]).output.splitlines()
    assert any(r.split()[:3] == ["w", "(4,", "4)"] for r in rows), rows
    assert runner.invoke(main, ["verify", bucket_dir]).output.startswith("step 5: ok (")
    out = f"{bucket_dir}/hf"
    exported = runner.invoke(main, ["export", bucket_dir, out])
    assert exported.exit_code == 0, exported.output
    assert (epath.Path(out) / "model.safetensors").exists()


def test_every_other_entry_point_takes_a_bucket(bucket_dir, mesh, tmp_path):
    """diff, plan, rm, jaxckpt.open, export_orbax and a local tier over a persistent tier in
    the bucket."""
    runner = CliRunner()

    def state(step):
        w = np.arange(64 * 16, dtype=np.float32).reshape(64, 16) * step
        return {"w": jax.device_put(w, NamedSharding(mesh, P("data"))), "b": np.full(4, step)}

    tier = jaxckpt.LocalTier(tmp_path / "local", every_steps=2)
    policy = jaxckpt.SavePolicy(every_steps=10)
    with jaxckpt.CheckpointManager(bucket_dir, policy=policy, local=tier) as m:
        for step in range(1, 23):
            if m.should_save(step):
                m.save(step, state=state(step))
        m.wait()
        assert m.all_steps() == [10, 20]
    with jaxckpt.CheckpointManager(bucket_dir, local=tier) as m:  # a restarted job
        restored = m.restore(state=jaxckpt.target_like(state(0)))
        assert (restored.step, restored.tier) == (22, "local")
        restored = m.restore(10, state=jaxckpt.target_like(state(0)))
        assert (restored.step, restored.tier) == (10, "persistent")
        assert np.asarray(restored.state["w"]).tobytes() == np.asarray(state(10)["w"]).tobytes()
    with jaxckpt.open(bucket_dir) as reader:
        assert reader.steps() == [10, 20]
    diff = runner.invoke(cli.main, ["diff", bucket_dir, "10", "20", "--values", "--json"])
    assert diff.exit_code == 1 and json.loads(diff.output)["max_abs_diff"]["w"] == 10230, (
        diff.output
    )
    plan = runner.invoke(cli.main, ["plan", bucket_dir, "--mesh", "2x4", "--hosts", "2", "--json"])
    assert plan.exit_code == 0 and json.loads(plan.output)["mesh"] == {"data": 2, "model": 4}
    assert jaxckpt.export_orbax(bucket_dir, tmp_path / "plain", step=20) == 20
    with ocp.StandardCheckpointer() as plain:  # plain Orbax reads the export
        exported = plain.restore(tmp_path / "plain")
    assert np.asarray(exported["w"]).tobytes() == np.asarray(state(20)["w"]).tobytes()
    removed = runner.invoke(cli.main, ["rm", bucket_dir, "10"])
    assert removed.exit_code == 0, removed.output
    with jaxckpt.CheckpointManager(bucket_dir, read_only=True) as m:
        assert m.all_steps() == [20]


def test_s3_is_configured_the_way_every_aws_tool_is(s3_server, tmp_path, monkeypatch):
    """A profile's endpoint and region (AWS_PROFILE, its config file), AWS_ENDPOINT_URL_S3
    over AWS_ENDPOINT_URL: nothing jaxckpt-specific. A custom endpoint gets path-style
    addressing. Each in a new process, as a job starts."""
    url = os.environ["AWS_ENDPOINT_URL"]
    config = tmp_path / "config"
    config.write_text(f"[profile ckpt]\nendpoint_url = {url}\nregion = eu-west-1\n")
    with monkeypatch.context() as env:
        env.delenv("AWS_ENDPOINT_URL")
        env.delenv("AWS_REGION")
        env.setenv("AWS_CONFIG_FILE", str(config))
        env.setenv("AWS_PROFILE", "ckpt")
        out = run_python("-m", "children.s3_round_trip", f"{s3_server.url}/by-profile").stdout
    assert f"endpoint='{url}', region='eu-west-1', addressing_style='path'" in out, out
    with monkeypatch.context() as env:
        env.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens there
        env.setenv("AWS_ENDPOINT_URL_S3", url)
        out = run_python("-m", "children.s3_round_trip", f"{s3_server.url}/by-service").stdout
    assert f"endpoint='{url}', region='us-east-1', addressing_style='path'" in out, out


def test_import_safetensors_from_object_storage_onto_a_mesh(bucket_dir, tmp_path, mesh):
    import safetensors.numpy

    weights = {"w": np.arange(64 * 8, dtype=np.float32).reshape(64, 8), "b": np.ones(8, np.float32)}
    safetensors.numpy.save_file(weights, tmp_path / "model.safetensors")
    remote = epath.Path(bucket_dir) / "hf" / "model.safetensors"
    remote.parent.mkdir(parents=True, exist_ok=True)
    remote.write_bytes((tmp_path / "model.safetensors").read_bytes())
    target = {
        "w": jax.ShapeDtypeStruct(
            (64, 8), np.float32, sharding=NamedSharding(mesh, P("data", "model"))
        ),
        "b": jax.ShapeDtypeStruct((8,), np.float32, sharding=NamedSharding(mesh, P("model"))),
    }
    loaded = jaxckpt.load_safetensors(f"{bucket_dir}/hf", target)
    for name, value in weights.items():
        np.testing.assert_array_equal(np.asarray(loaded[name]), value)
        assert loaded[name].sharding == target[name].sharding


def test_export_from_object_storage_to_object_storage_in_shards_and_back(bucket_dir, mesh):
    weights = {f"w{i}": np.full((16, 16), i, np.float32) for i in range(4)}
    with jaxckpt.CheckpointManager(f"{bucket_dir}/ckpt") as m:
        m.save(1, state=weights)
    out = f"{bucket_dir}/hf"
    result = jaxckpt.export_safetensors(f"{bucket_dir}/ckpt", out, max_shard_size="2KB")
    assert len(result.files) == 4
    names = sorted(p.name for p in epath.Path(out).iterdir())
    assert names == sorted([*result.files, "model.safetensors.index.json"])
    with pytest.raises(jaxckpt.errors.OutputExistsError):
        jaxckpt.export_safetensors(f"{bucket_dir}/ckpt", out)
    target = {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(mesh, P("data")))
        for k, v in weights.items()
    }
    loaded = jaxckpt.load_safetensors(out, target)
    for name, value in weights.items():
        np.testing.assert_array_equal(np.asarray(loaded[name]), value)


def test_live_save_safetensors_to_object_storage_in_shards(bucket_dir, mesh, tmp_path):
    """A sharded live state streamed to a bucket, then read back by the safetensors library
    itself (from a download) and by load_safetensors onto another sharding."""
    from safetensors.numpy import load_file

    rng = np.random.default_rng(0)
    host = {
        "embed": rng.standard_normal((64, 32), np.float32),
        "blocks": {"qkv": rng.standard_normal((3, 32, 32), np.float32)},
        "scale": np.float32(2.5),
    }
    state = {
        "embed": jax.device_put(host["embed"], NamedSharding(mesh, P("data", "model"))),
        "blocks": {"qkv": jax.device_put(host["blocks"]["qkv"], NamedSharding(mesh, P()))},
        "scale": host["scale"],
    }
    out = f"{bucket_dir}/hf"
    result = jaxckpt.save_safetensors(state, out, max_shard_size="8KB")
    assert len(result.files) == 3  # 8 KiB, 12 KiB, 4 bytes
    assert (epath.Path(out) / "model.safetensors.index.json").exists()
    with pytest.raises(jaxckpt.errors.OutputExistsError):
        jaxckpt.save_safetensors(state, out)
    got = {}
    for name in result.files:
        local = tmp_path / name
        local.write_bytes((epath.Path(out) / name).read_bytes())
        got.update(load_file(local))
    np.testing.assert_array_equal(got["embed"], host["embed"])
    np.testing.assert_array_equal(got["blocks.qkv"], host["blocks"]["qkv"])
    assert got["scale"].shape == () and got["scale"] == host["scale"]
    target = jax.ShapeDtypeStruct((64, 32), np.float32, sharding=NamedSharding(mesh, P("model")))
    loaded = jaxckpt.load_safetensors(out, {"embed": target}, ignore="blocks.*|scale")
    np.testing.assert_array_equal(np.asarray(loaded["embed"]), host["embed"])


# --- requests: each process makes them at pod scale, so they are counted ------------------


def test_a_folder_tree_on_object_storage_is_listed_in_one_request_however_many_folders(
    bucket_dir, bucket
):
    # A step holds a folder per process that wrote it (ocdbt.process_<i>/d/...): listed one
    # folder at a time, every process's verification made O(processes) requests.
    root = epath.Path(bucket_dir)
    names = [*sorted(f"state/ocdbt.process_{i}/d/{i:04x}" for i in range(12)), "top.json"]
    for name in names:
        (root / name).write_bytes(b"x")
    since = bucket.mark()
    found = sorted(str(p.relative_to(root)) for p in _storage.files_below(root))
    assert found == names
    assert bucket.requests(since) == [("list", f"{root.name}/")]


def test_a_file_on_object_storage_is_read_in_one_request_a_read_and_none_to_open(
    bucket_dir, bucket
):
    root = epath.Path(bucket_dir)
    (root / "a/b.bin").write_bytes(bytes(range(200)))
    name = f"{root.name}/a/b.bin"
    since = bucket.mark()
    with _storage.open_inside(root, "a/b.bin") as f:  # read whole: one request
        assert f.read() == bytes(range(200))
    with _storage.open_inside(root, "a/b.bin", size=200) as f:  # a part, its size known
        f.seek(50)
        view = bytearray(100)
        assert f.readinto(view) == 100 and bytes(view) == bytes(range(50, 150))
        f.seek(190)
        assert f.readinto(view) == 10  # the end: no request past it
        assert f.readinto(view) == 0
    with _storage.open_inside(root, "a/b.bin") as f:  # in parts, its size not known
        assert [len(f.read(150)), len(f.read(150)), len(f.read(150))] == [150, 50, 0]
    assert bucket.requests(since) == [("read", name)] * 5
    with _storage.open_inside(root, "a/missing") as f, pytest.raises(FileNotFoundError):
        f.read()
    (root / "a/empty").write_bytes(b"")
    with _storage.open_inside(root, "a/empty") as f:  # a range the store refuses: the end
        assert f.read(10) == b"" and f.read(10) == b"" and f.read() == b""
    with _storage.open_inside(root, "a/b.bin") as f:
        assert f.seek(-10, os.SEEK_END) == 190 and f.read() == bytes(range(190, 200))
        with pytest.raises(OSError, match="before its start"):
            f.seek(-1)


def test_a_restore_from_object_storage_reads_no_others_array_metadata_and_stats_no_packed_file(
    mesh, bucket_dir, bucket
):
    # Orbax's array restore read every process's array_metadatas/ (to find PRNG key impls,
    # which jaxckpt records itself), and the packed reader asked for each packed file's size:
    # both O(processes) requests on each process.
    rng = np.random.default_rng(0)
    state = {
        "big": jax.device_put(
            rng.standard_normal((1024, 512), np.float32), NamedSharding(mesh, P("data"))
        ),
        "small": jax.device_put(rng.standard_normal((8, 4), np.float32), NamedSharding(mesh, P())),
    }
    with jaxckpt.CheckpointManager(bucket_dir) as m:
        m.save(1, state=state, rng=jax.random.key(1))
    since = bucket.mark()
    with jaxckpt.CheckpointManager(bucket_dir, read_only=True) as m:
        got = m.restore(state=jaxckpt.target_like(state), rng=jax.random.key(0))
    for k in state:
        assert np.asarray(got.state[k]).tobytes() == np.asarray(state[k]).tobytes()
    assert jax.random.key_data(got.rng).tolist() == jax.random.key_data(jax.random.key(1)).tolist()
    made = bucket.requests(since)
    assert ("read", f"{epath.Path(bucket_dir).name}/1/packed/0-of-1.bin") in made  # it was read
    # Orbax's read of every process's file lists their folder first; this process's own
    # it may still read (one file, whatever the process count).
    assert [r for r in made if r[1].endswith("/array_metadatas/")] == []
    assert [r for r in made if r[0] == "metadata" and "/packed/" in r[1]] == []


# --- a store that is down, refuses us, or has no such bucket: a named error ----------------


def _pointed_at(bucket, url):
    """The environment that sends `bucket`'s store's clients to the endpoint `url`."""
    return (s3 if bucket.url.startswith("s3://") else gcs).point_at(url)


class _Refusing(http.server.BaseHTTPRequestHandler):
    """Answers every request 403, in each store's own words, as S3 and GCS answer
    credentials that have no access to a bucket."""

    def _refuse(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.path.startswith(("/storage/", "/upload/", "/download/")):
            error = {
                "code": 403,
                "message": "ci@test.iam.gserviceaccount.com does not have "
                "storage.objects.list access to the Google Cloud Storage bucket.",
            }
            body, kind = json.dumps({"error": {**error, "errors": [error]}}).encode(), "json"
        else:
            body = b"<Error><Code>AccessDenied</Code><Message>Access Denied</Message></Error>"
            kind = "xml"
        self.send_response(403)
        self.send_header("Content-Type", f"application/{kind}")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _refuse

    def log_message(self, *args):
        pass


@pytest.fixture
def refusing_endpoint():
    """An endpoint on 127.0.0.1 that answers every request 403 (access denied)."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Refusing)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    thread.join(timeout=30)


@pytest.mark.parametrize("command", ["ls", "inspect"])
def test_a_store_that_is_down_is_one_line_naming_it_on_the_command_line(bucket, command):
    down = f"http://127.0.0.1:{launch.free_port()}"  # bound, then closed: nothing listens
    url = f"{bucket.url}/run"
    # (a store that is down is tried again for the give-up time: 4 s here, not 30)
    env = {**_pointed_at(bucket, down), "JAXCKPT_STORAGE_TIMEOUT_S": "4"}
    proc = run_python("-m", "jaxckpt", command, url, timeout=120, check=False, env=env)
    assert proc.returncode == 1 and proc.stdout == "", (proc.stdout, proc.stderr)
    (line,) = proc.stderr.splitlines()  # one line: no traceback, no logged retries
    assert line.startswith(f"jaxckpt: error: {url}: the store at {down} could not be reached ("), (
        line
    )
    assert "JAXCKPT_STORAGE_TIMEOUT_S" in line and "Check the endpoint" in line, line

    args = [command, url, "--json", "--storage-timeout", "4"]
    proc = run_python("-m", "jaxckpt", *args, timeout=120, check=False, env=env)
    doc = json.loads(proc.stdout)
    assert proc.returncode == 1 and doc["type"] == "StorageError", proc
    assert "gives up on a store within 4 s" in doc["error"], doc


def test_a_store_that_is_down_is_a_named_error_at_every_entry_point(bucket):
    down = f"http://127.0.0.1:{launch.free_port()}"
    url = f"{bucket.url}/run"
    give_up_s = 4
    env = {**_pointed_at(bucket, down), "JAXCKPT_STORAGE_TIMEOUT_S": str(give_up_s)}
    proc = run_python("-m", "children.store_errors", url, timeout=300, env=env)
    results = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(results) == 4, proc.stdout
    for r in results:
        assert r["type"] == "StorageError", r
        assert r["message"].startswith(f"{url}: the store at {down} could not be reached ("), r
        # Tried again for the give-up time (a store down for a moment is waited out), then
        # given up: not for gcsfs's own six attempts, 1-16 s apart, nor for ever.
        assert give_up_s / 2 < r["seconds"] < give_up_s + 8, r


def test_a_store_that_refuses_access_is_a_named_error(bucket, refusing_endpoint):
    url = f"{bucket.url}/run"
    env = _pointed_at(bucket, refusing_endpoint)
    proc = run_python("-m", "children.store_errors", url, timeout=300, env=env)
    results = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(results) == 4, proc.stdout
    for r in results:
        assert r["type"] == "StorageError", r
        assert r["message"].startswith(f"{url}: the store at {refusing_endpoint} refused access"), r
        assert "Check the credentials" in r["message"], r
    proc = run_python("-m", "jaxckpt", "ls", url, timeout=120, check=False, env=env)
    (line,) = proc.stderr.splitlines()
    assert proc.returncode == 1 and "refused access" in line, line


def test_a_bucket_that_does_not_exist_is_a_named_error(bucket):
    scheme = bucket.url.partition("://")[0]
    url = f"{scheme}://no-such-bucket-jaxckpt/run"
    for call in (
        lambda: jaxckpt.CheckpointManager(url),
        lambda: jaxckpt.CheckpointManager(url, read_only=True),
        lambda: jaxckpt.open(url),
        lambda: jaxckpt.verify(url),
    ):
        with pytest.raises(jaxckpt.errors.StorageError, match="has no bucket no-such-bucket-jax"):
            call()
    result = CliRunner().invoke(cli.main, ["ls", url])
    assert result.exit_code == 1
    assert result.stderr.startswith(f"jaxckpt: error: {url}: the store at "), result.stderr
    assert "has no bucket no-such-bucket-jaxckpt" in result.stderr
    with pytest.raises(jaxckpt.errors.NoCheckpointError):  # a bucket there: not this error
        jaxckpt.CheckpointManager(f"{bucket.url}/nothing-here", read_only=True)


def test_a_give_up_time_that_is_not_a_number_of_seconds_is_refused(bucket_dir, monkeypatch):
    for value in ("abc", "0", "-1", "nan", "inf"):
        monkeypatch.setenv("JAXCKPT_STORAGE_TIMEOUT_S", value)
        with pytest.raises(jaxckpt.errors.ConfigError, match="not a number of seconds above 0"):
            jaxckpt.CheckpointManager(bucket_dir, read_only=True)
    result = CliRunner().invoke(cli.main, ["ls", bucket_dir, "--storage-timeout", "0"])
    assert result.exit_code == 2 and "--storage-timeout" in result.output, result.output

"""What jaxckpt relies on beyond Orbax's public API, one test each (`jaxckpt/_internals.py`,
the one module fenced off for it): an Orbax or JAX upgrade that removes one fails here, by name, rather
than somewhere deep in a save. The text of JAX's coordination-service errors that
`missing_processes` reads is checked where a real process dies: tests/test_multihost.py."""

import asyncio
import concurrent.futures
import json
import subprocess
import threading

import numpy as np
import orbax.checkpoint as ocp
from etils import epath

import jaxckpt
from jaxckpt import _internals, _retries, _store_time


def test_the_array_metadata_store_is_orbaxs_default():
    store = _internals.array_metadata_store()
    assert type(store).__module__.startswith("orbax.checkpoint._src.metadata"), type(store)


def test_writes_done_is_announced_before_the_commit(tmp_path):
    seen = []

    def writes_done():
        seen.append(sorted(p.name for p in tmp_path.iterdir() if p.name != ".jaxckpt-writer.lock"))

    with _internals.on_writes_done(writes_done), jaxckpt.CheckpointManager(tmp_path) as m:
        m.save(1, state={"x": np.arange(8.0)})
        m.wait()
    assert seen == [["1.orbax-checkpoint-tmp"]], (
        f"Orbax no longer records {_internals.WRITES_DONE_EVENT} once a save's arrays are "
        f"written and before its commit (seen: {seen})"
    )


def test_orbax_records_a_typed_keys_impl_in_its_array_metadata(tmp_path):
    import jax

    with ocp.CheckpointManager(tmp_path) as m:
        m.save(1, args=ocp.args.StandardSave({"k": jax.random.key(0, impl="rbg"), "w": np.ones(2)}))
    impls = _internals.key_impls(tmp_path / "1" / "default")
    assert impls == {"k": "rbg"}, (
        f"Orbax's array_metadatas/ no longer name a typed key's impl as ext_metadata "
        f"random_key_impl (found {impls}): update _internals.key_impls"
    )


def test_an_arrays_device_buffers_come_in_the_order_of_its_shards(mesh):
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    x = jax.device_put(np.arange(64.0).reshape(8, 8), NamedSharding(mesh, P("data", "model")))
    buffers = _internals.device_buffers(x)
    assert [b.devices() for b in buffers] == [{s.device} for s in x.addressable_shards], (
        "jax.Array._arrays no longer lists the single-device arrays in the order of "
        "addressable_shards: update _internals.device_buffers"
    )
    for b, s in zip(buffers, x.addressable_shards, strict=True):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(s.data))


def test_jaxs_batched_device_put_places_host_arrays_as_device_put_does(mesh):
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    sharding = NamedSharding(mesh, P("data", "model"))
    hosts = [np.arange(64, dtype=np.float32).reshape(8, 8) + i for i in range(3)]
    got = _internals.put_batched(hosts, sharding)
    for g, h in zip(got, hosts, strict=True):
        assert g.sharding == sharding and g.shape == h.shape and g.dtype == h.dtype
        assert [s.index for s in g.addressable_shards] == [
            s.index for s in jax.device_put(h, sharding).addressable_shards
        ]
        np.testing.assert_array_equal(np.asarray(g), h)


def test_jaxs_distributed_state_names_the_coordinator():
    """`_internals.coordinator_route` reads the coordinator's address from JAX's distributed
    state (None until jax.distributed.initialize; the 2-process local-tier tests run it
    with a coordinator on 127.0.0.1, whose route is 127.0.0.1)."""
    from jax._src import distributed

    assert hasattr(distributed.global_state, "coordinator_address"), (
        "jax._src.distributed.global_state no longer has coordinator_address: update "
        "_internals.coordinator_route"
    )
    assert _internals.coordinator_route() == "127.0.0.1"  # no coordinator in this process


def _chunk_codecs(item_dir):
    import tensorstore as ts

    kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{item_dir}/"}).result()
    zarr = json.loads(kv["w/zarr.json"])
    (shard,) = [c for c in zarr["codecs"] if c["name"] == "sharding_indexed"]
    return [c["name"] for c in shard["configuration"]["codecs"]]


def test_orbax_builds_every_array_spec_in_the_function_jaxckpt_wraps(tmp_path):
    # jaxckpt's arrays carry a CRC-32C per chunk, which a restore relies on to read each
    # byte once (_integrity); plain Orbax's saves in the same process stay as Orbax made them.
    w = np.arange(1024 * 512, dtype=np.float32).reshape(1024, 512)  # 2 MiB: an Orbax array
    with jaxckpt.CheckpointManager(tmp_path / "ours", incremental=False) as m:
        m.save(1, state={"w": w})
    assert _chunk_codecs(tmp_path / "ours" / "1" / "state")[-1] == "crc32c", (
        "Orbax no longer builds its array specs in tensorstore_utils.build_array_write_spec "
        "(or its zarr3 codecs moved): update _internals._checksums"
    )
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_zarr3=True)) as plain:
        plain.save(tmp_path / "plain", args=ocp.args.PyTreeSave({"w": w}))
    assert "crc32c" not in _chunk_codecs(tmp_path / "plain")


def test_orbax_builds_every_kvstore_spec_in_the_function_jaxckpt_wraps_for_s3(s3_server):
    # Orbax knows only gs:// and local paths: jaxckpt's wrap (_internals._object_kvstores) makes
    # its specs of an s3:// folder tensorstore's s3 driver, for reads and writes alike.
    from orbax.checkpoint._src.serialization import tensorstore_utils

    directory = f"{s3_server.url}/boundary-kvstores"
    w = np.arange(1024 * 512, dtype=np.float32).reshape(1024, 512)  # 2 MiB: an Orbax array
    with jaxckpt.CheckpointManager(directory, incremental=False) as m:
        m.save(1, state={"w": w})
    assert "manifest.ocdbt" in {p.name for p in (epath.Path(directory) / "1" / "state").iterdir()}
    with jaxckpt.CheckpointManager(directory, read_only=True) as m:
        assert np.asarray(m.restore().state["w"]).tobytes() == w.tobytes()
    build = tensorstore_utils.build_kvstore_tspec
    releases = [_internals.hold(epath.Path(d), written=False) for d in ("s3://b", "gs://bucket")]
    try:
        for ocdbt in (True, False):
            spec = json.dumps(build("s3://b/k", use_ocdbt=ocdbt))
            assert '"driver": "s3"' in spec and "gcs" not in spec and "gs://" not in spec, (
                "Orbax no longer builds its kvstore specs in tensorstore_utils."
                "build_kvstore_tspec (or their GCS driver changed): update "
                f"_internals._object_kvstores. Got {spec}"
            )
        # Each store's driver tries a request again for the give-up time (_retries), not
        # tensorstore's 32 times up to 32 s apart (issue 49), nor 3 times (issue 64).
        wanted = json.dumps(_retries.tensorstore_retries(_store_time.give_up_s()))
        for url, retries in (
            ("s3://b/k", "s3_request_retries"),
            ("gs://bucket/k", "gcs_request_retries"),
        ):
            spec = json.dumps(build(url, use_ocdbt=True))
            assert f'"context": {{"{retries}": {wanted}' in spec, spec

        # below no directory jaxckpt has open: Orbax's own spec, as without jaxckpt (an
        # s3:// path refused as Orbax refuses it)
        def outcome(function, url):
            try:
                return function(url, use_ocdbt=True)
            except ValueError as e:
                return str(e)

        for url in ("gs://another/k", "/tmp/another", "s3://b2/k"):
            assert outcome(build, url) == outcome(build.__wrapped__, url), url
        assert "should be absolute" in outcome(build, "s3://b2/k")
    finally:
        for release in releases:
            release()
    assert build("gs://bucket/k", use_ocdbt=True) == build.__wrapped__(
        "gs://bucket/k", use_ocdbt=True
    )


def test_orbax_names_the_barrier_after_a_saves_writes_as_jaxckpt_hooks_it():
    """Each process of a job hashes the files it wrote at Orbax's barrier after its writes
    (`_internals.barrier_after_writes`, found by its key; tests/test_spread.py counts what
    every process reads while saving), and process 0 gathers the digests from JAX's
    key-value store (`publish`, `take`)."""
    import inspect

    from jax._src import distributed
    from jax._src.lib import _jax
    from orbax.checkpoint._src.checkpointers import async_checkpointer

    source = inspect.getsource(async_checkpointer._background_wait_for_commit_futures)
    assert f"'{_internals.WRITE_BARRIER}'" in source, (
        "Orbax's background save no longer meets a barrier named "
        f"{_internals.WRITE_BARRIER!r} once a process's writes are done: update "
        "_internals.WRITE_BARRIER"
    )
    assert hasattr(distributed.global_state, "client"), "update _internals._coordination"
    for method in ("key_value_set", "key_value_dir_get", "key_value_delete"):
        assert hasattr(_jax.DistributedRuntimeClient, method), f"update _internals: {method}"


def test_the_coordination_services_waits_that_end_take_a_timeout():
    """Every agreement between processes (`_agree`) waits at a barrier of JAX's
    coordination service or for a key, each with a timeout in ms (tests/test_stalls.py
    meets them with a stopped process, and reads who is missing from the error)."""
    import inspect

    from jax._src.lib import _jax

    client = _jax.DistributedRuntimeClient
    for method in ("wait_at_barrier", "blocking_key_value_get"):
        doc = inspect.getdoc(getattr(client, method)) or ""
        assert "timeout_in_ms: int" in doc, f"update _internals.barrier/wait_for: {doc}"
    text = "Barrier timed out. Id: x. Some timed out task names:\n1\n3\n\n"
    assert _internals.missing_processes(RuntimeError(text)) == [1, 3]


def test_the_collectives_and_client_calls_counted_are_jaxs():
    """`_internals.count_collectives` (benchmarks/scale.py's counts per save and restore)
    wraps JAX's multihost collectives by name and the coordination client's calls; a
    collective made inside another is not counted twice, and all is put back after."""
    from jax._src import distributed
    from jax._src.lib import _jax
    from jax.experimental import multihost_utils

    for name in _internals.COLLECTIVES:
        assert callable(getattr(multihost_utils, name, None)), f"update _internals: {name}"
    for name in _internals.CLIENT_CALLS:
        assert hasattr(_jax.DistributedRuntimeClient, name), f"update _internals: {name}"
    originals = [getattr(multihost_utils, name) for name in _internals.COLLECTIVES]
    with _internals.count_collectives() as counts:
        multihost_utils.sync_global_devices("jaxckpt-boundary")  # gathers inside: counted once
        multihost_utils.process_allgather(np.int32(1))
        multihost_utils.process_allgather(np.int32(2))
    assert counts == {"sync_global_devices": 1, "process_allgather": 2}, counts
    assert [getattr(multihost_utils, name) for name in _internals.COLLECTIVES] == originals
    assert distributed.global_state.client is None  # one process: no client to count


def test_a_failed_folder_creation_wakes_the_saves_writers_through_the_wrapped_functions(tmp_path):
    # Orbax makes a step's folders in the background and its writers wait for them for 300 s;
    # jaxckpt's wrap (_internals._wakes) wakes them when the creation fails.
    directory = tmp_path / "ckpt"
    m = jaxckpt.CheckpointManager(directory)
    m.save(1, state={"w": np.ones((1024, 512), np.float32)})
    m.wait()
    subprocess.run(["chattr", "+i", str(directory)], check=True, timeout=30)
    try:
        failed = concurrent.futures.Future()

        def save_and_wait():
            try:
                m.save(2, state={"w": np.zeros((1024, 512), np.float32)})
                m.wait()
            except Exception as e:
                failed.set_result(e)
            else:
                failed.set_result(None)

        threading.Thread(target=save_and_wait, daemon=True).start()
        try:
            error = failed.result(timeout=60)
        except concurrent.futures.TimeoutError:
            raise AssertionError(
                "a save whose folders could not be made still waits for them: Orbax no "
                "longer makes them in atomicity._create_paths, started by "
                "atomicity.create_all_async: update _internals._wakes"
            ) from None
        assert isinstance(error, jaxckpt.errors.SaveError), error
        assert "Permission denied" in str(error) or "Operation not permitted" in str(error), error
    finally:
        subprocess.run(["chattr", "-i", str(directory)], check=True, timeout=30)
    m.close()  # the failure was raised once, by wait()


def test_a_save_started_while_its_writers_are_held_makes_its_folders_once_released(tmp_path):
    # jaxckpt's save starts its background once its blocking part returns
    # (_internals.writers_held, through the wrap of atomicity._create_paths).
    directory = epath.Path(tmp_path / "ckpt")
    _internals.install()
    release = _internals.hold(directory, written=True)
    m = ocp.CheckpointManager(directory)
    try:
        with _internals.writers_held() as hold:
            m.save(1, args=ocp.args.StandardSave({"w": np.ones((256, 256), np.float32)}))
            assert hold.parked.wait(timeout=60), (
                "a held save never reached the creation of its folders: Orbax no longer makes "
                "them in atomicity._create_paths: update _internals._wakes"
            )
            assert not [p.name for p in directory.iterdir() if p.name.startswith("1")]
        m.wait_until_finished()
        assert m.all_steps() == [1]
        restored = m.restore(1, args=ocp.args.StandardRestore())
        assert np.array_equal(restored["w"], np.ones((256, 256), np.float32))
    finally:
        m.close()
        release()


def test_orbax_reads_each_shard_in_the_function_jaxckpt_wraps_into_a_zero_copy_buffer(tmp_path):
    # A restore on CPU devices reads each byte once into its final buffer: Orbax reads every
    # shard in serialization._read_shard, which jaxckpt's wrap (_internals._aligned_reads) reads
    # into a buffer JAX's CPU client takes as its own (else device_put copies it).
    import inspect

    import jax
    import tensorstore as ts
    from orbax.checkpoint._src.serialization import serialization

    _internals.install()
    read_shard = serialization._read_shard
    expected = ["t", "new_shard_shape", "dtype", "requested_domain", "restricted_domain"]
    assert list(inspect.signature(read_shard).parameters) == expected, (
        "Orbax's serialization._read_shard changed its arguments: update _internals._aligned_reads"
    )
    source = inspect.getsource(serialization._read_array_index_and_device_put)
    assert "await _read_shard(" in source and "jax.device_put(shard" in source, (
        "Orbax no longer reads each shard in serialization._read_shard and places it with "
        "jax.device_put: update _internals._aligned_reads"
    )

    def read(t, shape, dtype=None, restricted=None):
        coroutine = read_shard(
            t,
            new_shard_shape=shape,
            dtype=dtype,
            requested_domain=ts.IndexDomain(shape=shape),
            restricted_domain=restricted or t.domain.intersect(ts.IndexDomain(shape=shape)),
        )
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            return pool.submit(asyncio.run, coroutine).result()

    def array(stored, folder):  # a zarr3 array in a folder, as Orbax's are
        spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(folder)}}
        t = ts.open(spec, create=True, dtype=stored.dtype, shape=stored.shape).result()
        t.write(stored).result()
        return t

    # a small shard (an aligned block of the heap) and one of 2 MiB (pages of its own);
    # each read whole, and into a larger shard (stored smaller: the rest is zeros, as
    # Orbax's own), below a directory jaxckpt has open
    release = _internals.hold(epath.Path(tmp_path / "open"), written=False)
    for rows, columns in ((6, 8), (6, 2**16 // 6 * 8)):
        stored = np.arange(rows * columns, dtype=np.float32).reshape(rows, columns)
        t = array(stored, tmp_path / "open" / f"{rows}x{columns}")
        for shape in ((rows, columns), (rows + 2, columns)):
            shard = read(t, shape)
            want = np.zeros(shape, np.float32)
            want[:rows] = stored
            np.testing.assert_array_equal(shard, want)
            placed = jax.device_put(shard, jax.devices("cpu")[0])
            assert placed.unsafe_buffer_pointer() == shard.ctypes.data, (
                "JAX's CPU client copied an aligned host buffer: update _host_buffers.CPU_ALIGNMENT"
            )
            del placed
            assert np.array_equal(shard, want)  # the buffer outlives the device's array
    stored = np.arange(48, dtype=np.float32).reshape(6, 8)
    t = array(stored, tmp_path / "open" / "cast")
    got = read(t, (6, 8), dtype=np.float16)  # a cast: Orbax's own read
    assert got.dtype == np.float16 and np.array_equal(got, stored.astype(np.float16))
    release()
    # below no directory jaxckpt has open: Orbax's own read (its own buffer: np.zeros's)
    t = array(stored, tmp_path / "open" / "closed")
    assert _internals._store_url(t) == f"{tmp_path}/open/closed/"
    shard = read(t, (6, 8))
    np.testing.assert_array_equal(shard, stored)

"""The one writer of a directory: its lock file on local disk, its lease on object storage.
A second writer is refused, a dead one's lock taken over, and a writer that lost its lock
(the file deleted or replaced, the lease taken over while it was frozen) commits and
deletes nothing more; a planted lock file is refused, never written through."""

import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from etils import epath
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from conftest import run_python
from jaxckpt import _leases, errors
from jaxckpt._lock import ObjectLease
from reliability import faults, hostile, launch
from reliability.buckets import stolen_lease_trial
from reliability.stress import Tally

BIG = np.random.default_rng(0).standard_normal(256 * 1024).astype(np.float32)  # 1 MiB


def state_at(mesh, step):
    return {
        "params": {
            "w": jax.device_put(jnp.full((8, 8), step, jnp.float32), NamedSharding(mesh, P("data")))
        },
        "b": np.full(4, step, np.float32),
    }


@pytest.fixture
def ckpt(tmp_path, mesh):
    """Steps 1 and 2, no lock file."""
    directory = tmp_path / "ckpt"
    with jaxckpt.CheckpointManager(directory) as m:
        for step in (1, 2):
            m.save(step, state=state_at(mesh, step))
    (directory / ".jaxckpt-writer.lock").unlink()  # (released: an empty file)
    return directory


@pytest.fixture
def outside(tmp_path):
    """A file beside the checkpoint that nothing may write."""
    folder = tmp_path / "outside"
    folder.mkdir()
    (folder / "precious").write_text("keep me")
    return folder


# --------------------------------------------------------------------- the lock file (local)


def test_one_writer_per_directory(ckpt):
    with jaxckpt.CheckpointManager(ckpt) as writer:
        with pytest.raises(errors.LockedError, match=r"is being written by host .* pid \d+"):
            jaxckpt.CheckpointManager(ckpt)
        with jaxckpt.CheckpointManager(ckpt, read_only=True) as reader:  # readers: no lock
            assert reader.latest_step() == 2
            with pytest.raises(errors.ConfigError, match="read_only"):
                reader.save(3, state={"w": BIG})
        writer.save(3, state={"w": BIG, "b": np.ones(3)})
    with jaxckpt.CheckpointManager(ckpt) as again:  # released on close
        assert again.all_steps() == [1, 2, 3]


@pytest.mark.parametrize("where", ["run", "run/nested/deeper", "."], ids=["new", "deep", "itself"])
def test_a_directory_this_process_cannot_write_is_named_with_what_to_do(tmp_path, where):
    # Before: a raw PermissionError from the lock's mkdir (the Quickstart's /ckpt/quickstart
    # run by a user who is not root). `chattr +i` refuses even root, which runs these tests.
    parent = tmp_path / "shared"
    parent.mkdir()
    subprocess.run(["chattr", "+i", str(parent)], check=True, timeout=30)
    try:
        with pytest.raises(errors.NotWritableError, match=r"cannot save in .*as user .*Choose a"):
            jaxckpt.CheckpointManager(parent / where)
        code = f"import jaxckpt; jaxckpt.CheckpointManager({str(parent / where)!r})"
        result = run_python("-c", code, check=False)
        assert "NotWritableError" in result.stderr and "PermissionError" not in result.stderr
        with jaxckpt.CheckpointManager(parent, read_only=True) as m:  # a reader writes nothing
            assert m.all_steps() == []
    finally:
        subprocess.run(["chattr", "-i", str(parent)], check=True, timeout=30)
    assert list(parent.iterdir()) == []


def test_a_dead_writers_lock_is_taken_over(ckpt, caplog):
    code = f"import jaxckpt, os, signal; m = jaxckpt.CheckpointManager({str(ckpt)!r}); os.kill(os.getpid(), signal.SIGKILL)"
    proc = run_python("-c", code, timeout=120, check=False)
    assert proc.returncode == -signal.SIGKILL
    assert '"pid"' in (ckpt / ".jaxckpt-writer.lock").read_text()  # the dead holder's note
    with (
        caplog.at_level(logging.WARNING, logger="jaxckpt"),
        jaxckpt.CheckpointManager(ckpt) as m,
    ):
        assert m.all_steps() == [1, 2]
    assert "taking over the writer lock of host" in caplog.text


def test_a_symlinked_lock_file_is_refused_and_its_target_untouched(ckpt, outside):
    (ckpt / ".jaxckpt-writer.lock").symlink_to(outside / "precious")
    with pytest.raises(errors.LockedError, match=r"not a lock file .* never writes through a link"):
        jaxckpt.CheckpointManager(ckpt)
    assert (outside / "precious").read_text() == "keep me"
    assert jaxckpt.CheckpointManager(ckpt, read_only=True).all_steps() == [1, 2]


def test_a_hard_linked_lock_file_is_refused(ckpt, outside):
    os.link(outside / "precious", ckpt / ".jaxckpt-writer.lock")
    with pytest.raises(errors.LockedError, match="2 hard links"):
        jaxckpt.CheckpointManager(ckpt)
    assert (outside / "precious").read_text() == "keep me"


def test_a_writer_whose_lock_was_deleted_commits_nothing_more(ckpt, mesh):
    a = jaxckpt.CheckpointManager(ckpt)
    a.save(3, state=state_at(mesh, 3))
    a.wait()
    (ckpt / ".jaxckpt-writer.lock").unlink()
    with jaxckpt.CheckpointManager(ckpt) as b:  # the path is free: a second writer gets in
        b.save(100, state=state_at(mesh, 100))
    with pytest.raises(errors.LockedError, match=r"lost the writer lock .* was (removed|replaced)"):
        a.save(4, state=state_at(mesh, 4))
    with pytest.raises(errors.LockedError):  # for good
        a.save(5, state=state_at(mesh, 5))
    a.close()
    assert jaxckpt.CheckpointManager(ckpt, read_only=True).all_steps() == [1, 2, 3, 100]


def test_a_lock_deleted_during_a_save_stops_its_commit(ckpt, mesh):
    """The lock goes between the save's start and its commit: the commit is refused."""

    def lock_gone_first(before_commit, step_dir):
        (ckpt / ".jaxckpt-writer.lock").unlink()
        before_commit(step_dir)

    a = faults.manager(ckpt, store=faults.store(before_commit=lock_gone_first))
    a.save(3, state=state_at(mesh, 3))
    with pytest.raises(errors.SaveError, match="lost the writer lock") as caught:
        a.wait()
    assert not caught.value.committed
    a.close()
    assert jaxckpt.CheckpointManager(ckpt, read_only=True).all_steps() == [1, 2]


def test_a_save_whose_files_a_new_writer_removed_says_the_lock_was_lost(ckpt, mesh):
    """A second writer took the directory over (the lock file was deleted) and removed the
    first one's unfinished save as a leftover: that save's failure names the lost lock, the
    cause, not the missing file it tripped on."""

    def taken_over(before_commit, step_dir):
        (ckpt / ".jaxckpt-writer.lock").unlink()
        shutil.rmtree(step_dir)  # as the next writer's start-up removes leftovers
        before_commit(step_dir)

    a = faults.manager(ckpt, store=faults.store(before_commit=taken_over))
    a.save(3, state=state_at(mesh, 3))
    with pytest.raises(errors.SaveError, match="LockedError: this job lost the writer lock"):
        a.wait()
    a.close()
    assert jaxckpt.CheckpointManager(ckpt, read_only=True).all_steps() == [1, 2]


def test_a_writer_that_lost_its_lock_after_a_commit_deletes_nothing(ckpt, mesh):
    """The lock goes after a step committed and before retention deletes the older ones: the
    directory may be another writer's now, so nothing is deleted (LockedError)."""

    def then_lock_gone(committed):
        committed()
        (ckpt / ".jaxckpt-writer.lock").unlink(missing_ok=True)

    a = faults.manager(
        ckpt,
        retention=jaxckpt.RetentionPolicy(keep_last=1),
        store=faults.store(wait=then_lock_gone),
    )
    a.save(3, state=state_at(mesh, 3))
    with pytest.raises(errors.LockedError, match="lost the writer lock"):
        a.wait()
    a.close()
    assert jaxckpt.CheckpointManager(ckpt, read_only=True).all_steps() == [1, 2, 3]


def test_a_whole_directory_removed_under_a_writer(ckpt, mesh):
    a = jaxckpt.CheckpointManager(ckpt)
    shutil.rmtree(ckpt)
    with pytest.raises(errors.LockedError, match="was removed"):
        a.save(3, state=state_at(mesh, 3))
    a.close()


# ------------------------------------------------- against a writer in another process


def test_the_lock_deleted_under_a_writer_in_a_loop():
    # python -m reliability.stress runs more seeds of it
    assert hostile.lock_deletion_trial(seed=0) is None


def test_the_lock_planted_as_a_symlink():
    assert hostile.lock_symlink_trial() is None


def test_a_save_committed_under_its_removal_is_whole_or_absent(ckpt):
    """A writer whose lock file was deleted may still commit the save a new writer is
    removing as unfinished (CI: `lock_deletion_trial` found step 11 an empty folder, its
    files deleted after the rename). The removal sets the folder aside first: the late
    commit then either wins, whole, or fails."""
    tmp = ckpt / "3.orbax-checkpoint-tmp"
    shutil.copytree(ckpt / "2", tmp)
    (tmp / "pad").mkdir()
    for i in range(10):
        (tmp / "pad" / str(i)).write_bytes(b"")
    held = sorted(p.relative_to(tmp) for p in tmp.rglob("*"))
    met = []

    def commit_midway(remove, path, *args):
        if path.name.startswith(tmp.name):  # the removal of the leftover has begun ...
            met.append(path.name)
            for i in range(5):
                (path / "pad" / str(i)).unlink()
            with contextlib.suppress(FileNotFoundError):
                tmp.rename(ckpt / "3")  # ... when the lock-less writer commits it
        return remove(path, *args)

    faults.manager(ckpt, store=faults.store(remove=commit_midway)).close()
    assert len(met) == 1, met  # the leftover's removal, met once
    if (ckpt / "3").exists():
        assert sorted(p.relative_to(ckpt / "3") for p in (ckpt / "3").rglob("*")) == held
    assert not list(ckpt.glob("3.*")), "the set-aside leftovers were removed"


# -------------------------------------------------------------- the lease (object storage)


def test_a_second_writer_on_object_storage_is_refused_while_the_first_renews_its_lease(bucket_dir):
    state = {"x": np.arange(100, dtype=np.float32)}
    # A term long enough that no renewal is missed on a loaded machine: nothing here waits
    # for one to pass (a 2 s term lapsed there, and the second writer took over).
    first = jaxckpt.CheckpointManager(bucket_dir, writer_lease_s=60)
    try:
        first.save(1, state=state)
        with pytest.raises(jaxckpt.errors.LockedError, match=f"pid {os.getpid()}"):
            jaxckpt.CheckpointManager(bucket_dir)
        with jaxckpt.CheckpointManager(bucket_dir, read_only=True) as reader:
            assert reader.all_steps() == [1]  # readers take no lease
        first.save(2, state=state)  # the refused writer changed nothing
        first.wait()
    finally:
        first.close()
    assert not (epath.Path(bucket_dir) / ".jaxckpt-writer.lock").exists()  # released on close
    with jaxckpt.CheckpointManager(bucket_dir) as m:  # at once: no waiting for a term
        m.save(3, state=state)
        m.wait()
        assert m.all_steps() == [1, 2, 3]


def test_writers_racing_for_an_object_storage_lease_get_exactly_one(bucket_dir):
    """The server's precondition (create only if absent) decides: one of 8 simultaneous
    writers wins; the others see it renew and are refused."""
    start = threading.Barrier(8)
    outcomes = [None] * 8
    leases = [ObjectLease(bucket_dir, 1.0) for _ in range(8)]

    def contend(i):
        start.wait(timeout=30)
        try:
            leases[i].acquire()
            outcomes[i] = "won"
        except jaxckpt.errors.LockedError:
            outcomes[i] = "refused"

    threads = [threading.Thread(target=contend, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    try:
        assert sorted(outcomes) == ["refused"] * 7 + ["won"], outcomes
    finally:
        for lease in leases:
            lease.release()


def _lease_holder(directory):
    """children.lease_holder on `directory`: it says "holding", then saves on a line."""
    return launch.start(
        "-m",
        "children.lease_holder",
        directory,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )


def test_a_frozen_writer_that_lost_its_object_storage_lease_never_writes_again(bucket_dir):
    holder = _lease_holder(bucket_dir)
    try:
        assert launch.readline(holder, timeout=180) == "holding\n"
        holder.send_signal(signal.SIGSTOP)  # frozen past its 2 s term
        with jaxckpt.CheckpointManager(bucket_dir) as m:  # waits for the term, then takes over
            m.save(3, state={"x": np.zeros(100, np.float32)})
            m.wait()
            holder.send_signal(signal.SIGCONT)
            out, _ = holder.communicate("go\n", timeout=120)
            assert out.startswith("refused: this job lost the writer lease"), out
            assert f"pid {os.getpid()}" in out  # names the writer that has it now
            assert m.all_steps() == [1, 3]  # the frozen writer's step 2 never appeared
            # Its close left the new holder's lease alone.
            assert (epath.Path(bucket_dir) / ".jaxckpt-writer.lock").exists()
            m.save(4, state={"x": np.zeros(100, np.float32)})
    finally:
        holder.kill()
        holder.wait(timeout=30)


def test_a_writer_whose_lease_another_job_overwrote_stops_and_the_directory_recovers(bucket):
    # The stress script's stolen-lease trial (python -m reliability.stress runs 4 a store): a
    # lease overwritten with no condition mid-loop; the writer stops naming the thief, every
    # visible step restores exactly, and the next writer takes over after the thief's term.
    tally = Tally()
    stolen_lease_trial(2500, tally, bucket.url)
    assert tally.trials == 1 and tally.failures == [], tally.failures


def test_a_lease_deleted_under_its_writer_is_lost_at_the_next_renewal(bucket_dir):
    # On S3 a conditional rewrite of a deleted object is refused with 404, not 412: still a
    # lost lease, never a transient error to retry at every renewal.
    lease = ObjectLease(bucket_dir, 0.4)
    lease.acquire()
    renewer = lease._renewer
    try:
        (epath.Path(bucket_dir) / ".jaxckpt-writer.lock").unlink()
        renewer.join(timeout=60)  # the renewal thread ends once it finds the lease gone
        assert not renewer.is_alive()
        with pytest.raises(jaxckpt.errors.LockedError, match=r"lost the writer lease .* to nobody"):
            lease.check()
    finally:
        lease.release()


def test_a_writer_that_lost_its_lease_names_its_holder_however_often_it_renews(bucket_dir):
    # The frozen writer is refused before its next save, naming the lease's holder:
    # - whoever it is now, never read on the condition that it has not changed since it
    #   was looked at (a renewal in between made that "nobody");
    # - only once the whole term passed unrenewed: S3's times are whole seconds, and read
    #   as exact a lease renewed 1.x s ago was taken over, its holder still counting it
    #   fresh (refused only at its commit).
    holder = _lease_holder(bucket_dir)
    thief = ObjectLease(bucket_dir, 0.08)  # renewed every 20 ms
    try:
        assert launch.readline(holder, timeout=180) == "holding\n"
        holder.send_signal(signal.SIGSTOP)  # frozen past its 2 s term
        launch.wait_stopped(holder, timeout=60)
        thief.acquire()  # waits out the term, then takes over
        holder.send_signal(signal.SIGCONT)
        out, _ = holder.communicate("go\n", timeout=120)
        assert out.startswith("refused: this job lost the writer lease"), (out, holder.returncode)
        assert f"pid {os.getpid()}" in out, out
    finally:
        thief.release()
        holder.kill()
        holder.wait(timeout=30)


# A lease's fields as another writer, a damaged object or an old version may have left them:
# none may fail a writer's start (a raw TypeError from `float(None)`), take a renewed lease
# over at once (NaN, a term below zero) or wait for ever (Infinity).
MALFORMED_LEASES = {
    "term-null": {"lease_s": None},
    "term-text": {"lease_s": "abc"},
    "term-list": {"lease_s": [1]},
    "term-true": {"lease_s": True},
    "term-nan": {"lease_s": float("nan")},
    "term-negative": {"lease_s": -1},
    "term-infinite": {"lease_s": float("inf")},
    "term-huge-int": {"lease_s": 10**400},  # (math.isfinite of it raised OverflowError)
    "term-over-a-week": {"lease_s": 1e300},  # (a lease never renewed, waited on for ever)
    "names-not-text": {"host": ["h"], "pid": "12", "since": {"t": 0}, "id": 7, "lease_s": 0},
}


def _malformed_lease(fields, n=0):
    """A lease object's bytes: a holder's fields, `fields` over them (`n` makes each write's
    bytes, so its version, differ)."""
    holder = {"host": "elsewhere", "pid": 4242, "since": "2020-01-01T00:00:00+00:00"}
    return json.dumps({**holder, "lease_s": 2.0, "id": "f" * 32, **fields, "writes": n}).encode()


def _taken_over_after_the_writers_term(bucket_dir, lease, caplog):
    """A writer with a 0.5 s term starts on `lease` left alone: it takes it over (its own
    pid in the lease, the takeover logged) and saves."""
    with (
        caplog.at_level(logging.WARNING, logger="jaxckpt"),
        jaxckpt.CheckpointManager(bucket_dir, writer_lease_s=0.5) as m,
    ):
        # read as the lease's own code reads it, in one GET: the writer renews its lease
        # (a 0.5 s term) while the test reads, and s3fs's read (a HEAD, then a GET of that
        # version) failed with PreconditionFailed when a renewal came between the two
        held = _leases.lease_object(str(lease)).fetch()
        assert json.loads(held)["pid"] == os.getpid()
        m.save(1, state={"x": np.zeros(4, np.float32)})
    assert "took over the writer lease of" in caplog.text


@pytest.mark.timeout(120)  # (Infinity waited for ever)
@pytest.mark.parametrize("fields", MALFORMED_LEASES.values(), ids=MALFORMED_LEASES.keys())
def test_an_unrenewed_lease_with_a_malformed_field_is_taken_over_after_the_writers_term(
    bucket_dir, fields, caplog
):
    lease = epath.Path(bucket_dir) / ".jaxckpt-writer.lock"
    lease.write_bytes(_malformed_lease(fields))
    _taken_over_after_the_writers_term(bucket_dir, lease, caplog)
    assert jaxckpt.CheckpointManager(bucket_dir, read_only=True).all_steps() == [1]


@pytest.mark.parametrize("fields", MALFORMED_LEASES.values(), ids=MALFORMED_LEASES.keys())
def test_a_renewed_lease_with_a_malformed_field_is_refused(bucket_dir, fields):
    lease = epath.Path(bucket_dir) / ".jaxckpt-writer.lock"
    lease.write_bytes(_malformed_lease(fields))
    stop = threading.Event()

    def renew():  # a live holder, however it writes its lease: renewed every 50 ms
        n = 0
        while not stop.wait(0.05):
            n += 1
            lease.write_bytes(_malformed_lease(fields, n))

    renewer = threading.Thread(target=renew, daemon=True)
    renewer.start()
    try:
        with pytest.raises(errors.LockedError, match=r"is being written by .*, which holds its"):
            jaxckpt.CheckpointManager(bucket_dir, writer_lease_s=60)
    finally:
        stop.set()
        renewer.join(timeout=60)
    assert lease.exists()  # the holder's lease, left alone


def test_a_swollen_lease_is_read_no_further_than_a_lease_can_be(bucket_dir, caplog):
    """A lease object of 8 MiB (no lease jaxckpt writes is over a few hundred bytes) is
    fetched as its first 64 KiB only, which is garbage: taken over after the writer's term,
    as a lease that is not JSON is. An empty one reads as empty, not as a refused range."""
    from jaxckpt import _leases

    lease = epath.Path(bucket_dir) / ".jaxckpt-writer.lock"
    lease.write_bytes(b"[" * (8 * 2**20))
    got = _leases.lease_object(str(lease)).fetch()
    assert got is not None and len(got) == _leases.MAX_LEASE_BYTES + 1
    _taken_over_after_the_writers_term(bucket_dir, lease, caplog)
    lease.write_bytes(b"")
    assert _leases.lease_object(str(lease)).fetch() == b""

"""CheckpointManager: when to save, what to keep, and errors that surface.

>>> import jax, jax.numpy as jnp, tempfile
>>> with CheckpointManager(tempfile.mkdtemp(), policy=SavePolicy(every_steps=10)) as mngr:
...     for step in range(1, 21):
...         if mngr.should_save(step):
...             mngr.save(step, state={"w": jnp.ones(3)}, rng=jax.random.key(step))
...     restored = mngr.restore(state={"w": jax.ShapeDtypeStruct((3,), jnp.float32,
...                             sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0]))})
>>> restored.step, restored.state["w"].tolist()
(20, [1.0, 1.0, 1.0])
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import gc
import json
import logging
import operator
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
from etils import epath
from jax.experimental import multihost_utils

from jaxckpt import _integrity, _internals, _iterators, _layout, _local, _orbax, _transfer
from jaxckpt._local import LocalTier
from jaxckpt._lock import writer_lock
from jaxckpt._plan import RestorePlan, auto_inflight_bytes, plan_reads
from jaxckpt._policy import RetentionPolicy, SavePolicy
from jaxckpt._preemption import PreemptionPolicy, PreemptionWatcher
from jaxckpt._storage import absolute
from jaxckpt._tree import (
    check_json,
    flatten,
    nest,
    node_types,
    plan_restore,
    replicated_sharding,
    uniform_requests,
)
from jaxckpt.errors import (
    ConfigError,
    CorruptCheckpointError,
    DataStateError,
    JaxckptError,
    LockedError,
    NoCheckpointError,
    SaveError,
    StepExistsError,
    StepNotFoundError,
    TreeMismatchError,
)

log = logging.getLogger("jaxckpt")


@dataclasses.dataclass(frozen=True)
class Restored:
    """What `CheckpointManager.restore` returns.

    Attributes:
      step: the step restored.
      state: the state tree: the target's structure and shardings, or nested dicts/lists of
        host NumPy arrays when restored without a target.
      rng: the PRNG keys saved with `rng=` (same dtype and impl), or None.
      meta: the JSON `meta=` saved with the step, or None.
      data: the data iterator passed to `restore`, now at the saved position, or None.
      tier: where it came from: "local" (the local tier, `LocalTier`) or "persistent".
    """

    step: int
    state: Any
    rng: Any
    meta: Any
    data: Any
    tier: str = "persistent"


class CheckpointManager:
    """Saves and restores a whole training state asynchronously, one folder per step.

    Args:
      directory: where the steps live; created if missing. A relative path is resolved
        against the working directory here, once.
      policy: when `should_save(step)` is true.
      retention: which committed steps to keep; the others are deleted after each commit.
      preemption: how a preemption notice (SIGTERM by default) makes `should_save` true.
      clock: seconds as a float, for the time-based policy (injected in tests).
      timeout_s: how long a background save may take, barriers between processes included.
      restore_inflight_bytes: a restore reads its leaves in batches of at most this many
        bytes per process (or one larger leaf), which bounds its host staging memory (see
        `plan`). None: a quarter of the host's memory (of the smallest host's, in a
        multi-process job), so that a state which fits is read at once.
      compression: None (the default: raw bytes) or "zstd". zstd stores float weights ~7%
        smaller and writes them at about half the rate (BENCHMARKS.md). Steps saved either
        way restore the same. zstd is tensorstore's, on Orbax arrays: with it every leaf is
        written as one (packed leaves are raw bytes), so pack_small_leaves is ignored.
      pack_small_leaves: write every leaf of at most 1 MiB into one file per process
        (with an index to reshard from) rather than as an Orbax array of its own: thousands
        of small leaves save and restore at the speed of a few big ones (BENCHMARKS.md,
        leaf-count sweep). False writes each leaf as plain Orbax reads it (README, "Coming
        from Orbax"). Steps saved either way restore the same.
      verify_on_restore: check a step's files against its manifest before restoring it.
      read_only: a reader: takes no writer lock, installs no signal handler, deletes
        nothing, and refuses `save`.
      local: a host-local tier (`LocalTier`: each process's own RAM disk or local SSD),
        saved to far more often than `directory` and restored from first when it holds the
        newest step (README, "Local tier").
      writer_lease_s: on object storage (gs://), the term of the writer's lease, which
        stands in for a lock (see README, "Object storage"): a writer that stops renewing
        it for this long (dead or frozen) loses the directory to the next writer.

    Every process of a multi-process job creates the manager and calls each method with the
    same arguments; each process writes only the shards it holds.
    """

    def __init__(
        self,
        directory: str | epath.PathLike,
        *,
        policy: SavePolicy = SavePolicy(),
        retention: RetentionPolicy = RetentionPolicy(),
        preemption: PreemptionPolicy = PreemptionPolicy(),
        clock: Callable[[], float] = time.monotonic,
        timeout_s: int = 1200,
        restore_inflight_bytes: int | None = None,
        compression: str | None = None,
        pack_small_leaves: bool = True,
        verify_on_restore: bool = True,
        read_only: bool = False,
        local: LocalTier | None = None,
        writer_lease_s: float = 60.0,
    ):
        if not isinstance(policy, SavePolicy):
            raise ConfigError(f"policy must be a jaxckpt.SavePolicy, got {policy!r}")
        if not isinstance(retention, RetentionPolicy):
            raise ConfigError(f"retention must be a jaxckpt.RetentionPolicy, got {retention!r}")
        if not isinstance(preemption, PreemptionPolicy):
            raise ConfigError(f"preemption must be a jaxckpt.PreemptionPolicy, got {preemption!r}")
        if restore_inflight_bytes is None:
            restore_inflight_bytes = auto_inflight_bytes()
        elif restore_inflight_bytes <= 0:
            raise ConfigError(
                f"restore_inflight_bytes must be positive, got {restore_inflight_bytes}"
            )
        if not (isinstance(writer_lease_s, int | float) and writer_lease_s > 0):
            raise ConfigError(f"writer_lease_s must be a positive number, got {writer_lease_s!r}")
        if compression not in (None, "zstd"):
            raise ConfigError(f'compression must be None or "zstd", got {compression!r}')
        if local is not None and not isinstance(local, LocalTier):
            raise ConfigError(f"local must be a jaxckpt.LocalTier, got {local!r}")
        directory = absolute(directory)  # a relative path failed only at the next save
        self._read_only = read_only
        self._verify = verify_on_restore
        self._lock = None
        if not read_only and _layout.is_bare(epath.Path(directory)):  # before any lock file
            raise ConfigError(
                f"{directory} is itself one plain Orbax checkpoint, not a directory of steps: "
                "open it with read_only=True, and save into another directory"
            )
        if not read_only and jax.process_index() == 0:
            # Before Orbax starts, since it deletes unfinished saves' leftovers at start-up.
            self._lock = writer_lock(directory, writer_lease_s)
            if self._lock is not None:
                self._lock.acquire()
        try:
            self._store = _orbax.OrbaxStore(
                directory,
                timeout_s=timeout_s,
                restore_inflight_bytes=restore_inflight_bytes,
                compression=compression,
                read_only=read_only,
                lock=self._lock,
                pack=bool(pack_small_leaves) and compression is None,
            )
            try:  # its listener for copies, made by every process at once (a collective)
                self._local = _local.LocalStore(local, read_only=read_only) if local else None
            except BaseException:
                self._store.close()
                raise
        except BaseException:
            if self._lock is not None:
                self._lock.release()
            raise
        self._restore_inflight_bytes = restore_inflight_bytes
        if read_only:
            preemption = PreemptionPolicy(enabled=False)
        self._preemption = PreemptionWatcher(preemption)
        self._policy = policy
        self._retention = retention
        self._clock = clock
        self._last_save_time = clock()
        self._last_saved_step: int | None = None
        self._in_flight: int | None = None
        self._due: tuple[int, bool, bool] | None = None  # should_save's (step, local, persistent)
        self._warned: set[str] = set()  # the unreadable step folders logged
        self._closed = False

    @property
    def directory(self) -> epath.Path:
        return self._store.directory

    # ---------------------------------------------------------------------------- queries

    def all_steps(self) -> list[int]:
        """The committed steps, oldest first. A step still being written is not listed."""
        return self._store.committed_steps()

    def latest_step(self) -> int | None:
        """The newest committed step, or None when there is none; with a local tier, the
        newest of either tier (a local step counts once every process's part of it exists:
        all processes agree on it, so every process calls this).

        It looks only at the step folders from the newest one down to the newest committed
        step: a stat or two whatever the number of steps. Step-like folders it meets that
        no one can read (a foreign or damaged folder) are logged as warnings, each once;
        where there is nothing else, the warning says that a resume from here starts over.
        """
        listing = self._store.latest()
        newest = listing.latest
        self._warn_unreadable(listing)
        if self._local is not None:
            local = _local.complete_steps(_local.holdings(self._local))
            if local and (newest is None or local[-1] > newest):
                return local[-1]
        return newest

    def _warn_unreadable(self, listing: _layout.Listing) -> None:
        """Logs each step-like folder no one can read (damaged or foreign) that `listing`
        met, once a manager: a resume would otherwise pass over it without a word."""
        found = {repr(name): why for name, why in listing.unreadable.items()}
        found.update((str(s), f"damaged: {why}") for s, why in listing.damaged.items())
        new = {name: why for name, why in sorted(found.items()) if name not in self._warned}
        self._warned.update(new)
        for name, why in new.items():  # an untrusted name, escaped by repr
            log.warning("%s: step folder %s cannot be read: %s", self.directory, name, why)
        if new and listing.latest is None:
            log.warning(
                "%s holds no step jaxckpt can read, only the %d step-like folder(s) above: "
                "latest_step() is None, and a run that resumes from it starts over beside "
                "them. Check the directory, or see the docs' 'Coming from Orbax' for what "
                "jaxckpt reads.",
                self.directory,
                len(found),
            )

    @property
    def preempted(self) -> bool:
        """True once a preemption notice made `should_save` true: save, close, and exit."""
        return self._preemption.preempted

    def should_save(self, step: int) -> bool:
        """True when `step` should be saved: per the save policy, or for a preemption.

        Call it at every step on every process (the preemption agreement counts on it);
        reads no files.
        """
        step = _check_step(step)
        if self._preemption.reached(step):
            log.warning("preemption: step %d is the step to save before exiting", step)
            self._due = (step, False, True)  # to the persistent tier: the VM's disks go too
            return step != self._last_saved_step
        if step == self._last_saved_step:
            return False
        due = self._policy.due(
            step=step, seconds_since_last_save=self._clock() - self._last_save_time
        )
        if self._policy.every_seconds is not None and jax.process_count() > 1:
            # Clocks differ between hosts: process 0 decides, so all save the same step.
            due = bool(multihost_utils.broadcast_one_to_all(np.bool_(due)))
        local = self._local is not None and self._local.tier.due(step)
        self._due = (step, local, due)
        return due or local

    # ---------------------------------------------------------------------------- save

    def save(self, step: int, *, state: Any, rng: Any = None, data: Any = None, meta: Any = None):
        """Starts saving `step` and returns once the arrays are copied off the devices.

        The write continues in the background; the step becomes visible to `all_steps()` and
        `restore()` only when committed. An error in the background is raised by the next
        `save`, `wait` or `close`. Bad input is rejected here, before anything is written.

        Args:
          step: the training step; must not exist yet.
          state: any pytree of jax.Array / NumPy arrays / scalars (NNX State, TrainState,
            optax states, ...).
          rng: PRNG keys: typed (`jax.random.key`, any impl) or raw uint32, any pytree.
          data: an iterator with `get_state()` / `set_state()` (e.g. grain); each process
            saves its own state.
          meta: JSON-serialisable run metadata (config, metrics, ...).
        """
        self._check_open()
        if self._read_only:
            raise ConfigError("this CheckpointManager was opened with read_only=True")
        step = _check_step(step)
        if meta is not None:
            check_json(meta)
        with _gc_paused():
            state_arrays, state_specs = flatten(state, item="state")
            rng_arrays, rng_specs = flatten(rng, item="rng")
        data_text, data_kind, data_about = _data_state(data)
        local, persistent = self._tiers_due(step)
        if persistent:
            self._finish_pending()  # a local save alone never waits for a persistent one
            self._check_new(step)
        with _gc_paused():
            info = _layout.StepInfo(
                step=step,
                state=tuple(state_specs),
                rng=tuple(rng_specs),
                data=data_kind,
                meta=meta,
                rng_node_types=tuple(node_types(rng)),
                saved_at=datetime.datetime.now(datetime.UTC).isoformat(),
                process_count=jax.process_count(),
                versions={"jax": jax.__version__},
            )
            if local:
                arrays = {_layout.STATE: state_arrays, _layout.RNG: rng_arrays}
                with self._local_errors():
                    self._local.save(info, arrays, data_text, data_about)
            if persistent:
                try:
                    self._store.save(
                        step,
                        state=state_arrays,
                        rng=rng_arrays,
                        data=data_text,
                        info=info,
                        data_about=data_about,
                    )
                except LockedError:  # nothing started
                    raise
                except Exception as e:
                    raise self._save_error(step, e, background=False) from e
        if persistent:
            self._in_flight = step
            self._last_save_time = self._clock()
        self._last_saved_step = step

    def _tiers_due(self, step: int) -> tuple[bool, bool]:
        """Which tiers `save(step)` writes: (local, persistent). As `should_save` decided for
        this step; a save it did not ask for goes to the persistent tier (and to the local
        one too on its steps); a preemption's only to the persistent tier."""
        if self._local is None:
            return False, True
        if self._due is not None and self._due[0] == step:
            _, local, persistent = self._due
        else:
            local = self._local.tier.due(step)
            every = self._policy.every_steps
            persistent = not local or (every is not None and step % every == 0)
        if self._preemption.preempted:
            return False, True
        return local, persistent or not local

    @contextlib.contextmanager
    def _local_errors(self) -> Iterator[None]:
        """A local save's failure (raised by the next save, wait or close) as a SaveError."""
        try:
            yield
        except _local.WriteFailed as e:
            raise SaveError(e.step, e.cause, self._local.steps()) from e.cause

    def _check_new(self, step: int) -> None:
        """StepExistsError unless the persistent tier has nothing at `step`."""
        # One stat on the blocking path; the directory is listed only to word the refusal.
        if self._store.step_folder_exists(step):
            if self._store.is_orbax(step):
                raise StepExistsError(
                    f"step {step} in {self.directory} is a step plain Orbax wrote, which "
                    "jaxckpt reads and never overwrites or deletes. Save under a later step."
                )
            if step in self._store.committed_steps():
                raise StepExistsError(
                    f"step {step} already exists in {self.directory}; jaxckpt never overwrites "
                    "a committed step. Save under a new step number, or delete the old step first "
                    "(`jaxckpt rm DIR STEP`)."
                )
            raise StepExistsError(
                f"the folder for step {step} ({self.directory / str(step)}) exists but was not "
                "written by jaxckpt, which never touches folders it did not write. Move it "
                "away or save under another step."
            )

    def wait(self) -> None:
        """Blocks until the save in flight is committed; raises `SaveError` if it failed."""
        self._check_open()
        self._finish_pending()
        if self._local is not None:
            with self._local_errors():
                self._local.wait()

    def close(self) -> None:
        """Waits for the saves in flight, applies retention and releases resources."""
        if self._closed:
            return
        try:
            self._finish_pending()
        finally:
            self._closed = True
            self._preemption.close()
            try:
                if self._local is not None:
                    with self._local_errors():
                        self._local.close()
            finally:
                self._store.close()
                if self._lock is not None:
                    self._lock.release()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is None:
            self.close()  # a failed save raises SaveError here
            return
        # The body's own error is what the user must see: a save failing meanwhile is
        # logged and noted on it, never raised in its place.
        try:
            self.close()
        except Exception as e:
            log.error("%s (while the with-block raised %s)", e, type(exc).__name__)
            exc.add_note(f"jaxckpt: on leaving the with-block: {type(e).__name__}: {e}")

    # ---------------------------------------------------------------------------- restore

    def restore(
        self,
        step: int | None = None,
        *,
        state: Any = None,
        rng: Any = None,
        data: Any = None,
        partial: bool = False,
        fallback: bool = False,
        data_mismatch_ok: bool = False,
        item: str | None = None,
    ) -> Restored:
        """Restores a committed step (`step=None`: the latest committed one).

        A save of this manager still in flight is waited for first (and its failure raised),
        so a process always sees its own saves. With `verify_on_restore` (the default) the
        step's files are checked against its manifest first; a corrupt step raises
        `CorruptCheckpointError`, or, with `fallback=True` and `step=None`, is skipped (and
        logged) for the newest step that verifies.

        Args:
          step: the step to restore, or None for the latest committed step.
          state: the target: a pytree like the saved state whose leaves are
            `jax.ShapeDtypeStruct` with a sharding, live `jax.Array`s (their sharding is
            used), NumPy arrays (restored on the host) or Python scalars. Its shardings decide
            where the data lands. None restores the saved tree as host NumPy arrays.
          rng: a target for the PRNG keys, like `state`. None puts them replicated on the
            devices of the state target (on the host when there is no state target), as
            nested dicts/lists; keys saved from other node types (`nnx.state(rngs)`) need a
            target of that kind (TreeMismatchError without one).
          data: an iterator with `set_state`; it is moved to the saved position in place,
            after everything else was read successfully. It must be built like the saved
            one (type, state fields, grain pipeline or DataLoader sampler and source, see
            `jaxckpt._iterators`): a mismatch is a DataStateError before any array is read.
          partial: restore only the leaves in the `state` target (e.g. `{"params": ...}`
            of a saved `{"params", "opt_state"}`); the rest is not read.
          fallback: with `step=None`, move to older steps while the newest does not verify.
          data_mismatch_ok: move `data` to the saved position even though it is not built
            like the saved iterator (a deliberate change, e.g. another batch size); what
            changed is logged. The iterator's own `set_state` may still refuse the state.
          item: of a step plain Orbax wrote, the pytree item to restore as the state (e.g.
            MaxText's "items"); None: its only one (ConfigError listing them if it has
            several). `data=` restores from its grain item (MaxText's "iter"). Such a step
            has no manifest: it is read unverified (README, "Coming from Orbax").
        """
        self._check_open()
        wanted = _Wanted(state, rng, data, data_mismatch_ok, partial, item)
        restored = self._restore_local(step, wanted) if self._local and item is None else None
        if restored is None:
            restored = self._restore_persistent(step, wanted, fallback)
        if self._local is not None and not self._read_only:
            # The run goes on from here: newer local steps are of a timeline that does not.
            self._local.prune_after(restored.step)
        return restored

    def _restore_persistent(self, step, wanted: _Wanted, fallback: bool) -> Restored:
        for _ in range(3):  # the step chosen was deleted meanwhile: choose again
            try:
                return self._restore_newest(step, wanted, fallback)
            except _Deleted as e:
                if step is not None:
                    raise self._deleted(e.step) from e.__cause__
                log.warning("restore: step %d was deleted while it was read; again", e.step)
        raise NoCheckpointError(
            f"the latest committed step in {self.directory} was deleted three times while it "
            "was read: another job's retention keeps deleting steps. Restore a step that "
            "job keeps (step=...), or stop it first."
        )

    def _restore_local(self, step: int | None, wanted: _Wanted) -> Restored | None:
        """The step from the local tier when every process can restore it from its own
        part (agreed: a collective), else None, with the reason logged. Without `step`: the
        newest local step every process holds, unless the persistent tier has a newer one."""
        local = self._local
        with self._local_errors():
            local.wait()  # this process's own local save in flight
        held = _local.holdings(local)
        steps = _local.complete_steps(held)
        persistent = self._store.latest().latest
        if step is not None:
            steps = [s for s in steps if s == _check_step(step)]
        elif persistent is not None and steps and steps[-1] < persistent:
            log.info(
                "restore: the persistent step %d is newer than the newest local step %d",
                persistent,
                steps[-1],
            )
        for candidate in reversed(steps):
            if step is None and persistent is not None and candidate < persistent:
                break
            problem = self._fetch_if_lost(candidate, held[candidate])
            problem = problem or self._local_problem(candidate, wanted)
            refused = _local.refusing(problem)
            if not refused:
                with _gc_paused():
                    return self._restore_local_step(candidate, wanted)
            log.warning(
                "restore: local step %d in %s is passed over: %s",
                candidate,
                local.directory,
                problem or f"process(es) {refused} cannot restore it (their logs say why)",
            )
        return None

    def _fetch_if_lost(self, step: int, parts: dict[int, list[int]]) -> str | None:
        """Agreed by all: which processes lack their own part of `step`, whole (checked
        against its manifest); each of those fetches it from the first peer keeping a copy
        (why not, if it could not)."""
        me, local = jax.process_index(), self._local
        own = local.own_problem(step)
        lost = _local.refusing(own)
        if me not in lost:
            return None
        peers = [h for h in parts.get(me, []) if h != me]
        if not peers:
            return f"{own}, and no other process keeps a copy of it"
        return local.fetch(step, peers[0])

    def _local_problem(self, step: int, wanted: _Wanted) -> str | None:
        """Why this process cannot restore `step` from its local part, which is whole and
        its own (`_fetch_if_lost`): None if it can."""
        local = self._local
        try:
            info = local.info(step)
            for item, target, home, partial in self._items(info, wanted):
                requests, _ = self._plan_item(info, item, target, home, partial)
                if problem := local.holds(info, item, requests):
                    return problem
            if wanted.data is not None:
                return self._data_problem(
                    step, info, wanted.data, wanted.mismatch_ok, local.directory
                )
        except Exception as e:  # the same target fails the persistent tier too: raised there
            return f"{type(e).__name__}: {_transfer.first_line(e)}"
        return None

    def _restore_local_step(self, step: int, wanted: _Wanted) -> Restored:
        local = self._local
        info = local.info(step)

        def read(info, item, requests):
            return local.read_arrays(info, item, requests, self._restore_inflight_bytes)

        restored = self._restore_step(info, wanted, read)
        if wanted.data is not None:  # last: after everything else was read
            _restore_data(wanted.data, info, local.directory)
        log.info("restored step %d from the local tier (%s)", step, local.directory)
        return dataclasses.replace(restored, data=wanted.data, tier="local")

    def _restore_newest(self, step, wanted: _Wanted, fallback: bool) -> Restored:
        skipped = []
        for candidate in self._candidates(step, fallback):
            try:
                with _gc_paused():
                    return self._restore_verified(candidate, wanted)
            except Exception as e:
                if candidate not in self._store.committed_steps():
                    raise _Deleted(candidate) from e
                if not isinstance(e, CorruptCheckpointError) or not fallback or step is not None:
                    raise
                log.warning("restore: skipping step %d: %s", candidate, "; ".join(e.problems))
                skipped.append(f"step {candidate}: {'; '.join(e.problems)}")
        raise NoCheckpointError(
            f"no committed step in {self.directory} verifies: {' | '.join(skipped)}"
        )

    def _deleted(self, step: int) -> StepNotFoundError:
        return StepNotFoundError(
            step,
            self._store.committed_steps(),
            str(self.directory),
            why=" (it was deleted while it was read: retention in the job writing there?)",
        )

    def _candidates(self, step: int | None, fallback: bool) -> list[int]:
        """The steps to try, newest first; damaged step folders are reported, not tried."""
        self._finish_pending()
        listing = self._store.scan(newest=step is None and not fallback)
        if step is not None:
            return [listing.resolve(_check_step(step))]
        self._warn_unreadable(listing)
        latest = listing.resolve(None)
        log.info("restoring the latest committed step %d from %s", latest, self.directory)
        return sorted(listing.committed, reverse=True) if fallback else [latest]

    def _restore_verified(self, step: int, wanted: _Wanted) -> Restored:
        """Restores a step; with `verify_on_restore`, only if its files match the manifest.

        One process hashes the files in a worker thread while it reads the arrays, and
        returns nothing (moves no data iterator) unless they match. Several processes first
        agree on the verdict (a collective), then read, so no process reads a corrupt step
        that another refuses. A step plain Orbax wrote has no manifest: it is read as is.
        """
        data = wanted.data
        several = jax.process_count() > 1
        verify = self._verify and not self._store.is_orbax(step)
        if verify and several:
            self._check(step, self._verify_share(step))
        info = None
        if data is not None or not verify:  # before any array is read or file hashed
            info = self._read_info(step, wanted.item)
            self._check_data(step, info, data, wanted.mismatch_ok)
        with _integrity.verified_while_reading(
            self.directory, step, self._store.step_dir(step), verify=verify and not several
        ):
            info = info or self._read_info(step, wanted.item)
            restored = self._restore_step(info, wanted)
        if data is not None:  # last: after everything else was read (and verified)
            _restore_data(data, info, self.directory)
            restored = dataclasses.replace(restored, data=data)
        return restored

    def _check_data(self, step: int, info: _layout.StepInfo, data: Any, mismatch_ok: bool) -> None:
        """Refuses, before any array is read, a data iterator unlike the one saved (or one
        for a step saved without data=). Every process decides on its own iterator, then all
        agree (a collective), so that none reads arrays while another gave up."""
        if data is None:
            return
        try:
            problem = self._data_problem(step, info, data, mismatch_ok)
        except JaxckptError as e:  # a damaged description: raised once all processes know
            problem = e
        if jax.process_count() > 1:
            refused = np.ravel(multihost_utils.process_allgather(np.int32(problem is not None)))
            if problem is None and refused.any():
                found = [i for i, r in enumerate(refused) if r]
                problem = (
                    f"process(es) {found} refused their data iterator for step {step} (their "
                    "errors say why); nothing was read"
                )
        if isinstance(problem, Exception):
            raise problem
        if problem is not None:
            raise DataStateError(problem)

    def _data_problem(
        self,
        step: int,
        info: _layout.StepInfo,
        data: Any,
        mismatch_ok: bool,
        directory: epath.Path | None = None,
    ) -> str | None:
        """Why `data` cannot take the state saved at `step` (None: it can); `directory`:
        where the step is (the persistent one by default)."""
        directory = directory or self.directory
        if not callable(getattr(data, "set_state", None)):
            return f"data= takes an iterator with set_state(); got a {type(data).__name__}"
        if info.data is None:
            return (
                f"step {step} holds no data-iterator state (it was saved without data=); "
                "restore without data= or from a step saved with it"
            )
        here = (jax.process_index(), jax.process_count())
        if info.orbax is not None:  # grain's handler records no description: its state is there?
            try:
                _layout.read_data_state(directory, info, *here)
            except DataStateError as e:
                return str(e)
            return None
        # None: a step saved before jaxckpt recorded it
        saved = _layout.read_data_about(directory, step, *here)
        changed = _iterators.differences(saved, _iterators.describe(data)) if saved else []
        if not changed:
            return None
        if mismatch_ok:
            log.warning(
                "restore: the data iterator differs from the one saved at step %d "
                "(data_mismatch_ok=True): %s",
                step,
                "; ".join(changed),
            )
            return None
        where = f" (process {jax.process_index()})" if jax.process_count() > 1 else ""
        return (
            f"the data iterator is not built like the one saved at step {step}{where}:\n  "
            + "\n  ".join(changed)
            + "\nBuild it like the saved one to resume the same data order; for a deliberate "
            "change, pass data_mismatch_ok=True to move it to the saved position all the "
            "same. Nothing was read."
        )

    def _verify_share(self, step: int) -> tuple[str, ...]:
        """Each process checks a share of the step's files; all agree on the verdict."""
        share = (jax.process_index(), jax.process_count())
        problems = _integrity.verify_step(self._store.step_dir(step), step, share=share).problems
        counts = multihost_utils.process_allgather(np.int32(len(problems)))
        if not problems and np.any(counts):
            found = [i for i, c in enumerate(np.ravel(counts)) if c]
            problems = (f"process(es) {found} found files that do not match the manifest",)
        return problems

    def _check(self, step: int, problems: tuple[str, ...]) -> None:
        if problems:
            raise CorruptCheckpointError(step, problems, str(self.directory))

    def _read_info(self, step: int, item: str | None = None) -> _layout.StepInfo:
        """The step's metadata, checked (CorruptCheckpointError if damaged); of a plain
        Orbax step, of its pytree item `item`."""
        try:
            return self._store.info(step, item)
        except FileNotFoundError:
            if step not in self._store.committed_steps():
                raise self._deleted(step) from None
            raise CorruptCheckpointError(
                step, [f"{_layout.INFO_PATH} is missing"], str(self.directory)
            ) from None

    @staticmethod
    def _items(info: _layout.StepInfo, wanted: _Wanted) -> list[tuple]:
        """The items a restore reads: (item, target, home sharding, partial) each."""
        items = [(_layout.STATE, wanted.state, None, wanted.partial)]
        if info.rng:
            items.append((_layout.RNG, wanted.rng, replicated_sharding(wanted.state), False))
        return items

    def _restore_step(
        self, info: _layout.StepInfo, wanted: _Wanted, read: Callable | None = None
    ) -> Restored:
        """`read(info, item, requests)` reads the arrays (the persistent tier's, by default)."""
        read = read or self._store.read_arrays
        step, rng = info.step, wanted.rng
        kinds = info.rng_node_types
        if rng is None and info.rng and kinds:  # before any array is read
            raise TreeMismatchError(
                f"the PRNG keys of step {step} were saved from a tree of {', '.join(kinds)}, "
                "which a restore without an rng= target cannot rebuild: it would return "
                "nested dicts that e.g. nnx.update takes silently and dropout later fails on. "
                "Pass rng= an object of the same kind, built like the saved one (for "
                "nnx.Rngs: rng=nnx.state(rngs) of a fresh nnx.Rngs(...) with the same "
                "streams, then nnx.update(rngs, restored.rng))."
            )
        if not info.rng and rng is not None:
            raise TreeMismatchError(f"step {step} holds no PRNG keys (it was saved without rng=)")
        if info.data is not None and wanted.data is None:
            log.warning(
                "restore: step %d holds each process's data-iterator state, which is not "
                "restored without data=: pass data= an iterator built like the saved one to "
                "go on with the data where the run stopped",
                step,
            )
        trees = {}
        for item, target, home, partial in self._items(info, wanted):
            requests, rebuild = self._plan_item(info, item, target, home, partial)
            trees[item] = rebuild(read(info, item, requests))
        restored_state, restored_rng = trees[_layout.STATE], trees.get(_layout.RNG)
        return Restored(
            step=step, state=restored_state, rng=restored_rng, meta=info.meta, data=None
        )

    def meta(self, step: int | None = None) -> Any:
        """The `meta=` saved with a step (None: the latest committed), reading no array:
        e.g. the run's config, to build the model before restoring into it."""
        self._check_open()
        (step,) = self._candidates(step, fallback=False)
        return None if self._store.is_orbax(step) else self._read_info(step).meta

    def plan(
        self, step: int | None = None, *, state: Any, partial: bool = False, item: str | None = None
    ) -> RestorePlan:
        """A restore dry-run: per process, the bytes it will read and its peak host memory
        estimate. Checks `state` like `restore` does, and reads only the step's metadata.

        `print(mngr.plan(state=target))` shows, e.g.::

            restore plan for step 20: 121 leaves, 1.00 GiB
              process       reads  on devices  peak host (est.)
                    0    1.00 GiB    1.00 GiB          1.78 GiB
        """
        self._check_open()
        (step,) = self._candidates(step, fallback=False)
        specs = self._read_info(step, item).state
        requests, _ = plan_restore(state, specs, item=_layout.STATE, step=step, partial=partial)
        return plan_reads(step, requests, inflight_bytes=self._restore_inflight_bytes)

    @staticmethod
    def _plan_item(info, item, target, default_sharding, partial) -> tuple[dict, Callable]:
        """What to read of an item, and how to rebuild its tree from what was read."""
        specs = info.leaves(item)
        if target is None:
            return uniform_requests(specs, default_sharding), lambda arrays: nest(specs, arrays)
        return plan_restore(
            target, specs, item=item, step=info.step, partial=partial, home=default_sharding
        )

    # ---------------------------------------------------------------------------- internals

    def _finish_pending(self) -> None:
        """Waits for the save in flight, turns its failure into SaveError, applies retention."""
        if self._in_flight is None:
            return
        step = self._in_flight
        try:
            self._store.wait()
        except Exception as e:
            self._in_flight = None
            raise self._save_error(step, e, background=True) from e
        # (an interrupt in the wait keeps the save in flight: close() still waits for it)
        self._in_flight = None
        if self._retention.keep_last is None:
            return  # keeps everything: no need to list the directory
        for old in self._retention.steps_to_delete(self._store.own_steps()):
            log.info("retention: deleting step %d from %s", old, self.directory)
            self._store.delete(old)

    def _save_error(self, step: int, error: Exception, *, background: bool) -> SaveError:
        """The SaveError for `step`, worded from the directory once nothing of the step is
        still running: Orbax may fail in the foreground after it started the step's commit
        in the background (a barrier with a dead process), and that commit can still land."""
        missing = _internals.missing_processes(error)
        if not background:
            try:
                self._store.wait()  # bounded: each barrier in it times out after timeout_s
            except Exception as late:
                missing = sorted({*missing, *_internals.missing_processes(late)})
        committed = self._store.committed_steps()
        if self._lock is not None:
            try:  # a writer that took over may have removed the step's files: the real cause
                self._lock.check()
            except LockedError as lost:
                error = lost
        return SaveError(step, error, committed, background=background, missing=missing)

    def _check_open(self) -> None:
        if self._closed:
            raise ConfigError("this CheckpointManager is closed; create a new one")


@dataclasses.dataclass(frozen=True)
class _Wanted:
    """What a `restore` call asks for."""

    state: Any
    rng: Any
    data: Any
    mismatch_ok: bool
    partial: bool
    item: str | None


class _Deleted(Exception):
    """The step being restored was deleted meanwhile (by the writer's retention)."""

    def __init__(self, step: int):
        self.step = step


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Pauses Python's cyclic garbage collector while `save` blocks the training step, and
    during a restore.

    Orbax creates a few objects per shard; at thousands of leaves those allocations set off
    collections that walk every live object of the process: ~45% of a 4,000-leaf save's
    blocking time and ~30% of its restore (BENCHMARKS.md). Reference counting still frees
    all else meanwhile (a restore's peak memory is unchanged).
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _check_step(step: Any) -> int:
    try:
        value = operator.index(step)
    except TypeError:
        raise ConfigError(f"step must be an int, got {type(step).__name__} {step!r}") from None
    if isinstance(step, bool) or value < 0:
        raise ConfigError(f"step must be a non-negative int, got {step!r}")
    return value


def _data_state(data: Any) -> tuple[str | None, str | None, str | None]:
    """Snapshots the iterator's state now: as text to store, its kind, and what the
    iterator is (`_iterators.describe`, as JSON text)."""
    if data is None:
        return None, None, None
    if not callable(getattr(data, "get_state", None)):
        raise DataStateError(
            f"data= takes an iterator with get_state() and set_state() (e.g. a grain "
            f"DatasetIterator); got a {type(data).__name__}"
        )
    state = data.get_state()
    about = json.dumps(_iterators.describe(data, state))
    if isinstance(state, bytes):  # grain's DataLoaderIterator: JSON text as bytes
        try:
            return state.decode("utf-8"), "bytes", about
        except UnicodeDecodeError:
            raise DataStateError(
                "data.get_state() returned bytes that are not UTF-8 text; jaxckpt stores "
                "iterator states as text (JSON or UTF-8 bytes)"
            ) from None
    check_json(state, "data.get_state()")
    return json.dumps(state), "json", about


def _restore_data(data: Any, info: _layout.StepInfo, directory: epath.Path) -> None:
    """Moves `data` to the saved position (checked beforehand by `_check_data`)."""
    step = info.step
    text = _layout.read_data_state(directory, info, jax.process_index(), jax.process_count())
    as_json = info.data == "json"
    if info.data == "grain":  # grain's Orbax handler: a DatasetIterator's as JSON, else text
        import grain

        as_json = isinstance(data, grain.DatasetIterator)
    try:
        saved = json.loads(text) if as_json else _iterators.with_own_addresses(text.encode(), data)
    except (ValueError, RecursionError):
        raise CorruptCheckpointError(
            step,
            [f"{info.data_item}/: this process's data-iterator state is not JSON"],
            str(directory),
        ) from None
    try:
        data.set_state(saved)
    except Exception as e:
        raise DataStateError(
            f"the data iterator refused the state saved at step {step}: {type(e).__name__}: "
            f"{e}. Restore into an iterator built like the one that was saved (same type, "
            "dataset and options)."
        ) from e

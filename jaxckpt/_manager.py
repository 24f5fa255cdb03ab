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
import datetime
import logging
import time
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Any, ClassVar

import jax
from etils import epath

from jaxckpt import (
    _agree,
    _incremental,
    _iterators,
    _layout,
    _listing,
    _local,
    _orbax,
    _save_errors,
)
from jaxckpt._checks import check_json, check_step, gc_paused
from jaxckpt._local import LocalTier
from jaxckpt._lock import MAX_LEASE_S, ObjectLease, WriterLock, writer_lock
from jaxckpt._memory import auto_inflight_bytes
from jaxckpt._plan import RestorePlan
from jaxckpt._policy import RetentionPolicy, SavePolicy
from jaxckpt._preemption import Notices, PreemptionPolicy
from jaxckpt._read_step import Restored, Wanted
from jaxckpt._reader import Reader
from jaxckpt._storage import absolute
from jaxckpt._store_errors import naming_its_store, naming_the_store, reaching
from jaxckpt._tiers import Tiers
from jaxckpt._tree import flatten, node_types
from jaxckpt.errors import (
    ConfigError,
    LockedError,
    SaveError,
    StepExistsError,
)

log = logging.getLogger("jaxckpt")


class CheckpointManager:
    """Saves and restores a whole training state asynchronously, one folder per step.

    >>> import jax.numpy as jnp, tempfile, jaxckpt
    >>> policy = jaxckpt.SavePolicy(every_steps=10)
    >>> with jaxckpt.CheckpointManager(tempfile.mkdtemp(), policy=policy) as mngr:
    ...     for step in range(1, 31):
    ...         state = {"w": jnp.full(4, float(step))}  # a training step
    ...         if mngr.should_save(step):
    ...             mngr.save(step, state=state)
    ...     mngr.wait()
    ...     mngr.all_steps(), mngr.restore(state=state).state["w"].tolist()
    ([10, 20, 30], [30.0, 30.0, 30.0, 30.0])

    Args:
      directory: where the steps live; created if missing. A relative path is resolved
        against the working directory here, once.
      policy: when `should_save(step)` is true.
      retention: which committed steps to keep; the others are deleted after each commit.
      preemption: how a preemption notice (SIGTERM by default) makes `should_save` true.
      clock: seconds as a float, for the time-based policy (injected in tests).
      timeout_s: in a job of several processes, how long any call waits for the others, in
        all: a save from its start to its commit, a restore, opening the manager. When it
        passes, every process still waiting raises a named error: `SaveError` (for a
        save), `ProcessesMissingError`, naming those that did not come ([Deadlines](deadlines.md)).
      restore_inflight_bytes: a restore reads its leaves in batches of at most this many
        bytes per process (or one larger leaf), which bounds its host staging memory (see
        `plan`); each slice's staging goes back to the system once it is on its device.
        None: 128 MiB, or a quarter of the host's memory where that is less (of the
        smallest host's, in a multi-process job).
      compression: None (the default: raw bytes) or "zstd": float weights ~7% smaller
        (bfloat16 ~20%), each piece compressed as it is written (BENCHMARKS.md); with
        incremental=False, tensorstore's on Orbax arrays (every leaf one), which holds
        the encoded state until the commit. Steps restore the same either way.
      pack_small_leaves: with incremental=False, every leaf of at most 1 MiB goes into one
        file per process (with an index to reshard from), not an Orbax array of its own.
        False: each leaf as plain Orbax reads it ([Coming from Orbax](from-orbax.md)), and
        saves are not incremental. Steps restore the same either way.
      incremental: None (the default: True unless pack_small_leaves=False) or True: every
        leaf packed, a save writes only the pieces whose bytes changed since the newest
        committed step and refers to it for the others ([Incremental steps](incremental.md)).
        False: each step stands alone (leaves above 1 MiB: Orbax's).
      full_save_every: with incremental saves, every this many saves one writes every
        piece and refers to no earlier step (10 by default; None: only with nothing to
        refer to), so that one damaged file reaches at most this many steps: below
        keep_last, one kept step always restores ([Incremental steps](incremental.md)).
      verify_on_restore: check a step's files against its manifest before restoring it.
      read_only: a reader: takes no writer lock, installs no signal handler, deletes
        nothing, and refuses `save`.
      local: a host-local tier (`LocalTier`: each process's own RAM disk or local SSD),
        saved to far more often than `directory` and restored from first when it holds the
        newest step ([Local tier](local-tier.md)).
      writer_lease_s: on object storage (gs://), the term of the writer's lease, which
        stands in for a lock ([Object storage](object-storage.md)): a writer that stops renewing
        it for this long (dead or frozen) loses the directory to the next writer. At most a
        week: a longer term read from a lease is taken for garbage.

    Every process of a multi-process job creates the manager and calls each method with the
    same arguments; each process writes only the shards it holds.
    """

    # The classes that do each tier's storage work. A subclass of the manager that names
    # its own is the seam faults are injected through (a failing save, a frozen deletion)
    # and what is read and written counted: `reliability.faults.manager`.
    _store_class: ClassVar[type[_orbax.OrbaxStore]] = _orbax.OrbaxStore
    _local_store_class: ClassVar[type[_local.LocalStore]] = _local.LocalStore

    @naming_the_store  # its failures as StorageError: down, refusing us, no such bucket
    def __init__(
        self,
        directory: str | epath.PathLike,
        *,
        policy: SavePolicy = SavePolicy(),
        retention: RetentionPolicy = RetentionPolicy(),
        preemption: PreemptionPolicy = PreemptionPolicy(),
        clock: Callable[[], float] = time.monotonic,
        timeout_s: float = 1200,
        restore_inflight_bytes: int | None = None,
        compression: str | None = None,
        pack_small_leaves: bool = True,
        incremental: bool | None = None,
        full_save_every: int | None = _incremental.FULL_EVERY,
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
        timeout_s = _agree.check_timeout(timeout_s)
        if restore_inflight_bytes is None:
            with _agree.deadline("the opening of the manager", timeout_s):
                restore_inflight_bytes = auto_inflight_bytes()
        elif restore_inflight_bytes <= 0:
            raise ConfigError(
                f"restore_inflight_bytes must be positive, got {restore_inflight_bytes}"
            )
        if not (isinstance(writer_lease_s, int | float) and 0 < writer_lease_s <= MAX_LEASE_S):
            raise ConfigError(
                f"writer_lease_s must be a number of seconds above 0 and at most a week "
                f"({MAX_LEASE_S:g}), got {writer_lease_s!r}"
            )
        if compression not in (None, "zstd"):
            raise ConfigError(f'compression must be None or "zstd", got {compression!r}')
        if incremental is None:  # on, unless Orbax's own arrays are asked for
            incremental = bool(pack_small_leaves)
        elif incremental and not pack_small_leaves:
            raise ConfigError(
                "incremental=True packs every leaf: it does not take pack_small_leaves=False"
            )
        if full_save_every is not None and not (
            type(full_save_every) is int and full_save_every >= 1
        ):
            raise ConfigError(
                f"full_save_every must be a number of saves (1 or more) or None, got "
                f"{full_save_every!r}"
            )
        if local is not None and not isinstance(local, LocalTier):
            raise ConfigError(f"local must be a jaxckpt.LocalTier, got {local!r}")
        directory = absolute(directory)  # a relative path failed only at the next save
        self._read_only = read_only
        self._verify = verify_on_restore
        self._lock: WriterLock | ObjectLease | None = None
        if not read_only and _listing.is_bare(epath.Path(directory)):  # before any lock file
            raise ConfigError(
                f"{directory} is itself one plain Orbax checkpoint, not a directory of steps: "
                "open it with read_only=True, and save into another directory"
            )
        with contextlib.ExitStack() as undo:  # what was made, undone if a later part fails
            # Before Orbax starts, since it deletes unfinished saves' leftovers at start-up.
            self._take_lock(directory, writer_lease_s, timeout_s, undo)
            self._store = self._store_class(
                directory,
                timeout_s=timeout_s,
                compression=compression,
                read_only=read_only,
                lock=self._lock,
                pack=bool(pack_small_leaves) and compression is None,
                incremental=bool(incremental),
                full_save_every=full_save_every,
            )
            undo.callback(self._store.close)
            # its listener for copies, made by every process at once (agreed by all)
            with _agree.deadline("the opening of the manager", timeout_s):
                self._local = self._local_store_class(local, read_only=read_only) if local else None
            undo.pop_all()
        self._reader = Reader(
            self._store, verify=verify_on_restore, restore_inflight_bytes=restore_inflight_bytes
        )
        self._tiers = Tiers(self._reader, self._local)
        self._preemption = Notices(policy, preemption, timeout_s=timeout_s, read_only=read_only)
        self._policy = policy
        self._retention = retention
        self._clock = clock
        self._last_save_time = clock()
        self._last_saved_step: int | None = None
        self._in_flight: int | None = None
        self._due: tuple[int, bool, bool] | None = None  # should_save's (step, local, persistent)
        self._closed = False

    @property
    def directory(self) -> epath.Path:
        """The directory, as a path (`etils.epath.Path`: local, gs:// or s3://)."""
        return self._store.directory

    def _take_lock(
        self, directory: str, lease_s: float, timeout_s: float, undo: contextlib.ExitStack
    ) -> None:
        """The writer's lock, taken by process 0, and every process agreed that it was:
        when it was not, the others raise too, rather than wait in Orbax's first barrier
        for a process 0 that left."""

        def take() -> None:
            if not self._read_only and jax.process_index() == 0:
                self._lock = writer_lock(directory, lease_s)
                if self._lock is not None:
                    self._lock.acquire()
                    undo.callback(self._lock.release)

        with _agree.deadline("the opening of the manager", timeout_s):
            refused = _agree.together("the writer lock taken by process 0", take)
        if refused:
            raise LockedError(
                f"process 0 could not take the writer lock of {directory} (its error says "
                "why); this process leaves with it"
            )

    # ---------------------------------------------------------------------------- queries

    @naming_its_store("listing the steps")
    def all_steps(self) -> list[int]:
        """The committed steps, oldest first. A step still being written is not listed."""
        return self._store.steps()

    @naming_its_store("finding the latest step")
    def latest_step(self) -> int | None:
        """The newest committed step, or None when there is none; with a local tier, the
        newest of either tier (a local step counts once every process's part of it exists:
        all processes agree on it, so every process calls this).

        It looks only at the step folders from the newest one down to the newest committed
        step: a stat or two whatever the number of steps. Step-like folders it meets that
        no one can read (a foreign or damaged folder) are logged as warnings, each once;
        where there is nothing else, the warning says that a resume from here starts over.
        """
        with _agree.deadline("the agreement on the latest step", self._store.timeout_s):
            return self._tiers.latest()

    @property
    def preempted(self) -> bool:
        """True once a preemption notice made `should_save` true: save, close, and exit."""
        return self._preemption.preempted

    def should_save(self, step: int) -> bool:
        """True when `step` should be saved: per the save policy, or for a preemption.

        >>> import tempfile, jaxckpt
        >>> policy = jaxckpt.SavePolicy(every_steps=100)
        >>> with jaxckpt.CheckpointManager(tempfile.mkdtemp(), policy=policy) as mngr:
        ...     [step for step in range(1, 301) if mngr.should_save(step)]
        [100, 200, 300]

        Call it at every step on every process, with the same step numbers: with several
        processes, the step saved for a notice (or for `every_seconds`) is agreed from them.
        It reads no files and makes no request until a notice; then it may wait for the
        others, at most `PreemptionPolicy.timeout_s` (`timeout_s` for `every_seconds`), and
        raise `ProcessesMissingError` naming those that did not come ([Deadlines](deadlines.md)).
        """
        step = check_step(step)
        preempting, due = self._preemption.at(step, self._clock() - self._last_save_time)
        if preempting:
            log.warning("preemption: step %d is the step to save before exiting", step)
            self._due = (step, False, True)  # to the persistent tier: the VM's disks go too
            return step != self._last_saved_step
        if step == self._last_saved_step:
            return False
        local = self._local is not None and self._local.tier.due(step)
        self._due = (step, local, due)
        return due or local

    # ---------------------------------------------------------------------------- save

    def save(
        self, step: int, *, state: Any, rng: Any = None, data: Any = None, meta: Any = None
    ) -> None:
        """Starts saving `step` and returns once the arrays are copied off the devices.

        >>> import jax, jax.numpy as jnp, tempfile, jaxckpt
        >>> with jaxckpt.CheckpointManager(tempfile.mkdtemp()) as mngr:
        ...     mngr.save(100, state={"w": jnp.ones((8, 8))}, rng=jax.random.key(0), meta={"loss": 0.25})
        ...     mngr.wait()  # (or train on: the write goes on in the background)
        ...     mngr.meta(100)
        {'loss': 0.25}

        The write continues in the background; the step becomes visible to `all_steps()` and
        `restore()` only when committed. An error in the background is raised by the next
        `save`, `wait` or `close`. Bad input is rejected here, before anything is written.

        Args:
          step: the training step; must not exist yet.
          state: any pytree of jax.Array / NumPy arrays / scalars (NNX State, TrainState,
            optax states, ...).
          rng: PRNG keys: typed ([`jax.random.key`][jax.random.key], any impl) or raw
            uint32, any pytree.
          data: an iterator with `get_state()` / `set_state()` (e.g. grain); each process
            saves its own state.
          meta: JSON-serialisable run metadata (config, metrics, ...).
        """
        self._check_open(writing=True)
        step = check_step(step)
        if meta is not None:
            check_json(meta)
        with gc_paused():
            state_arrays, state_specs, state_empty = flatten(state, item="state")
            rng_arrays, rng_specs, rng_empty = flatten(rng, item="rng")
        data_text, data_kind, data_about = _iterators.snapshot(data)
        local, persistent = self._tiers_due(step)
        if persistent:
            self._finish_pending()  # a local save alone never waits for a persistent one
            try:  # (agreed by every process: its step's folder absent, the lock held)
                self._store.agree_to_save(step)
            except (LockedError, StepExistsError):  # nothing started
                raise
            except Exception as e:
                raise self._save_error(step, e, background=False) from e
        with gc_paused():
            info = _layout.StepInfo(
                step=step,
                state=tuple(state_specs),
                rng=tuple(rng_specs),
                data=data_kind,
                meta=meta,
                rng_node_types=tuple(node_types(rng)),
                empty={_layout.STATE: tuple(state_empty), _layout.RNG: tuple(rng_empty)},
                saved_at=datetime.datetime.now(datetime.UTC).isoformat(),
                process_count=jax.process_count(),
                versions={"jax": jax.__version__},
            )
            _layout.check_readable_size(info)
            arrays = {_layout.STATE: state_arrays, _layout.RNG: rng_arrays}
            if local and self._local is not None:  # (local is only ever due with a local tier)
                with self._local_errors(self._local):
                    self._local.save(info, arrays, data_text, data_about)
            if persistent:
                try:
                    self._store.save(info, arrays, data_text, data_about)
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
    def _local_errors(self, store: _local.LocalStore) -> Iterator[None]:
        """A local save's failure (raised by the next save, wait or close) as a SaveError."""
        try:
            yield
        except _local.WriteFailed as e:
            raise SaveError(e.step, e.cause, store.steps()) from e.cause

    def wait(self) -> None:
        """Blocks until the save in flight is committed; raises `SaveError` if it failed."""
        self._check_open()
        self._finish_pending()
        if self._local is not None:
            with self._local_errors(self._local):
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
                    with self._local_errors(self._local):
                        self._local.close()
            finally:
                self._store.close()
                if self._lock is not None:
                    self._lock.release()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
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

    @naming_its_store("restoring a step")
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

        >>> import jax, jax.numpy as jnp, numpy as np, tempfile, jaxckpt
        >>> from jax.sharding import NamedSharding, PartitionSpec as P
        >>> with jaxckpt.CheckpointManager(tempfile.mkdtemp()) as mngr:
        ...     mngr.save(1, state={"w": jnp.arange(64.0).reshape(8, 8)})
        ...     mesh = jax.make_mesh((jax.device_count(),), ("data",))
        ...     on_mesh = NamedSharding(mesh, P("data"))  # rows split over the devices
        ...     target = {"w": jax.ShapeDtypeStruct((8, 8), jnp.float32, sharding=on_mesh)}
        ...     restored = mngr.restore(state=target)
        >>> w = restored.state["w"]
        >>> restored.step, w.sharding == on_mesh, np.asarray(w)[7, 7]
        (1, True, np.float32(63.0))

        A save of this manager still in flight is waited for first (and its failure raised),
        so a process always sees its own saves. With `verify_on_restore` (the default) the
        step's files are checked against its manifest first; a corrupt step raises
        `CorruptCheckpointError`, or, with `fallback=True` and `step=None`, is skipped (and
        logged) for the newest step that verifies.

        Args:
          step: the step to restore, or None for the latest committed step.
          state: the target: a pytree like the saved state whose leaves are
            [`jax.ShapeDtypeStruct`][jax.ShapeDtypeStruct] with a sharding, live
            [`jax.Array`][jax.Array]s (their sharding is used), NumPy arrays (restored on
            the host) or Python scalars. Its shardings decide where the data lands. None
            restores the saved tree as host NumPy arrays.
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
            has no manifest: it is read unverified ([Coming from Orbax](from-orbax.md)).
        """
        self.wait()  # a process always sees its own saves, local ones too
        wanted = Wanted(state, rng, data, data_mismatch_ok, partial, item)
        what = "the restore of " + ("the latest step" if step is None else f"step {step}")
        with _agree.deadline(what, self._store.timeout_s):
            restored = self._tiers.restore(step, wanted, fallback)
        if self._local is not None and not self._read_only:
            # The run goes on from here: newer local steps are of a timeline that does not.
            self._local.prune_after(restored.step)
        return restored

    def meta(self, step: int | None = None) -> Any:
        """The `meta=` saved with a step (None: the latest committed), reading no array:
        e.g. the run's config, to build the model before restoring into it."""
        self._check_open()
        self._finish_pending()
        return self._reader.meta(step)

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
        self._finish_pending()
        return self._reader.plan(step, state=state, partial=partial, item=item)

    def delete(self, step: int) -> None:
        """Deletes a committed step that jaxckpt wrote, as retention does: it leaves the
        listing at once, and its files go in the background (`close` waits for them). A
        step plain Orbax wrote is never deleted (ConfigError); the CLI's `jaxckpt rm`."""
        self._check_open(writing=True)
        self._finish_pending()
        step = check_step(step)

        def chosen(own: list[int]) -> list[int]:  # (process 0's decision, for every process)
            found = self._reader.resolve(step)
            if found not in own:
                raise ConfigError(
                    f"step {found} in {self.directory} was written by plain Orbax; jaxckpt "
                    "never deletes such a step (remove its folder yourself if you mean to)"
                )
            return [found]

        self._store.delete_steps(f"the deletion of step {step}", chosen)

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
        # Which steps go is process 0's decision, from its listing, for every process.
        with reaching(self.directory, f"applying retention after step {step}"):
            what = f"the retention after step {step}"
            self._store.delete_steps(what, self._retention.steps_to_delete)

    def _save_error(self, step: int, error: Exception, *, background: bool) -> SaveError:
        return _save_errors.save_error(self._store, self._lock, step, error, background=background)

    def _check_open(self, *, writing: bool = False) -> None:
        if self._closed:
            raise ConfigError("this CheckpointManager is closed; create a new one")
        if writing and self._read_only:
            raise ConfigError("this CheckpointManager was opened with read_only=True")

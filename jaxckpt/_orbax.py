"""The Orbax adapter: the persistent tier through Orbax's async checkpointer (what it writes
through which handler is `jaxckpt._orbax_items`'; Orbax's private names are
`jaxckpt._internals`').

jaxckpt hands Orbax flat `{name: array}` dicts (see `jaxckpt._tree`) and small JSON documents;
everything about handlers, restore args and Orbax's step folders stays in these modules.
Orbax's `AsyncCheckpointer` (its public API and options: the handlers, `AsyncOptions`'
barrier and post-finalization callback, `AtomicityOptions`) runs a save's background, its
barriers and its rename; jaxckpt keeps the listing, retention and every decision (Orbax's
`CheckpointManager`, which lists, retains and cleans up itself, is not used). What a step is
on disk is `jaxckpt._layout`'s.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable, Mapping
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath

from jaxckpt import (
    _agree,
    _commit,
    _incremental,
    _integrity,
    _internals,
    _jaxckpt_steps,
    _layout,
    _listing,
    _orbax_items,
    _orbax_steps,
    _sizes,
)
from jaxckpt._deleter import Deleter
from jaxckpt._lock import ObjectLease, WriterLock
from jaxckpt._read_interfaces import Layout
from jaxckpt._storage import absolute, open_inside, small_file_limit
from jaxckpt._tree import ReadRequest
from jaxckpt.errors import (
    ConfigError,
    CorruptCheckpointError,
    NoCheckpointError,
    StepExistsError,
)

log = logging.getLogger("jaxckpt")


@dataclasses.dataclass(frozen=True)
class Deletions:
    """What `OrbaxStore.delete_steps` does, as process 0 decided it for every process: the
    steps deleted, those retired (a kept step shares their bytes) and the retired steps
    freed (deleted: no kept step needs them any more)."""

    deleted: tuple[int, ...] = ()
    retired: tuple[int, ...] = ()
    freed: tuple[int, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.deleted or self.retired or self.freed)

    def text(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def of(cls, text: str) -> Deletions:
        return cls(**{k: tuple(int(s) for s in v) for k, v in json.loads(text).items()})


class OrbaxStore:
    """The persistent tier's `_read_interfaces.Store`: its steps listed and read (jaxckpt's through
    Orbax's handlers and jaxckpt's packed reader, plain Orbax's through Orbax), saved
    (`jaxckpt._commit`, the commit protocol) and deleted (each decided by process 0)."""

    shared = True  # one copy of each step for the whole job

    def __init__(
        self,
        directory: str | epath.PathLike,
        *,
        timeout_s: float = 1200,
        compression: str | None = None,
        read_only: bool = False,
        lock: WriterLock | ObjectLease | None = None,
        pack: bool = True,
        incremental: bool = False,
        full_save_every: int | None = _incremental.FULL_EVERY,
    ):
        """`lock`: the writer's lock (held by process 0), checked before each save, each
        commit and each delete. `pack`: leaves of at most `_packed.MAX_LEAF_BYTES` are
        packed (format 2); False writes each as an Orbax array of its own. `incremental`:
        every leaf is packed, each save writing only what changed (`_incremental`), and
        every piece every `full_save_every` saves (`_incremental.due_full`).
        `compression` ("zstd"): of each packed piece (`_codec`) if incremental, of Orbax's
        arrays otherwise."""
        self.directory = epath.Path(absolute(directory))
        self.timeout_s = _agree.check_timeout(timeout_s)
        small_file_limit()  # a bad JAXCKPT_MAX_METADATA_BYTES named here, not by a read
        self._lock = lock
        self._orbax_steps: dict[int, _layout.OrbaxStep] = {}
        self._read_steps: frozenset[tuple[int, str]] = frozenset()  # (`Listing.read`)
        self._prefixed: frozenset[int] = frozenset()
        # The committed steps as last listed (a `scan` of the newest step, and each save
        # waited for, adds its own): what a SaveError names when the store does not answer.
        self.listed: tuple[int, ...] = ()
        self._orbax_trees: dict[epath.Path, Any] = {}  # Orbax's metadata, read once an item
        self._layouts: dict[tuple[epath.Path, str | None, str | None], Layout] = {}
        self._sized: set[tuple[epath.Path, str | None]] = set()  # items checked (`oversized`)
        self._sharing = _incremental.Sharing(self.info)  # which steps share bytes with which
        self._retired: tuple[int, ...] = ()  # as the last `scan` found them
        _internals.install()  # Orbax's functions jaxckpt wraps, once in the process
        # Read without Orbax's ArrayMetadata, which its restore reads whole (every process's
        # file, on every process) for PRNG key impls only, which jaxckpt's info records.
        self._arrays = ocp.PyTreeCheckpointHandler(
            use_zarr3=True, type_handler_registry=_orbax_items.registry(array_metadata=False)
        )
        if read_only and not self.directory.exists():
            raise NoCheckpointError(f"{self.directory} does not exist; nothing to read there")
        # A reader saves nothing: no commits, and no thread of Orbax's.
        self._commits = None
        if not read_only:
            self._commits = _commit.Commits(
                self.directory,
                timeout_s=self.timeout_s,
                lock=lock,
                compression=compression,
                pack=pack,
                incremental=incremental,
                full_save_every=full_save_every,
                listing=self.scan,
                before_commit=self.before_commit,
            )
        self._deleter = Deleter(self.directory, self.remove)
        # Down to the newest committed step only: opening costs the same at any step count.
        listing = self.scan(newest=True)
        if not read_only and jax.process_index() == 0:
            # in the background from start-up (a reader never deletes anything)
            self._deleter.resume(listing)
        # Orbax's functions jaxckpt wraps act below it while it is open (`_internals.hold`)
        self._release = _internals.hold(self.directory, written=not read_only)

    def scan(self, *, newest: bool = False) -> _listing.Listing:
        """The directory as it is now (another process may have written or deleted);
        `newest`: only down to the newest committed step (`_listing.Listing.of`)."""
        listing = _listing.Listing.of(
            self.directory, newest=newest, known=self._orbax_steps, read=self._read_steps
        )
        self._orbax_steps = dict(listing.orbax)
        self._read_steps = listing.read
        self._prefixed = listing.prefixed
        self._retired = listing.retired
        found = (*self.listed, *listing.committed) if newest else listing.committed
        self.listed = tuple(sorted(set(found)))
        return listing

    def steps(self) -> list[int]:
        """Committed steps, jaxckpt's and plain Orbax's, oldest first."""
        return list(self.scan().committed)

    def own_steps(self) -> list[int]:
        """The committed steps jaxckpt wrote, oldest first: the only ones it deletes."""
        return list(self.scan().own)

    def tree(self, step: int, item: str | None = None) -> tuple[_layout.StepInfo, str]:
        """A committed step's metadata and which of its trees `item` names: of a jaxckpt
        step "state" (None) or "rng"; of a plain Orbax step one of its pytree items (None or
        "state": its only one)."""
        if self.is_orbax(step):
            return self.info(step, None if item in (None, _layout.STATE) else item), _layout.STATE
        if item not in (None, *_layout.ITEMS):
            raise ConfigError(
                f"item must be one of {list(_layout.ITEMS)} for step {step} in "
                f"{self.directory}, a jaxckpt step (a pytree item's name chooses among those "
                f"of a step plain Orbax wrote), got {item!r}"
            )
        return self.info(step), item or _layout.STATE

    def _item_tree(self, path: epath.Path) -> Any:
        """An Orbax pytree item's metadata tree (`_orbax_tree`), read once by this store:
        jaxckpt never rewrites a step that plain Orbax wrote."""
        if path not in self._orbax_trees:
            self._orbax_trees[path] = _orbax_steps.tree(path)
        return self._orbax_trees[path]

    def is_orbax(self, step: int) -> bool:
        """Whether the last `scan` found `step` to be a step plain Orbax wrote."""
        return step in self._orbax_steps

    def info(self, step: int, item: str | None = None) -> _layout.StepInfo:
        """What a committed step that the last `scan` listed holds: a jaxckpt step's
        jaxckpt.json (FileNotFoundError if it is gone), or what Orbax recorded of a plain
        Orbax step's pytree item `item` (None: its only one)."""
        found = self._orbax_steps.get(step)
        if found is not None:
            # before Orbax opens any: no link, no file it would read whole swollen (once)
            if problems := _integrity.unsafe_entries(found.path) or self._oversized(found.path):
                raise CorruptCheckpointError(step, problems, str(self.directory))
            return _orbax_steps.info(self.directory, step, found, item, self._item_tree)
        if item not in (None, _layout.STATE):
            raise ConfigError(
                f"step {step} in {self.directory} is a jaxckpt step: item= chooses among the "
                f"pytree items of a step plain Orbax wrote (got item={item!r})"
            )
        return _layout.read_info(self.directory, step)

    def step_folder_exists(self, step: int) -> bool:
        """Whether anything (committed, foreign, or Orbax's own) sits at the step's path."""
        # On object storage an unfinished save sits at its step's path: its removal, started
        # at start-up, ends first (a failed one is logged, and the next writer tries again).
        self._deleter.leftovers_removed()
        if self.step_dir(step).exists():
            return True
        # `checkpoint_<step>/`, say, below the newest step, which a newest-only scan did not
        # look into: listed whole now (a save under the step of a folder of another name)
        return step in self._prefixed and step in self.scan().orbax

    def agree_to_save(self, step: int) -> None:
        """Step 1 of the commit protocol (`_commit.Commits.save`): every process starts the
        save of `step`, or all raise the same (the lock lost, something at its path)."""
        self._writing().agree_to_save(step, self._refuse_if_taken)

    def _refuse_if_taken(self, step: int) -> None:
        """StepExistsError if anything sits at the step's path (process 0's decision)."""
        # One stat on the blocking path; the directory is listed only to word the refusal.
        if not self.step_folder_exists(step):
            return
        if self.is_orbax(step):
            raise StepExistsError(
                f"step {step} in {self.directory} is a step plain Orbax wrote, which "
                "jaxckpt reads and never overwrites or deletes. Save under a later step."
            )
        if step in self.steps():
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

    def save(
        self,
        info: _layout.StepInfo,
        arrays: Mapping[str, Mapping[str, Any]],
        data: str | None,
        data_about: str | None = None,
    ) -> None:
        """Starts the async save of step `info.step` (`_commit.Commits.save`; a seam of
        this class, which a faulty store fails)."""
        self._writing().save(info, arrays, data, data_about)

    def before_commit(self, folder: epath.Path) -> None:
        """Step 3 of the commit protocol, on process 0, just before the step is made
        visible (`_commit.Commits.finish`; a seam of this class: a faulty store kills a
        process or loses the lock there)."""
        self._writing().finish(folder)

    def wait(self) -> None:
        """Blocks until the in-flight save commits; raises its background error, once."""
        if self._commits is not None and (step := self._commits.wait()) is not None:
            self.listed = tuple(sorted({*self.listed, step}))

    def _writing(self) -> _commit.Commits:
        assert self._commits is not None  # (a reader's save is refused before)
        return self._commits

    def step_dir(self, step: int) -> epath.Path:
        """The step's folder (of a step plain Orbax wrote: as the last `scan` found it)."""
        found = self._orbax_steps.get(step)
        return found.path if found else self.directory / str(step)

    def layout(self, info: _layout.StepInfo) -> Layout:
        """How the step is read: a step plain Orbax wrote through Orbax alone, one of
        jaxckpt's as Orbax's arrays and the packed leaves."""
        key = (info.folder(self.directory), info.saved_at, info.item)
        if key not in self._layouts:  # made once a step: what it checks, checked once
            if len(self._layouts) >= 4:  # the steps being read now, not every one read
                self._layouts.clear()
            if info.orbax is not None:
                path = info.orbax.item_dir(info.item)
                made: Layout = _orbax_steps.OrbaxLayout(info, self._item_tree(path), self.directory)
            else:
                made = _jaxckpt_steps.JaxckptLayout(self, info)
            self._layouts[key] = made
        return self._layouts[key]

    def read_arrays(
        self, info: _layout.StepInfo, item: str, batch: Mapping[str, ReadRequest]
    ) -> dict[str, Any]:
        """The arrays `batch` names of one item of a step (none zero-size), each onto its
        sharding (or to the host), as the step's layout reads them: one batch, as given (a
        seam of this class, which a faulty store freezes or counts)."""
        return self.layout(info).read(item, batch)

    def check_sizes(self, info: _layout.StepInfo, item: str) -> None:
        """Before Orbax reads an item of a jaxckpt step: CorruptCheckpointError naming each
        file it would read whole that is swollen (`_oversized`)."""
        if problems := self._oversized(info.folder(self.directory) / item, info.saved_at):
            raise CorruptCheckpointError(info.step, problems, str(self.directory))

    def _oversized(self, folder: epath.Path, saved_at: str | None = None) -> list[str]:
        """`_sizes.oversized(folder)`, listed once a step (`saved_at`: a deleted step's
        number may be saved again) while nothing is found."""
        key = (folder, saved_at)
        if key in self._sized:
            return []
        if problems := _sizes.oversized(folder):
            return problems
        self._sized = {k for k in self._sized if k[0] != folder} | {key}
        return []

    def open_file(self, folder: epath.Path, name: str, size: int | None = None) -> Any:
        """Opens a file of a step's packed leaves to read (`_storage.open_inside`)."""
        return open_inside(folder, name, size)

    def read_orbax_arrays(
        self, step: int, item: str, batch: Mapping[str, ReadRequest]
    ) -> dict[str, Any]:
        """The Orbax arrays `batch` names of an item of a jaxckpt step, unchecked."""
        args = ocp.args.PyTreeRestore(
            item={n: jax.ShapeDtypeStruct(r.shape, r.dtype) for n, r in batch.items()},
            restore_args={n: _orbax_steps.restore_args(r) for n, r in batch.items()},
            # read only the requested leaves, never the rest of the step
            partial_restore=True,
        )
        # Through the item's handler, not the manager: Orbax's restore ends in a barrier
        # made of device collectives, which a process whose read failed never reaches,
        # while the others would pair theirs with its next collective (`_spread`).
        return self._arrays.restore(self.step_dir(step) / item, args=args)

    def delete_steps(self, what: str, choose: Callable[[list[int]], list[int]]) -> Deletions:
        """Deletes the committed steps jaxckpt wrote that `choose` picks among them (oldest
        first), as process 0 lists them: process 0 decides for every process (the agreement
        `what`; `choose` runs there alone). Each step leaves the listing now and its files
        go in the background (process 0's `Deleter`), off the save's blocking path; a step
        a kept one shares bytes with is retired instead, and each retired step no kept step
        needs any more is deleted. A writer that lost its lock deletes nothing (LockedError).
        """
        with _agree.deadline(what, self.timeout_s):
            plan = Deletions.of(_agree.decided(what, lambda: self._deletions(choose).text()))
            for step in (*plan.deleted, *plan.retired, *plan.freed):
                self._forget(step, retired=step in plan.retired)
            self._retired = tuple(sorted({*self._retired, *plan.retired} - {*plan.freed}))
            if jax.process_index() == 0:
                for step in plan.deleted:
                    self._deleter.delete(step)
                for step in plan.retired:
                    self._deleter.retire(step)
                for step in plan.freed:
                    self._deleter.free(step)
            if plan:  # (the same on every process: decided) out of every listing from here
                _agree.barrier(f"{what}: the steps out of the listing")
        return plan

    def _deletions(self, choose: Callable[[list[int]], list[int]]) -> Deletions:
        """Process 0's decision of `delete_steps`, from a listing of the whole directory."""
        if self._lock is not None:
            self._lock.check()
        own = self.own_steps()
        doomed = choose(own)
        kept = {s: self.step_dir(s) for s in own if s not in doomed}
        users = {s: self._sharing.users(s, kept) for s in doomed}
        plan = Deletions(
            deleted=tuple(s for s in doomed if not users[s]),
            retired=tuple(s for s in doomed if users[s]),
            freed=tuple(self._sharing.unneeded(self._retired, kept)),
        )
        for step in doomed:
            if users[step]:
                log.info("step %d retired: step(s) %s share its bytes", step, users[step])
            else:
                log.info("deleting step %d from %s", step, self.directory)
        for step in plan.freed:
            log.info("deleting retired step %d: no kept step shares its bytes", step)
        return plan

    def _forget(self, step: int, *, retired: bool) -> None:
        """What this store holds of a step leaving the listing (its files going unless
        `retired`)."""
        self._layouts = {k: v for k, v in self._layouts.items() if k[0] != self.step_dir(step)}
        self._sharing.forget(step)
        self.listed = tuple(s for s in self.listed if s != step)
        if not retired and self._commits is not None:
            self._commits.forget(step)

    def close(self) -> None:
        """Waits for the save in flight and the deletions under way (`Deleter.close`)."""
        if self._commits is not None:
            self._commits.close()
        self._deleter.close()
        self._release()

    def remove(self, path: epath.Path, what: str = "a deleted step's files") -> bool:
        """Deletes a folder or object, in the deleter's thread (`Deleter.remove`; a seam of
        this class, which a faulty store slows or fails)."""
        return self._deleter.remove(path, what)

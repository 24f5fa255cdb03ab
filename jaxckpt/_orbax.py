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
import os
from collections.abc import Callable, Mapping
from typing import Any

import jax
import orbax.checkpoint as ocp
import xxhash
from etils import epath

from jaxckpt import (
    _agree,
    _incremental,
    _integrity,
    _internals,
    _jaxckpt_steps,
    _layout,
    _listing,
    _orbax_items,
    _orbax_steps,
    _packed,
    _sizes,
)
from jaxckpt._deleter import Deleter
from jaxckpt._lock import ObjectLease, WriterLock
from jaxckpt._storage import absolute, is_remote, open_inside, small_file_limit
from jaxckpt._stores import Layout
from jaxckpt._tree import ReadRequest
from jaxckpt.errors import (
    ConfigError,
    CorruptCheckpointError,
    NoCheckpointError,
    StepExistsError,
)

log = logging.getLogger("jaxckpt")


# Orbax's bound on the whole background save (its own writes too), set out of reach: ten
# years, which Orbax's deadline arithmetic still takes.
UNTIMED_S = 10 * 365 * 86400


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
    """Async saves and reads of jaxckpt steps through one Orbax `CheckpointManager`; the
    owner of the commit protocol (see `save`). The persistent tier's `_stores.Store`."""

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
        self._saving: int | None = None
        self._missed = False  # whether a barrier of the save in flight timed out
        self._orbax_steps: dict[int, _layout.OrbaxStep] = {}
        self._read_steps: frozenset[tuple[int, str]] = frozenset()  # (`Listing.read`)
        self._prefixed: frozenset[int] = frozenset()
        # The committed steps as last listed (a `scan` of the newest step, and each save
        # waited for, adds its own): what a SaveError names when the store does not answer.
        self.listed: tuple[int, ...] = ()
        self._noted: int | None = None  # the last save `listed` holds
        self._orbax_trees: dict[epath.Path, Any] = {}  # Orbax's metadata, read once an item
        self._layouts: dict[tuple[epath.Path, str | None, str | None], Layout] = {}
        self._sized: set[tuple[epath.Path, str | None]] = set()  # items checked (`oversized`)
        self._pack = pack
        self._incremental = incremental
        self._full_save_every = full_save_every
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
        self._packed_handler = _orbax_items.PackedHandler(compression if incremental else None)
        # A reader saves nothing: no checkpointer, and no thread of Orbax's.
        self._checkpointer = None if read_only else self._writer(compression)
        self._deleter = Deleter(self.directory, self.remove)
        # Down to the newest committed step only: opening costs the same at any step count.
        listing = self.scan(newest=True)
        if not read_only and jax.process_index() == 0:
            # in the background from start-up (a reader never deletes anything)
            self._deleter.resume(listing)
        # Orbax's functions jaxckpt wraps act below it while it is open (`_internals.hold`)
        self._release = _internals.hold(self.directory, written=not read_only)

    def _writer(self, compression: str | None) -> ocp.AsyncCheckpointer:
        """Orbax's async checkpointer of a step's items (steps 2 and 4 of the commit
        protocol, `save`), through its public options alone."""
        # zarr3, each chunk with a CRC-32C (`_internals.hold`): a restore checks every byte
        # as tensorstore decodes it, reading each once.
        arrays = ocp.PyTreeCheckpointHandler(
            use_compression=compression == "zstd",
            use_zarr3=True,
            type_handler_registry=_orbax_items.registry(),
        )
        async_options = ocp.AsyncOptions(
            # Orbax bounds the whole background save by this, this process's own writes
            # included: a large or slow save never committed. jaxckpt bounds only the waits
            # for the others (each barrier: `_barrier_ms`).
            timeout_secs=UNTIMED_S,
            post_finalization_callback=self._finalized,
            # In a job of several processes, each hashes the files it wrote before the
            # barrier that precedes the commit (`_hash_own_files`).
            barrier_sync_fn=_internals.barrier_after_writes(
                self._hash_own_files, self._barrier_ms, self._barrier_failed
            ),
            # The step's folders are made in the background (made in save() they doubled
            # its blocking time), a failed creation waking every writer waiting for them
            # (`_internals.hold`).
            create_directories_asynchronously=True,
        )
        # No rename on object storage: a step (and each item) is written in place and
        # committed by a commit_success.txt written last (Orbax's own way on gs://).
        atomicity = ocp.options.AtomicityOptions(
            mode=ocp.options.AtomicityMode.COMMIT_FILE
            if is_remote(self.directory)
            else ocp.options.AtomicityMode.AUTO
        )
        items = ocp.CompositeCheckpointHandler(
            composite_options=ocp.CompositeOptions(
                async_options=async_options, atomicity_options=atomicity
            ),
            **{
                _layout.STATE: arrays,
                _layout.RNG: arrays,
                _layout.DATA: _orbax_items.DataStateHandler(),
                _layout.PACKED: self._packed_handler,
                _layout.META_DIR: ocp.JsonCheckpointHandler(filename=_layout.INFO_FILE),
            },
        )
        if not is_remote(self.directory):
            self.directory.mkdir(parents=True, exist_ok=True)
        return ocp.AsyncCheckpointer(
            items, async_options=async_options, atomicity_options=atomicity
        )

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
        """Step 1 of the commit protocol (`save`), decided by process 0 for every process:
        the writer's lock confirmed (`LockedError` if this job lost it) and nothing at the
        step's path (`StepExistsError`); every process raises the same, or all start."""
        with _agree.deadline(f"the save of step {step}", self.timeout_s):
            _agree.decided(f"the start of the save of step {step}", lambda: self._may_save(step))

    def _may_save(self, step: int) -> str:
        """Process 0's decision of `agree_to_save`."""
        if self._lock is not None:
            self._lock.check()
        # One stat on the blocking path; the directory is listed only to word the refusal.
        if not self.step_folder_exists(step):
            return "go"
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
        """Starts an async save of step `info.step`: `arrays` {item: {name: array}} (the
        flattened state and rng), `data` this process's data-iterator state and
        `data_about` what the iterator was (as JSON text). Returns once device arrays are
        copied to host memory.

        The commit protocol, all of it here:
        1. Before anything is written (`agree_to_save`, which the caller made first),
           process 0 confirms the writer's lock (`LockedError` if this job lost it: its
           lock file was removed or replaced, or its lease taken over) and that nothing
           sits at the step's path, for every process.
        2. Orbax makes `<step>.orbax-checkpoint-tmp` (on object storage, `<step>` itself)
           now, and every process writes its shards into it in the background.
        3. Each process hashes the files it wrote (`_hash_own_files`, before Orbax's
           barrier after the writes). Once every item is written on every process
           (Orbax's post-finalization callback, `before_commit`), process 0 hashes the
           rest and writes the manifest of every file (`_integrity.write_manifest`: the
           data files, whose chunks and pieces carry checksums of their own, listed as
           checked by a read), then asks the lock again, of the server itself for a
           lease: a writer that lost it raises there and the step never commits.
        4. Orbax renames the folder to `<step>` (object storage: writes its
           `commit_success.txt`). The step is committed, and listed, from then on.
        A failure at 2-4 is raised by `wait` (as the background error it is).

        At each agreement (the start, then each of Orbax's barriers) a process waits for
        the others at most `timeout_s` from its own arrival (ProcessesMissingError naming
        those that did not come); its own writes are never timed: they take as long as
        the store takes, a store that makes no progress being given up on by its clients.
        """
        step = info.step
        args: dict[str, Any] = {}
        small: dict[str, dict[str, Any]] = {}
        for item in _layout.ITEMS:
            # Orbax refuses zero-size arrays; their specs are enough to remake them.
            leaves = {name: a for name, a in arrays.get(item, {}).items() if a.size}
            if self._incremental:
                small[item], leaves = leaves, {}
            elif self._pack:
                small[item] = {n: a for n, a in leaves.items() if _packed.is_small(a)}
                leaves = {n: a for n, a in leaves.items() if n not in small[item]}
            if leaves:
                args[item] = ocp.args.PyTreeSave(
                    leaves, ocdbt_target_data_file_size=_orbax_items.data_file_bytes(leaves)
                )
        if self._incremental and self._packed_handler.base is None:  # (a restarted job's)
            # the whole directory listed, once: the steps the base's pieces are in must be
            # committed (or retired) steps of it, which a newest-only listing does not show
            listing = self.scan()
            self._packed_handler.base = _incremental.seeded(
                self.directory, listing.committed, step, self._packed_handler.codec, listing.retired
            )
        if self._incremental and _incremental.due_full(
            self._packed_handler.base, self._full_save_every
        ):
            self._packed_handler.base = None  # (this save's pieces are the next one's base)
        if any(small.values()):
            incremental = step if self._incremental else None
            args[_layout.PACKED] = _orbax_items.PackedSave(small, incremental)
            packed = {item: frozenset(names) for item, names in small.items() if names}
            info = dataclasses.replace(info, packed=packed)
        args[_layout.META_DIR] = ocp.args.JsonSave(info.to_json())
        if data is not None:
            args[_layout.DATA] = _orbax_items.DataSave(data, data_about)
        self._saving, self._missed = step, False
        self._packed_handler.written = {}  # (a step without small leaves calls it not)
        assert self._checkpointer is not None  # (a reader's save is refused before)
        with _internals.writers_held():  # the background starts once this returns
            self._checkpointer.save(self.directory / str(step), args=ocp.args.Composite(**args))

    def _barrier_ms(self) -> int:
        """How long a process waits at each of Orbax's barriers for the others, in ms: once
        one of the save's timed out, not again (the missing processes are named once)."""
        return 1 if self._missed else max(1, int(self.timeout_s * 1000))

    def _barrier_failed(self) -> None:
        self._missed = True

    def _saving_folder(self, step: int) -> epath.Path:
        tmp = self.directory / f"{step}{_layout.TMP_SUFFIX}"
        return tmp if tmp.exists() else self.step_dir(step)

    def _digests_key(self, step: int) -> str:
        return f"jaxckpt/digests/{xxhash.xxh3_64_hexdigest(str(self.directory).encode())}/{step}"

    def _hash_own_files(self) -> None:
        # Orbax calls this in its background save on every process of a job of several,
        # once the process's own files of the step are written (`_integrity.process_files`),
        # before the barrier that precedes the commit: each process hashes what it wrote,
        # and process 0 (`before_commit`) only the rest, so each reads about its share.
        if (step := self._saving) is None:
            return
        folder = self._saving_folder(step)
        written = self._packed_handler.written
        try:
            own = _integrity.process_files(folder, jax.process_index(), jax.process_count())
            own = {rel: now for rel, now in own.items() if rel not in written}
            found = _integrity.digests(folder, list(own.values()))
        except OSError as e:  # not fatal: process 0 hashes those files itself
            log.warning("could not hash this process's files of step %d: %s", step, e)
            return
        hashed = written | {rel: found[now] for rel, now in own.items()}
        _internals.publish(f"{self._digests_key(step)}/{jax.process_index()}", json.dumps(hashed))

    def _finalized(self) -> None:
        # Orbax calls this in its background thread on process 0, once every process's
        # files are written and every item finalized, before it commits the step.
        if self._saving is not None and jax.process_index() == 0:
            self.before_commit(self._saving_folder(self._saving))

    def before_commit(self, folder: epath.Path) -> None:
        """Step 3 of the commit protocol (`save`), on process 0: the merged packed index
        (`_packed.merge`) and the manifest of the step's `folder` (of the files the other
        processes hashed, what they found), then the lock asked again; a writer that lost
        it never commits."""
        hashed: dict[str, Any] = dict(self._packed_handler.written)
        indexes: list[Any] = []
        if self._saving is not None and jax.process_count() > 1:
            for found in _internals.take(self._digests_key(self._saving)):
                hashed |= json.loads(found)
            if (folder / _layout.PACKED).is_dir():
                indexes = _packed.merge(folder / _layout.PACKED, jax.process_count())
        if self._incremental and self._saving is not None:
            self._record_shares(folder, self._saving, indexes)
        _integrity.write_manifest(folder, read_checked=True, hashed=hashed)
        if self._lock is not None:
            self._lock.check(confirm=True)

    def _record_shares(self, folder: epath.Path, step: int, indexes: list[Any]) -> None:
        """An incremental step's `shares.json` (every process's references: the merged
        indexes, or this one process's base); the save fails if a step it shares bytes with is
        gone (deleted since the base was saved) or is a link out of the directory: the step
        would never restore, or restore from bytes jaxckpt does not keep."""
        made = self._packed_handler.made
        if indexes:
            shares = set(_incremental.shares_of(indexes)) - {step}
        else:
            shares = made.owners() - {step} if made is not None else set()
        gone = sorted(
            s for s in shares if os.path.islink(self.step_dir(s)) or not self.step_dir(s).is_dir()
        )
        if gone:
            raise RuntimeError(  # the save's background error: SaveError names it
                f"step {step} shares bytes with step(s) {gone} of {self.directory}, which are "
                "gone (deleted while it was saved); it is not committed. Save again: the next "
                "save writes every piece"
            )
        _incremental.write_shares(folder, shares)

    def step_dir(self, step: int) -> epath.Path:
        """The step's folder (of a step plain Orbax wrote: as the last `scan` found it)."""
        found = self._orbax_steps.get(step)
        return found.path if found else self.directory / str(step)

    def wait(self) -> None:
        """Blocks until the in-flight save commits; raises its background error, once."""
        if self._checkpointer is not None:  # (its failure is raised once)
            self._checkpointer.wait_until_finished()
        if (step := self._saving) is not None and step != self._noted:  # committed
            self.listed, self._noted = tuple(sorted({*self.listed, step})), step
            self._packed_handler.adopt()

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
        if not retired:
            self._packed_handler.forget(step)

    def close(self) -> None:
        """Waits for the save in flight and the deletions under way (`Deleter.close`)."""
        if self._checkpointer is not None:
            self._checkpointer.close()
        self._deleter.close()
        self._release()

    def remove(self, path: epath.Path, what: str = "a deleted step's files") -> bool:
        """Deletes a folder or object, in the deleter's thread (`Deleter.remove`; a seam of
        this class, which a faulty store slows or fails)."""
        return self._deleter.remove(path, what)

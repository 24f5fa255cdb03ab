"""A step's commit on the persistent tier, all of it here (`Commits.save` is the protocol
and its docstring): the start agreed by every process, the background writes through
Orbax's public `AsyncCheckpointer` (its handlers, barriers and rename), each process's
digests gathered, the packed indexes merged, the step's shares and manifest written, the
writer's lock confirmed, and the step made visible by Orbax's rename (or commit file).

Orbax runs steps 2 and 4 through its public options alone: `AsyncOptions.barrier_sync_fn`
(each barrier waits `timeout_s` from this process's arrival, and the files a process wrote
are hashed at the barrier after its writes: `_internals.barrier_after_writes`, which reads
Orbax's barrier key, a text it does not promise) and `post_finalization_callback` (the
manifest and the lock, before the rename). Where a guarantee needs more than a public
option gives, jaxckpt owns that part: the start agreement and every retention decision
(`_agree`), the listing (`_listing`), a failed folder creation waking the writers and the
background held until the blocking part returns (`_internals._wakes`, `writers_held`).
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
    _layout,
    _listing,
    _orbax_items,
    _packed,
)
from jaxckpt._lock import ObjectLease, WriterLock
from jaxckpt._storage import is_remote

log = logging.getLogger("jaxckpt")

# Orbax's bound on the whole background save (its own writes too), set out of reach: ten
# years, which Orbax's deadline arithmetic still takes.
UNTIMED_S = 10 * 365 * 86400


class Commits:
    """The commits of one directory's steps, one in flight at a time, by the processes of a
    job (each process's own `Commits`, every process making every call)."""

    def __init__(
        self,
        directory: epath.Path,
        *,
        timeout_s: float,
        lock: WriterLock | ObjectLease | None,
        compression: str | None,
        pack: bool,
        incremental: bool,
        full_save_every: int | None,
        listing: Callable[[], _listing.Listing],
        before_commit: Callable[[epath.Path], None],
    ):
        """`listing()`: the whole directory listed (where a restarted job's first save
        finds its base); `before_commit(folder)`: step 3 on process 0 (the store's seam,
        which calls `finish`)."""
        self.directory = directory
        self.timeout_s = timeout_s
        self._lock = lock
        self._pack = pack
        self._incremental = incremental
        self._full_save_every = full_save_every
        self._listing = listing
        self._before_commit = before_commit
        self._saving: int | None = None  # the step of the save in flight (or last made)
        self._committed: int | None = None  # the last step `wait` returned
        self._missed = False  # whether a barrier of the save in flight timed out
        self.packed = _orbax_items.PackedHandler(compression if incremental else None)
        self._checkpointer = self._writer(compression)

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
                _layout.PACKED: self.packed,
                _layout.META_DIR: ocp.JsonCheckpointHandler(filename=_layout.INFO_FILE),
            },
        )
        if not is_remote(self.directory):
            self.directory.mkdir(parents=True, exist_ok=True)
        return ocp.AsyncCheckpointer(
            items, async_options=async_options, atomicity_options=atomicity
        )

    def agree_to_save(self, step: int, refuse: Callable[[int], None]) -> None:
        """Step 1 (`save`), decided by process 0 for every process: the writer's lock
        confirmed (`LockedError` if this job lost it) and nothing at the step's path
        (`refuse(step)` raises `StepExistsError` otherwise); every process raises the same,
        or all start."""

        def may_save() -> str:
            if self._lock is not None:
                self._lock.check()
            refuse(step)
            return "go"

        with _agree.deadline(f"the save of step {step}", self.timeout_s):
            _agree.decided(f"the start of the save of step {step}", may_save)

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

        The commit protocol:
        1. Before anything is written (`agree_to_save`, which the caller made first),
           process 0 confirms the writer's lock (`LockedError` if this job lost it: its
           lock file was removed or replaced, or its lease taken over) and that nothing
           sits at the step's path, for every process.
        2. Orbax makes `<step>.orbax-checkpoint-tmp` (on object storage, `<step>` itself)
           now, and every process writes its shards into it in the background.
        3. Each process hashes the files it wrote (`_hash_own_files`, before Orbax's
           barrier after the writes). Once every item is written on every process
           (Orbax's post-finalization callback: the store's `before_commit`, then
           `finish`), process 0 hashes the rest and writes the manifest of every file
           (`_integrity.write_manifest`: the data files, whose chunks and pieces carry
           checksums of their own, listed as checked by a read), then asks the lock again, of the server itself for a
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
        if self._incremental and self.packed.base is None:  # (a restarted job's)
            # the whole directory listed, once: the steps the base's pieces are in must be
            # committed (or retired) steps of it, which a newest-only listing does not show
            listing = self._listing()
            self.packed.base = _incremental.seeded(
                self.directory, listing.committed, step, self.packed.codec, listing.retired
            )
        if self._incremental and _incremental.due_full(self.packed.base, self._full_save_every):
            self.packed.base = None  # (this save's pieces are the next one's base)
        if any(small.values()):
            incremental = step if self._incremental else None
            args[_layout.PACKED] = _orbax_items.PackedSave(small, incremental)
            packed = {item: frozenset(names) for item, names in small.items() if names}
            info = dataclasses.replace(info, packed=packed)
        args[_layout.META_DIR] = ocp.args.JsonSave(info.to_json())
        if data is not None:
            args[_layout.DATA] = _orbax_items.DataSave(data, data_about)
        self._saving, self._missed = step, False
        self.packed.written = {}  # (a step without small leaves calls it not)
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
        return tmp if tmp.exists() else self.directory / str(step)

    def _digests_key(self, step: int) -> str:
        return f"jaxckpt/digests/{xxhash.xxh3_64_hexdigest(str(self.directory).encode())}/{step}"

    def _hash_own_files(self) -> None:
        # Orbax calls this in its background save on every process of a job of several,
        # once the process's own files of the step are written (`_integrity.process_files`),
        # before the barrier that precedes the commit: each process hashes what it wrote,
        # and process 0 (`finish`) only the rest, so each reads about its share.
        if (step := self._saving) is None:
            return
        folder = self._saving_folder(step)
        written = self.packed.written
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
            self._before_commit(self._saving_folder(self._saving))

    def finish(self, folder: epath.Path) -> None:
        """Step 3 (`save`), on process 0: the merged packed index
        (`_packed.merge`) and the manifest of the step's `folder` (of the files the other
        processes hashed, what they found), then the lock asked again; a writer that lost
        it never commits."""
        hashed: dict[str, Any] = dict(self.packed.written)
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
        made = self.packed.made
        if indexes:
            shares = set(_incremental.shares_of(indexes)) - {step}
        else:
            shares = made.owners() - {step} if made is not None else set()
        gone = sorted(
            s
            for s in shares
            if os.path.islink(self.directory / str(s)) or not (self.directory / str(s)).is_dir()
        )
        if gone:
            raise RuntimeError(  # the save's background error: SaveError names it
                f"step {step} shares bytes with step(s) {gone} of {self.directory}, which are "
                "gone (deleted while it was saved); it is not committed. Save again: the next "
                "save writes every piece"
            )
        _incremental.write_shares(folder, shares)

    def wait(self) -> int | None:
        """Blocks until the save in flight commits; raises its background error, once.
        Returns the step it committed (None: none since the last call)."""
        self._checkpointer.wait_until_finished()
        if (step := self._saving) is None or step == self._committed:
            return None
        self._committed = step
        self.packed.adopt()
        return step

    def forget(self, step: int) -> None:
        """A step whose files are deleted: no later save refers to its pieces."""
        self.packed.forget(step)

    def close(self) -> None:
        """Waits for the save in flight (its failure was raised by `wait`, or is now)."""
        self._checkpointer.close()

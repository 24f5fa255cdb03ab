"""Reading a checkpoint: the one way every read goes.

`restore`, `jaxckpt.open`, `diff`, `verify`, both exports and every CLI command read
through a `Reader`: it lists the steps, describes one, reads it onto a target (verified
against its manifest), and verifies steps. A `CheckpointManager` reads through the `Reader`
of its own store, and its local tier through `read_trees` on its local store (`_read_step`: one
step's trees, either tier). `jaxckpt.Checkpoint` (`_checkpoint`) is its public face.

How a restore goes down through it, module by module, is the docs' architecture page
(docs/architecture.md, "A restore, top to bottom"; tests/test_docs.py checks its names).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import os
from collections.abc import Callable
from typing import Any

import jax
from etils import epath

from jaxckpt import (
    _agree,
    _incremental,
    _integrity,
    _iterators,
    _layout,
    _listing,
    _orbax,
    _orbax_steps,
    _spread,
)
from jaxckpt._agree import refusing
from jaxckpt._checks import check_step, gc_paused
from jaxckpt._match import plan_restore, uniform_requests
from jaxckpt._memory import auto_inflight_bytes
from jaxckpt._plan import RestorePlan, plan_reads, read_batches
from jaxckpt._read_step import Restored, Wanted, check_data, read_trees
from jaxckpt._store_errors import naming_the_store, store_failed
from jaxckpt._tree import ReadRequest
from jaxckpt.errors import (
    CorruptCheckpointError,
    JaxckptError,
    NoCheckpointError,
    ProcessesDisagreeError,
    ProcessesMissingError,
    RestoreError,
    StepNotFoundError,
)

log = logging.getLogger("jaxckpt")


@naming_the_store  # its failures as StorageError: down, refusing us, no such bucket
def open_reader(
    directory: str | os.PathLike[str],
    *,
    verify: bool = True,
    restore_inflight_bytes: int | None = None,
    timeout_s: float = _agree.DEFAULT_TIMEOUT_S,
) -> Reader:
    """A `Reader` of `directory` owning its read-only store (`jaxckpt.open`'s arguments)."""
    timeout_s = _agree.check_timeout(timeout_s)
    with _agree.deadline("the opening of the checkpoint", timeout_s):
        budget = restore_inflight_bytes or auto_inflight_bytes()
    store = _orbax.OrbaxStore(directory, read_only=True, timeout_s=timeout_s)
    return Reader(store, verify=verify, restore_inflight_bytes=budget, owned=True)


class Reader:
    """A checkpoint directory, read: its steps, what each holds, and reads onto a target.

    What `jaxckpt.Checkpoint` shows of it is the public part; a `CheckpointManager` reads
    through one over its own store, and `diff`, the exports and the CLI through one of
    their own (`open_reader`).
    """

    def __init__(
        self,
        store: _orbax.OrbaxStore,
        *,
        verify: bool,
        restore_inflight_bytes: int,
        owned: bool = False,
    ):
        self._store, self._verify, self._owned = store, verify, owned
        self.budget = restore_inflight_bytes  # bytes read at once: the one owner of it
        self._warned: set[str] = set()  # the unreadable step folders logged

    @property
    def directory(self) -> epath.Path:
        return self._store.directory

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        if self._owned:
            self._store.close()

    # ---------------------------------------------------------------------------- listing

    def listing(self, *, newest: bool = False) -> _listing.Listing:
        """The directory as it is now (`_listing.Listing`); `newest`: only down to the newest
        committed step, whatever the number of steps."""
        return self._store.scan(newest=newest)

    def steps(self) -> list[int]:
        """The committed steps, oldest first: jaxckpt's and those plain Orbax wrote."""
        return list(self.listing().committed)

    def latest(self) -> int | None:
        """The newest committed step (None: none). It looks only at the step folders from
        the newest down to it; step-like folders it meets that no one can read are logged
        as warnings, each once, and where there is nothing else the warning says that a
        resume from here starts over."""
        listing = self.listing(newest=True)
        self._warn_unreadable(listing)
        return listing.latest

    def _warn_unreadable(self, listing: _listing.Listing) -> None:
        """Logs each step-like folder no one can read (damaged or foreign) that `listing`
        met, once: a resume would otherwise pass over it without a word."""
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

    # ---------------------------------------------------------------------------- one step

    def resolve(self, step: int | None) -> int:
        """`step` if committed (None: the latest committed); jaxckpt's errors otherwise."""
        listing = self.listing(newest=step is None)
        if step is None:
            self._warn_unreadable(listing)
        return listing.resolve(None if step is None else check_step(step))

    def describe(
        self, step: int | None = None, item: str | None = None
    ) -> tuple[_layout.StepInfo, str]:
        """A committed step's metadata (None: the latest) and which of its trees `item`
        names: of a jaxckpt step "state" (None) or "rng"; of a plain Orbax step one of its
        pytree items (None or "state": its only one). Reads no array."""
        step = self.resolve(step)
        try:
            return self._store.tree(step, item)
        except FileNotFoundError:
            raise self._gone(step) from None

    def is_checksummed(self, step: int) -> bool:
        """Whether the step has a manifest: jaxckpt wrote it (not plain Orbax)."""
        return not self._store.is_orbax(step)

    def folder(self, step: int) -> epath.Path:
        return self._store.step_dir(step)

    def meta(self, step: int | None = None) -> Any:
        """The `meta=` saved with a step (None: the latest committed), reading no array."""
        step = self.resolve(step)
        return None if self._store.is_orbax(step) else self.info(step).meta

    def plan(
        self, step: int | None = None, *, state: Any, partial: bool = False, item: str | None = None
    ) -> RestorePlan:
        """A restore dry-run of `state` (see `CheckpointManager.plan`)."""
        step = self.resolve(step)
        specs = self.info(step, item).state
        requests, _ = plan_restore(state, specs, item=_layout.STATE, step=step, partial=partial)
        return plan_reads(step, requests, inflight_bytes=self.budget)

    def read_arrays(
        self, info: _layout.StepInfo, item: str, requests: dict[str, ReadRequest]
    ) -> dict[str, Any]:
        """The named arrays of one item of a step, each onto its sharding (or to the host),
        at most `budget` bytes at a time. Unverified by itself: read inside
        `verified(step)`."""
        return _spread.read_arrays(self._store, info, item, requests, budget=self.budget)

    def verified(self, step: int) -> contextlib.AbstractContextManager[Callable[[], None]]:
        """A context manager in which a step is read while its files are hashed beside; it
        raises CorruptCheckpointError on leaving if they do not match (or what was read
        failed because of it). It yields `check()`, which waits for the verdict now (an
        export publishes only after it). A step plain Orbax wrote is not checked."""
        verify = self._verify and self.is_checksummed(step)
        return _integrity.verified_while_reading(
            self.directory, step, self.folder(step), verify=verify
        )

    # ---------------------------------------------------------------------------- restore

    def read(self, step: int | None, wanted: Wanted, fallback: bool) -> Restored:
        """A committed step onto the target `wanted` names (`step=None`: the latest), verified
        against its manifest; `fallback`: as `CheckpointManager.restore`'s."""
        what = "the restore of " + ("the latest step" if step is None else f"step {step}")
        with _agree.deadline(what, self._store.timeout_s):
            return self._read_tries(step, wanted, fallback)

    def _read_tries(self, step: int | None, wanted: Wanted, fallback: bool) -> Restored:
        for _ in range(3):  # the step chosen was deleted meanwhile: choose again
            try:
                return self._read_newest(step, wanted, fallback)
            except _Deleted as e:
                if step is not None:
                    raise self._gone(e.step) from e.__cause__
                log.warning("restore: step %d was deleted while it was read; again", e.step)
        raise NoCheckpointError(
            f"the latest committed step in {self.directory} was deleted three times while it "
            "was read: another job's retention keeps deleting steps. Restore a step that "
            "job keeps (step=...), or stop it first."
        )

    def _read_newest(self, step: int | None, wanted: Wanted, fallback: bool) -> Restored:
        skipped = []
        for candidate in self._candidates(step, fallback):
            try:
                with gc_paused():
                    return self._read_step(candidate, wanted)
            except Exception as e:
                after = self._after_failure(candidate, e)
                if after == _DELETED:
                    raise _Deleted(candidate) from e
                if after != _DAMAGED or not fallback or step is not None:
                    raise
                assert isinstance(e, CorruptCheckpointError)  # (`_after_failure`: on all)
                log.warning("restore: skipping step %d: %s", candidate, "; ".join(e.problems))
                skipped.append(f"step {candidate}: {'; '.join(e.problems)}")
        raise NoCheckpointError(
            f"no committed step in {self.directory} verifies: {' | '.join(skipped)}"
        )

    def _after_failure(self, step: int, error: Exception) -> str:
        """What every process does once the read of `step` failed (on each: its failures
        are agreed), decided by process 0 from what each met: read again (`_DELETED`: the
        step was deleted meanwhile, as its listing says, unless a store failed the read:
        it is not asked again), pass over it (`_DAMAGED`: every process found it corrupt),
        or raise: at once where the processes no longer agree (one is missing)."""
        if isinstance(error, ProcessesMissingError | ProcessesDisagreeError):
            return "raise"
        if store_failed(self.directory, error):
            met = "store"
        else:
            met = "corrupt" if isinstance(error, CorruptCheckpointError) else "other"
        each = _agree.gather(f"what the failed read of step {step} met", met)

        def decide() -> str:
            if "store" not in each and step not in self.steps():
                return _DELETED
            return _DAMAGED if set(each) == {"corrupt"} else "raise"

        return _agree.decided(f"what follows the failed read of step {step}", decide)

    def _candidates(self, step: int | None, fallback: bool) -> list[int]:
        """The steps to try, newest first, decided by process 0 for every process from its
        listing; damaged step folders are reported, not tried. Every process lists too: what
        each reads of a step (a folder plain Orbax named) is its own listing's."""
        listing = self.listing(newest=step is None and not fallback)

        def decide() -> str:
            if step is not None:
                return json.dumps([listing.resolve(check_step(step))])
            self._warn_unreadable(listing)
            latest = listing.resolve(None)
            log.info("restoring the latest committed step %d from %s", latest, self.directory)
            return json.dumps(sorted(listing.committed, reverse=True) if fallback else [latest])

        what = "the step" + ("s" if fallback else "") + " a restore reads"
        return [int(s) for s in json.loads(_agree.decided(what, decide))]

    def _read_step(self, step: int, wanted: Wanted) -> Restored:
        """Restores a step; verified, only if its files match the manifest.

        Each byte is read once, checked as it is read (`_integrity`); only the files a read
        does not check itself are hashed: by one process in a worker thread while it reads
        (it returns nothing, moves no data iterator, unless they match); by several a share
        each, agreed, before they read (`_spread`), then the read agreed (`_agreed`). A step
        plain Orbax wrote has no manifest: it is read as is.
        """
        data = wanted.data
        several = jax.process_count() > 1
        verify = self._verify and self.is_checksummed(step)
        if verify and several:
            self._check_share(step, unread=True)
        info = None
        if data is not None or not verify:  # before any array is read or file hashed
            info = self.info(step, wanted.item)
            check_data(info, data, wanted.mismatch_ok, self.directory)
        with _integrity.verified_while_reading(
            self.directory, step, self.folder(step), verify=verify and not several, unread=True
        ):
            info = info or self.info(step, wanted.item)
            read = functools.partial(read_trees, self._store, info, wanted, self.budget)
            restored = self._agreed(step, verify and several, read)
        if data is not None:  # last: after everything else was read (and verified)
            _iterators.restore(data, info, self.directory)
            restored = dataclasses.replace(restored, data=data)
        return restored

    def _agreed(self, step: int, verify: bool, read: Callable[[], Restored]) -> Restored:
        """`read()`, agreed by all processes (a collective): if it failed anywhere as a
        damaged file explains, the whole step is hashed, a share each (each names it)."""
        if not verify:
            return read()
        try:
            restored, failed = read(), None
        except Exception as e:
            restored, failed = None, e
        found = refusing(
            f"the read of step {step}",
            type(failed).__name__ if failed is not None and _integrity.explains(failed) else None,
        )
        if found:
            self._check_share(step)
        if failed is not None:
            raise failed
        if found:  # the step matched its manifest: another process's storage failed
            raise RestoreError(
                f"reading step {step} in {self.directory} failed on process(es) {found} "
                "(their errors say why), though its files match the manifest"
            )
        assert restored is not None
        return restored

    def _check_share(self, step: int, *, unread: bool = False) -> None:
        """Each process checks a share of the step's files (`unread`: of those a read does
        not check itself); all agree on the verdict."""
        share = (jax.process_index(), jax.process_count())
        folder = self.folder(step)
        problems = _integrity.verify_step(folder, step, share=share, unread=unread).problems
        found = refusing(f"the check of step {step}'s files", "; ".join(problems) or None)
        if found and not problems:
            problems = (f"process(es) {found} found files that do not match the manifest",)
        if problems:
            raise CorruptCheckpointError(step, problems, str(self.directory))

    def info(self, step: int, item: str | None = None) -> _layout.StepInfo:
        """A committed step's metadata, checked (CorruptCheckpointError if damaged); of a
        plain Orbax step, of its pytree item `item`. `step` as a listing gave it."""
        try:
            return self._store.info(step, item)
        except FileNotFoundError:
            raise self._gone(step) from None

    def _gone(self, step: int) -> JaxckptError:
        """A step whose metadata is missing: deleted meanwhile, or damaged."""
        if step not in self.steps():
            return StepNotFoundError(
                step,
                self.steps(),
                str(self.directory),
                why=" (it was deleted while it was read: retention in the job writing there?)",
            )
        return CorruptCheckpointError(
            step, [f"{_layout.INFO_PATH} is missing"], str(self.directory)
        )

    # ---------------------------------------------------------------------------- verify

    def verify(
        self, step: int | None = None, *, progress: _integrity.Progress | None = None
    ) -> list[_integrity.StepReport]:
        """Verifies every committed step (or one); reads, never writes.

        Also reports step folders that look like damaged jaxckpt steps: empty, or holding a
        `jaxckpt/` folder without its metadata. Folders jaxckpt did not write are not judged.
        A step plain Orbax wrote has no manifest: each of its arrays is read whole instead,
        and its report says it is not checksummed (`StepReport.checksummed`)."""
        listing = self.listing()
        reports = []
        for s in sorted({*listing.folders, *listing.committed}):
            if step is not None and s != step:
                continue
            if s in listing.orbax:
                reports.append(self._read_whole(s, listing.orbax[s], progress))
            elif s in listing.committed:
                report = _integrity.verify_step(listing.folders[s], s, progress=progress)
                if shared := _incremental.verify_shared(listing.folders[s], self._processes(s)):
                    report = dataclasses.replace(report, problems=(*report.problems, *shared))
                reports.append(report)
            elif s in listing.damaged:
                reports.append(_integrity.StepReport(s, 0, 0, (listing.damaged[s],)))
        if step is not None and not reports:
            raise StepNotFoundError(step, listing.committed, str(listing.directory))
        return reports

    def _processes(self, step: int) -> int:
        """The number of processes that saved a committed step (1 if it cannot be told:
        its verify names what is wrong)."""
        try:
            return self._store.info(step).process_count or 1
        except JaxckptError:
            return 1

    def _read_whole(
        self, step: int, found: _layout.OrbaxStep, progress: _integrity.Progress | None
    ) -> _integrity.StepReport:
        """What can be checked of a step plain Orbax wrote: each pytree item's metadata, and
        every array read whole to the host (`budget` bytes at a time), as Orbax reads it."""
        problems, leaves, total = [], 0, 0
        for item in found.items_of("pytree"):
            try:
                info = self._store.info(step, item)
            except CorruptCheckpointError as e:
                problems.extend(e.problems)
                continue
            problems.extend(
                f"item {item}: {p}" for p in _orbax_steps.missing_chunks(found.item_dir(item))
            )
            requests = uniform_requests(info.state, None)
            sizes = {s.name: s.nbytes for s in info.state}
            size, done = sum(sizes.values()), 0
            for batch in read_batches(requests, self.budget):
                try:
                    self.read_arrays(info, _layout.STATE, {n: requests[n] for n in batch})
                except JaxckptError as e:
                    problems.extend(getattr(e, "problems", None) or [f"item {item}: {e}"])
                done += sum(sizes[n] for n in batch)
                if progress is not None:
                    progress(step, done, size)
            leaves, total = leaves + len(info.state), total + size
        return _integrity.StepReport(step, leaves, total, tuple(problems), checksummed=False)


_DELETED, _DAMAGED = "deleted", "damaged"  # (`_after_failure`)


class _Deleted(Exception):
    """The step being restored was deleted meanwhile (by the writer's retention)."""

    def __init__(self, step: int):
        self.step = step

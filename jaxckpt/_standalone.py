"""A step copied so that it stands alone (`copy_step`): every file of the step as it is, and
the pieces an incremental step shares with earlier steps written into its own folder, so
that the copy restores, bitwise, where none of those steps is."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
from collections.abc import Iterator
from typing import Any

from etils import epath

from jaxckpt import _incremental, _integrity, _layout, _packed_read, _reader
from jaxckpt._damage import Damaged
from jaxckpt._escape import escape
from jaxckpt._lock import writer_lock
from jaxckpt._packed import INCREMENTAL_FORMAT
from jaxckpt._storage import absolute, is_remote, open_inside, read_small, sizes_below, write_file
from jaxckpt._store_errors import reaching
from jaxckpt._transfer import corrupt_if_not_jaxckpts
from jaxckpt.errors import ConfigError, CorruptCheckpointError, OutputExistsError

log = logging.getLogger("jaxckpt")

_CHUNK = 8 * 2**20  # of a file copied as it is
_LEASE_S = 60.0  # the writer's lease on the output, on object storage (the manager's default)


def copy_step(
    checkpoint_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    step: int | None = None,
) -> int:
    """Writes a committed step into `out_dir/<step>/`, standing alone: returns the step.

    An incremental step (the default) holds only what changed since the step before; the
    rest it reads from earlier steps' files, so `cp -r ckpt/6 elsewhere/` copies only part
    of it. This copy holds all of it: every file of the step as it is, and the pieces it
    shares with earlier steps in a file of its own, its index pointing there. Each byte is
    checked as it is copied (the files against the step's manifest, the shared pieces
    against their digests), so the copy restores bitwise what the step restores, with
    every jaxckpt reader, on any mesh. Any step jaxckpt reads is copied (formats 1-3, plain
    Orbax's: as they are, they stand alone already), local or on gs:// or s3://, either way.

    `out_dir` is a checkpoint directory of its own (created if absent; the writer's lock
    on it held meanwhile): `jaxckpt ls`, `jaxckpt.open` and a `CheckpointManager` resuming
    there find the step. Locally the step is written beside its place and renamed into it;
    on object storage its commit file is written last: a failed copy leaves no step.

    >>> import jax.numpy as jnp, tempfile, jaxckpt
    >>> directory, out = tempfile.mkdtemp(), tempfile.mkdtemp()
    >>> with jaxckpt.CheckpointManager(directory) as mngr:
    ...     for step in (1, 2):
    ...         mngr.save(step, state={"w": jnp.arange(3.0) * step, "frozen": jnp.ones(4)})
    >>> jaxckpt.copy_step(directory, out)  # step 2, with the piece it shares with step 1
    2
    >>> with jaxckpt.open(out) as copied:  # nothing of step 1 there
    ...     copied.read().state["w"].tolist()
    [0.0, 2.0, 4.0]

    Args:
      checkpoint_dir: the checkpoint directory the step is in (only read).
      out_dir: the checkpoint directory to copy it into; it must not hold that step.
      step: the step to copy; None for the latest committed one.

    Raises:
      OutputExistsError: `out_dir` holds that step already.
      IncompleteStepError: the step shares bytes with a step not in `checkpoint_dir`.
      CorruptCheckpointError: a file of the step does not match its manifest or digest.
    """
    source, out = epath.Path(absolute(checkpoint_dir)), epath.Path(absolute(out_dir))
    if out == source or source in out.parents or out in source.parents:
        raise ConfigError(
            f"the output {out} overlaps the checkpoint directory {source}; copy elsewhere"
        )
    # a store's failure named as the store's: the output's, else the checkpoint's
    with reaching(checkpoint_dir), reaching(out_dir), _reader.open_reader(checkpoint_dir) as ckpt:
        step = ckpt.resolve(step)
        folder = ckpt.folder(step)
        if folder == ckpt.directory:
            raise ConfigError(
                f"{checkpoint_dir} is itself one plain Orbax checkpoint, not a directory of "
                "steps: copy it as it is (cp -r)"
            )
        processes = (ckpt.info(step).process_count or 1) if ckpt.is_checksummed(step) else None
        with _writing(out, folder.name) as into, corrupt_if_not_jaxckpts(step, ckpt.directory):
            _Copy(folder, step, processes, into).run()
    log.info("copied step %d of %s to %s, standing alone", step, checkpoint_dir, out)
    return step


@contextlib.contextmanager
def _writing(out: epath.Path, name: str) -> Iterator[epath.Path]:
    """The folder to write the step `name` into, under `out`'s writer lock: locally one
    beside its place, renamed into it once whole; on object storage its place itself. A
    failure leaves neither."""
    if os.path.islink(out) or (out.exists() and not out.is_dir()):
        raise OutputExistsError(f"{out} is not a directory; choose another output")
    out.mkdir(parents=True, exist_ok=True)
    lock = writer_lock(out, _LEASE_S)
    if lock is not None:
        lock.acquire()
    try:
        final = out / name
        if final.exists():
            raise OutputExistsError(  # (a plain Orbax step's folder: a name anyone wrote)
                f"{escape(str(final))} exists: copy into another directory, or delete that "
                f"step first (jaxckpt rm {escape(str(out))} {escape(name)})"
            )
        into = final if is_remote(out) else out / f".{name}.jaxckpt-copy"
        if into.exists():  # a copy that died before its rename
            into.rmtree()
        try:
            yield into
            if into != final:
                into.rename(final)
        except BaseException:
            if into.exists():
                into.rmtree()
            raise
    finally:
        if lock is not None:
            lock.release()


class _Copy:
    """One step copied into `into` (`copy_step`)."""

    def __init__(self, folder: epath.Path, step: int, processes: int | None, into: epath.Path):
        """`processes`: the number that saved the jaxckpt step (None: a plain Orbax step)."""
        self.folder, self.step, self.processes, self.into = folder, step, processes, into
        self.sizes = sizes_below(folder)
        self.hashed: dict[str, tuple[int, str]] = {}  # the copy's files, as written

    def run(self) -> None:
        if unsafe := _integrity.unsafe_entries(self.folder):
            raise CorruptCheckpointError(self.step, unsafe, str(self.folder.parent))
        rewritten: dict[str, bytes] = {}
        listed: dict[str, dict[str, Any]] = {}
        checked: frozenset[str] = frozenset()
        if self.processes is not None:  # a jaxckpt step: each file checked against its manifest
            try:
                listed, checked = _integrity.read_manifest(self.folder)
            except (OSError, ValueError) as e:
                problem = f"{_layout.MANIFEST_PATH} is unreadable or missing: {e}"
                raise CorruptCheckpointError(self.step, [problem], str(self.folder.parent)) from e
            problems = [f"{rel}: missing" for rel in sorted(listed.keys() - self.sizes.keys())]
            problems += [
                f"{rel}: not in the manifest"
                for rel in sorted(self.sizes.keys() - listed.keys())
                if _integrity.in_manifest(rel)
            ]
            if problems:
                raise CorruptCheckpointError(self.step, problems, str(self.folder.parent))
            rewritten = self._own_pieces(listed)
        # Orbax's commit files last (on object storage, its commit file makes the step)
        commit = (_layout.ORBAX_STEP_METADATA, _layout.ORBAX_COMMIT_FILE)
        last = [rel for rel in commit if rel in self.sizes]
        for rel in sorted(self.sizes.keys() - rewritten.keys() - set(last)):
            if rel != _layout.MANIFEST_PATH:
                self._copy(rel, listed.get(rel))
        for rel, data in rewritten.items():
            self._write(rel, [data])
        if self.processes is not None:
            # (the files a read checks itself: listed as the step's own manifest does)
            _integrity.write_manifest(self.into, read_checked=bool(checked), hashed=self.hashed)
        for rel in last:
            self._copy(rel, None)
        if is_remote(self.into) and _layout.ORBAX_COMMIT_FILE not in last:
            text = f"Checkpoint commit was successful to {self.into}"  # (Orbax's own words)
            self._write(_layout.ORBAX_COMMIT_FILE, [text.encode()])

    def _copy(self, rel: str, expected: dict[str, Any] | None) -> None:
        """The file `rel` copied as it is; checked against its manifest entry `expected`."""
        with open_inside(self.folder, rel, size=self.sizes[rel]) as f:
            size, found = self._write(rel, iter(lambda: f.read(_CHUNK), b""))
        if expected is not None and (size, found) != (expected["size"], expected[_integrity.HASH]):
            problem = f"{rel}: contents changed (checksum mismatch)"
            raise CorruptCheckpointError(self.step, [problem], str(self.folder.parent))

    def _write(self, rel: str, chunks: Any) -> tuple[int, str]:
        *parents, name = rel.split("/")
        at = self.into.joinpath(*parents)
        at.mkdir(parents=True, exist_ok=True)
        digest = _integrity.hasher()
        self.hashed[rel] = (write_file(at, name, chunks, digest), digest.hexdigest())
        return self.hashed[rel]

    def _own_pieces(self, listed: dict[str, dict[str, Any]]) -> dict[str, bytes]:
        """The pieces an incremental step shares with earlier steps, written into a file of
        each process's (`<i>-of-<n>.<k>.bin`, past its own), in the order of their files;
        returns the step's indexes (and its shares summary) rewritten to point there."""
        assert self.processes is not None
        if not any(rel.startswith(f"{_layout.PACKED}/") for rel in listed):
            return {}  # (packs nothing: Orbax's arrays only)
        packed = _packed_read.PackedStep(self.folder / _layout.PACKED, self.processes)
        shared = [p for p in packed.pieces() if p.owner not in (None, self.step)]
        if not shared:
            return {}
        packed.check_sizes({p.source() for p in shared})
        moved: dict[tuple, tuple[str, int]] = {}  # (process, owner, file, offset): new place
        for process in sorted({p.process for p in shared}):
            file = _next_file(process, self.processes, listed)
            mine = sorted(
                {(p.owner, p.file, p.offset): p for p in shared if p.process == process}.items(),
                key=lambda kv: (kv[0][0], kv[0][1], kv[0][2]),
            )
            at = 0
            for key, piece in mine:
                moved[(process, *key)] = (file, at)
                at += piece.size
            self._write(
                f"{_layout.PACKED}/{file}", (packed.read_stored(piece) for _, piece in mine)
            )
        indexes: list[tuple[str, int | None]] = [
            (f"{_layout.PACKED}/{_layout.packed_files(p, self.processes)[1]}", p)
            for p in range(self.processes)
        ]
        indexes.append((f"{_layout.PACKED}/{_layout.PACKED_INDEX}", None))  # (several processes)
        rewritten = {
            rel: self._repointed(rel, listed[rel], process, moved)
            for rel, process in indexes
            if rel in listed
        }
        rewritten[_incremental.SHARES_PATH] = json.dumps({"steps": []}).encode()
        return rewritten

    def _repointed(
        self, rel: str, expected: dict[str, Any], process: int | None, moved: dict
    ) -> bytes:
        """The index `rel` (checked against its manifest entry `expected`) with each shared
        piece's entry pointing to its place in `moved`: `process`'s index, or (None) the
        merged index of every process's."""
        data = read_small(self.folder, rel, expected["size"])
        digest = _integrity.hasher()
        digest.update(data)
        if digest.hexdigest() != expected[_integrity.HASH]:
            raise Damaged(f"{rel}: contents changed (checksum mismatch)")
        try:
            doc = json.loads(data)
            for p, index in enumerate(doc["indexes"]) if process is None else [(process, doc)]:
                _repoint(index, p, self.step, moved)
        except (ValueError, RecursionError, KeyError, TypeError, IndexError, AttributeError):
            raise Damaged(
                f"{rel} places a piece its step's index does not, or is not an index of "
                "packed leaves"
            ) from None
        return json.dumps(doc, separators=(",", ":")).encode()


def _next_file(process: int, processes: int, listed: dict[str, Any]) -> str:
    """A data file of `process` the step does not have: past its own `<i>-of-<n>.<k>.bin`."""
    stem = _layout.packed_files(process, processes)[0].removesuffix(".bin")
    taken = [
        int(m.group(1) or 0)
        for rel in listed
        if (m := re.fullmatch(rf"{_layout.PACKED}/{re.escape(stem)}(?:\.(\d+))?\.bin", rel))
    ]
    return f"{stem}.{max(taken, default=0) + 1}.bin"


def _repoint(index: Any, process: int, step: int, moved: dict[tuple, tuple[str, int]]) -> None:
    """A process's index (format 3) with each shared piece's entry pointing to its new
    place in the step's own file: `[offset(, stored), bounds, digest, step, file]`."""
    if index is None or index["format"] != INCREMENTAL_FORMAT:
        return  # (a process that packed nothing; an index of format 1-2 shares nothing)
    for leaves in index["leaves"].values():
        for entry in leaves.values():
            for piece in entry["pieces"]:
                if len(piece) != 5 or piece[3] == step:
                    continue
                place = piece[0]
                offset = place[0] if type(place) is list else place
                file, at = moved[(process, piece[3], piece[4], offset)]
                piece[0] = [at, place[1]] if type(place) is list else at
                piece[3], piece[4] = step, file

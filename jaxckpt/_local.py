"""The host-local tier: each process's own part of a step, in its own directory (a RAM disk
or a local SSD), saved often and restored in seconds after a preemption. The one owner of
the local tier's files.

A local step is a jaxckpt step folder (format 2, every leaf packed) holding one process's
part, in the directory that process was given:

    <directory>/<step>/jaxckpt/jaxckpt.json    the step's StepInfo, as in the persistent tier
                      jaxckpt/part.json       whose part: process index and count, devices
                      jaxckpt/manifest.json   checksums of every other file
                      packed/<i>-of-<n>.bin   the process's pieces of every leaf, and their
                      packed/<i>-of-<n>.json  index (`jaxckpt._packed`)
                      data/process_<i>-of-<n>.json, data/iterator_<i>-of-<n>.json

A process writes it into `<step>.jaxckpt-tmp`, fsyncs every file, and renames it into place:
atomic per process; then its copies go to its peers in the background (`jaxckpt._peers`,
which owns `replicas/`). A step is complete when every process's part is there, its own or a
copy, which the processes agree on (a collective) before restoring it; a part whose files do
not match its manifest does not count. Each process reads only its own directory: on a pod
another process's directory is another machine's disk.

`wait()` returns once the newest local step is written and its copies are settled: every
holder answered this process's copy, and every owner whose copies it keeps put its own, or
`LocalTier.copy_timeout_s` passed (the late peers logged: the step stands on the owner's
own part). A save never waits for a copy. A directory that cannot be read holds no step
(logged): the persistent tier serves.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax

from jaxckpt import (
    _copies,
    _integrity,
    _internals,
    _layout,
    _packed,
    _packed_read,
    _peers,
    _replicas,
    _transfer,
)
from jaxckpt._storage import absolute, is_remote, read_small
from jaxckpt._tree import ReadRequest
from jaxckpt.errors import ConfigError

log = logging.getLogger("jaxckpt")

PART_PATH = f"{_layout.META_DIR}/part.json"


@dataclasses.dataclass(frozen=True)
class LocalTier:
    """The host-local tier of a `CheckpointManager` ([Local tier](local-tier.md)).

    Attributes:
      directory: this process's own host-local directory (a RAM disk or local SSD); each
        process passes its own. Created if missing.
      every_steps: save to it at every step divisible by this number.
      keep_last: the newest local steps kept (older ones are deleted after each local save).
      replicas: how many other processes keep a copy of this process's part (the next
        ones in the ring of processes that run on other machines, by host name: losing a
        host loses every directory on it), sent to them over TCP in the background once the
        part is written; a process whose directory is lost gets its part back from one of
        them at restore. 0 keeps no copies.
      address: the address peers reach this process at for those copies (None: this host's
        address towards JAX's coordinator,
        [`jax.distributed.initialize`][jax.distributed.initialize]'s).
      copy_timeout_s: how long a peer may leave a copy unanswered: a copy whose socket
        stalls this long fails (logged, naming the peer), and `wait()` / `close()` wait at
        most this long for the copies of the newest local step before they log the peers
        that did not answer and return.
    """

    directory: str | os.PathLike[str]
    every_steps: int
    keep_last: int = 2
    replicas: int = 1
    address: str | None = None
    copy_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        for name, least in (("every_steps", 1), ("keep_last", 1), ("replicas", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                kind = "a positive int" if least else "a non-negative int"
                raise ConfigError(f"LocalTier.{name} must be {kind}, got {value!r}")
        timeout = self.copy_timeout_s
        if not isinstance(timeout, int | float) or isinstance(timeout, bool) or not timeout > 0:
            raise ConfigError(
                f"LocalTier.copy_timeout_s must be a positive number of seconds, got {timeout!r}"
            )
        if self.address is not None and not isinstance(self.address, str):
            raise ConfigError(f"LocalTier.address must be a host name or IP, got {self.address!r}")
        if is_remote(self.directory):
            raise ConfigError(
                f"LocalTier.directory must be a host-local path (a RAM disk or local SSD), "
                f"got {self.directory}; object storage is the persistent tier's"
            )

    def due(self, step: int) -> bool:
        """Whether the local tier saves `step` (`every_steps`)."""
        return step % self.every_steps == 0


class WriteFailed(Exception):
    """A local save failed in the background (`cause`)."""

    def __init__(self, step: int, cause: BaseException):
        super().__init__(step, cause)
        self.step, self.cause = step, cause


@dataclasses.dataclass(frozen=True)
class Part:
    """Whose part of a step a local folder holds (its `jaxckpt/part.json`)."""

    process: int
    processes: int
    devices: tuple[int, ...]  # the global ids of that process's devices

    @classmethod
    def here(cls) -> Part:
        return cls(
            jax.process_index(), jax.process_count(), tuple(d.id for d in jax.local_devices())
        )

    def to_json(self) -> dict[str, Any]:
        return {"process": self.process, "processes": self.processes, "devices": list(self.devices)}

    @classmethod
    def from_json(cls, doc: Any) -> Part:
        if not isinstance(doc, dict):
            raise ValueError(f"{PART_PATH} is not a part's description")
        process, processes, devices = doc.get("process"), doc.get("processes"), doc.get("devices")
        if not (
            type(process) is int
            and type(processes) is int
            and 0 <= process < processes <= _layout.MAX_PROCESSES
            and isinstance(devices, list)
            and all(type(d) is int and d >= 0 for d in devices)
        ):
            raise ValueError(f"{PART_PATH} is not a part's description")
        return cls(process, processes, tuple(devices))


class LocalStore:
    """This process's local directory: local saves in a background thread of their own
    (never behind a persistent save), their listing, checks and reads. The local tier's
    `_read_interfaces.Store`."""

    shared = False  # each process reads its own part alone

    def __init__(self, tier: LocalTier, *, read_only: bool = False):
        self.tier = tier
        self.directory = Path(absolute(tier.directory))
        self._writer = concurrent.futures.ThreadPoolExecutor(1, "jaxckpt-local")
        self._pending: tuple[int, concurrent.futures.Future[None]] | None = None
        self._written: int | None = None  # the newest step written, its copies not settled
        self._newest: int | None = None  # the newest step this store wrote or restored
        if not read_only:
            try:
                self.directory.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise ConfigError(
                    f"LocalTier.directory {self.directory} cannot be made: {e.strerror or e}"
                ) from None
            # before any copy can arrive: a copy half received is a leftover too
            _replicas.sweep(self.directory)
        self._peers = self._copies = None
        if tier.replicas and jax.process_count() > 1:  # a collective: every process makes it
            self._copies = _copies.Copies(tier.copy_timeout_s)
            self._peers = _peers.Peers(
                tier.address or _internals.coordinator_route(),
                self.directory,
                check=self._check_copy,
                tried=self._copies.tried,
                keep=tier.keep_last,
                timeout_s=tier.copy_timeout_s,
            )
            self._copies.start(self._peers, tier.replicas)

    # ------------------------------------------------------------------------- saving

    def save(
        self,
        info: _layout.StepInfo,
        arrays: Mapping[str, Mapping[str, Any]],
        data: str | None,
        data_about: str | None,
    ) -> None:
        """Copies this process's shards to the host (blocking) and writes the step in the
        background, then its copies. The previous local write is waited for first (its
        error raised), never a copy."""
        self._finish_write()
        arrays = {
            item: {n: a for n, a in leaves.items() if a.size} for item, leaves in arrays.items()
        }
        pieces = _packed.to_host(arrays, _internals.device_buffers, local=True)
        packed = {item: frozenset(names) for item, names in arrays.items() if names}
        info = dataclasses.replace(info, packed=packed)
        self._pending = (
            info.step,
            self._writer.submit(self._write, info, pieces, data, data_about),
        )

    def wait(self) -> None:
        """Blocks until the local save in flight is written (its error raised, once, as
        WriteFailed), then until its copies are settled (`_copies.Copies.settle`: bounded by
        `LocalTier.copy_timeout_s`, the peers that did not answer logged)."""
        self._finish_write()
        step, self._written = self._written, None
        if step is not None and self._copies is not None:
            self._copies.settle(step)

    def _finish_write(self) -> None:
        pending, self._pending = self._pending, None
        if pending is None:
            return
        step, future = pending
        try:
            future.result()
        except Exception as e:
            raise WriteFailed(step, e) from e
        self._written = step

    def _write(
        self,
        info: _layout.StepInfo,
        pieces: _packed.HostPieces,
        data: str | None,
        data_about: str | None,
    ) -> None:
        tmp = self.directory / f"{info.step}{_replicas.TMP_SUFFIX}"
        try:
            self.write_part(tmp, info, pieces, data, data_about)
            self._commit(tmp, info.step)
        except Exception as e:
            shutil.rmtree(tmp, ignore_errors=True)
            fix = (
                ": give this process read and write access to it, or pass another "
                "LocalTier.directory"
                if isinstance(e, PermissionError)
                else ""
            )
            raise RuntimeError(
                f"writing local step {info.step} into {self.directory}: "
                f"{type(e).__name__}: {e}{fix}"
            ) from e

    def write_part(
        self,
        tmp: Path,
        info: _layout.StepInfo,
        pieces: _packed.HostPieces,
        data: str | None,
        data_about: str | None,
    ) -> None:
        """Writes this process's part of a step into the folder `tmp`, synced (`_write`
        renames it into place)."""
        part = Part.here()
        if tmp.exists():
            shutil.rmtree(tmp)
        (tmp / _layout.PACKED).mkdir(parents=True)
        (tmp / _layout.META_DIR).mkdir()
        hashed, _ = _packed.write(tmp / _layout.PACKED, pieces)
        files = {
            _layout.INFO_PATH: json.dumps(info.to_json()),
            PART_PATH: json.dumps(part.to_json()),
        }
        if data is not None:
            (tmp / _layout.DATA).mkdir()
            files[
                f"{_layout.DATA}/{_layout.data_file('process', part.process, part.processes)}"
            ] = data
            if data_about is not None:
                name = _layout.data_file("iterator", part.process, part.processes)
                files[f"{_layout.DATA}/{name}"] = data_about
        for rel, text in files.items():
            _write_synced(tmp / rel, text.encode())
        _integrity.write_manifest(tmp, hashed=hashed)
        _replicas.fsync_folder(tmp / _layout.META_DIR)
        _replicas.fsync_folder(tmp)

    def _commit(self, tmp: Path, step: int) -> None:
        # A step this number or newer is of a timeline that did not go on (the run went
        # back to an older step since): never to be restored again, nor its copies: those
        # kept from before this process started, and, when this store itself goes back,
        # every one (every process goes back with it: they all save the same steps).
        for old in self.steps():
            if old >= step:
                self.delete(old)
        went_back = self._newest is not None and step <= self._newest
        self._newest = step
        self._drop_copies(step, fresh_too=went_back)
        tmp.rename(self.directory / str(step))
        _replicas.fsync_folder(self.directory)
        for old in self.steps()[: -self.tier.keep_last]:
            self.delete(old)
        if self._copies is not None:
            self._copies.send(step)  # in the background: the step stands without its copies

    def delete(self, step: int) -> None:
        _replicas.discard(self.step_dir(step))

    def prune_after(self, step: int) -> None:
        """Deletes the local steps newer than `step`, parts and copies (a restore went back
        to it: they are of a timeline that does not go on, and copies of every process's
        part of one would make it whole again)."""
        self.wait()
        for s in self.steps():
            if s > step:
                log.info("local tier: deleting local step %d, newer than the restored %d", s, step)
                self.delete(s)
        self._drop_copies(step + 1, fresh_too=True)
        self._newest = step

    def _drop_copies(self, step: int, *, fresh_too: bool) -> None:
        """The copies of steps from `step` on go (`_peers.Peers.drop`)."""
        if self._peers is None:
            _replicas.drop_copies(self.directory, step)
            return
        self._peers.drop(step, fresh_too=fresh_too)
        if fresh_too and self._copies is not None:  # (set with the peers)
            self._copies.forget(step)

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._writer.shutdown(wait=True)
            if self._copies is not None:  # (set with the peers)
                self._copies.close()
            if self._peers is not None:
                self._peers.close()

    # ------------------------------------------------------------------------- copies

    def copies(self) -> dict[int, list[int]]:
        """The copies this process keeps: {owner: [step, ...]}, oldest first."""
        return _replicas.copies(self.directory)

    def _check_copy(self, owner: int, step: int, folder: Path) -> None:
        """A copy received (in a listener thread), before it is put in place: PeerError
        unless it is whole and `owner`'s part of `step`."""
        report = _integrity.verify_step(folder, step)
        if report.problems:
            raise _peers.PeerError(f"the copy does not match its manifest: {report.problems}")
        part = Part.from_json(json.loads(read_small(folder, PART_PATH)))
        if part.process != owner:
            raise _peers.PeerError(f"the copy is process {part.process}'s, not {owner}'s")

    def fetch(self, step: int, peer: int) -> str | None:
        """This process's own part of `step`, fetched from the copy `peer` keeps, in place
        of a missing or damaged one; why not, if it could not be (None: done)."""
        if self._peers is None:
            return "no copies are kept (LocalTier.replicas=0, or one process)"
        me = jax.process_index()
        tmp = self.directory / f"{step}{_replicas.TMP_SUFFIX}"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            self._peers.get(peer, me, step, tmp.name)
            report = _integrity.verify_step(tmp, step)
            if report.problems:
                raise _peers.PeerError(f"it does not match its manifest: {report.problems}")
            if Part.from_json(json.loads(read_small(tmp, PART_PATH))) != Part.here():
                raise _peers.PeerError("it is not this process's part, on these devices")
            folder = self.step_dir(step)
            if folder.exists():
                self.delete(step)
            tmp.rename(folder)
            _replicas.fsync_folder(self.directory)
        except (_peers.PeerError, OSError) as e:
            shutil.rmtree(tmp, ignore_errors=True)
            return f"fetching step {step} from process {peer}'s copy failed: {e}"
        log.warning("local tier: step %d fetched from process %d's copy", step, peer)
        return None

    # ------------------------------------------------------------------------- reading

    def steps(self) -> list[int]:
        """The committed local steps of this process, oldest first (not checked yet); none
        in a directory this process cannot read (logged: the persistent tier serves)."""
        try:
            with os.scandir(self.directory) as entries:
                found = [
                    _layout.step_of(e.name) for e in entries if e.is_dir(follow_symlinks=False)
                ]
        except FileNotFoundError:
            return []
        except OSError as e:
            log.warning(
                "local tier: %s cannot be read (%s): its steps are passed over, the persistent "
                "tier serves. Give this process read and write access to it, or pass another "
                "LocalTier.directory",
                self.directory,
                e.strerror or e,
            )
            return []
        return sorted(s for s in found if s is not None)

    def step_dir(self, step: int) -> Path:
        return self.directory / str(step)

    def own_problem(self, step: int) -> str | None:
        """Why this process's own part of `step` is not here whole (None: it is): missing,
        another process's or topology's, or not matching its manifest. A copy from a peer
        can stand in for it."""
        folder = self.step_dir(step)
        if not folder.is_dir() or folder.is_symlink():
            return f"no local step {step} in {self.directory}"
        try:
            part = Part.from_json(json.loads(read_small(folder, PART_PATH)))
        except FileNotFoundError:
            return f"{folder}: {PART_PATH} is missing"
        except (OSError, ValueError, RecursionError) as e:
            return f"{folder}: {PART_PATH} is unreadable: {e}"
        here = Part.here()
        if part != here:
            return (
                f"{folder} holds the part of process {part.process} of {part.processes} "
                f"(devices {list(part.devices)}); this is process {here.process} of "
                f"{here.processes} (devices {list(here.devices)})"
            )
        report = _integrity.verify_step(folder, step)
        if report.problems:
            return f"{folder} does not match its manifest: {'; '.join(report.problems)}"
        return None

    def info(self, step: int) -> _layout.StepInfo:
        return _layout.read_info(self.directory, step)

    def layout(self, info: _layout.StepInfo) -> _transfer.PackedLayout:
        """A local step is this process's packed leaves alone (checked with `holds`)."""
        return _transfer.PackedLayout(self._part(info), info.step, self.directory)

    def read_arrays(
        self, info: _layout.StepInfo, item: str, batch: Mapping[str, ReadRequest]
    ) -> dict[str, Any]:
        """The arrays `batch` names of one item of a local step, each onto its sharding,
        from this process's part alone: one batch, as given."""
        return self.layout(info).read(item, batch)

    def holds(
        self, info: _layout.StepInfo, item: str, requests: Mapping[str, ReadRequest]
    ) -> str | None:
        """Why this process's part cannot fill `requests` (None: it can), reading no array."""
        try:
            return self._part(info).holds(item, requests)
        except ValueError as e:
            return str(e)

    def _part(self, info: _layout.StepInfo) -> _packed_read.PackedStep:
        folder = self.step_dir(info.step) / _layout.PACKED
        return _packed_read.PackedStep(folder, jax.process_count(), parts=(jax.process_index(),))


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())

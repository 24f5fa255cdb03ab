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
atomic per process. A step is complete when every process's part is there, which the
processes agree on (a collective) before restoring it; a part whose files do not match its
manifest does not count. Each process reads only its own directory: on a pod another
process's directory is another machine's disk.
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
import numpy as np
from jax.experimental import multihost_utils

from jaxckpt import _integrity, _layout, _orbax, _packed, _peers
from jaxckpt._storage import absolute, is_remote, open_inside
from jaxckpt._tree import ReadRequest
from jaxckpt.errors import ConfigError

log = logging.getLogger("jaxckpt")

PART_PATH = f"{_layout.META_DIR}/part.json"
TMP_SUFFIX = _peers.TMP_SUFFIX  # a folder being written (a part, or a copy received)
_AGREED_STEPS = 32  # the newest local steps each process reports when they agree
_HELD = 128  # the most (step, owner) pairs of parts and copies a process reports


@dataclasses.dataclass(frozen=True)
class LocalTier:
    """The host-local tier of a `CheckpointManager` (README, "Local tier").

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
      address: the address peers reach this process at for those copies (None: this
        host's address towards JAX's coordinator, `jax.distributed`'s).
    """

    directory: str | os.PathLike
    every_steps: int
    keep_last: int = 2
    replicas: int = 1
    address: str | None = None

    def __post_init__(self) -> None:
        for name, least in (("every_steps", 1), ("keep_last", 1), ("replicas", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                kind = "a positive int" if least else "a non-negative int"
                raise ConfigError(f"LocalTier.{name} must be {kind}, got {value!r}")
        if self.address is not None and not isinstance(self.address, str):
            raise ConfigError(f"LocalTier.address must be a host name or IP, got {self.address!r}")
        if is_remote(self.directory):
            raise ConfigError(
                f"LocalTier.directory must be a host-local path (a RAM disk or local SSD), "
                f"got {self.directory}; object storage is the persistent tier's"
            )

    def due(self, step: int) -> bool:
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
        fields = (doc.get("process"), doc.get("processes")) if isinstance(doc, dict) else ()
        devices = doc.get("devices") if isinstance(doc, dict) else None
        ok = (
            len(fields) == 2
            and all(type(v) is int and v >= 0 for v in fields)
            and fields[0] < fields[1] <= _layout.MAX_PROCESSES
            and isinstance(devices, list)
            and all(type(d) is int and d >= 0 for d in devices)
        )
        if not ok:
            raise ValueError(f"{PART_PATH} is not a part's description")
        return cls(fields[0], fields[1], tuple(devices))


class LocalStore:
    """This process's local directory: local saves in a background thread of their own
    (never behind a persistent save), their listing, checks and reads."""

    def __init__(self, tier: LocalTier, *, read_only: bool = False):
        self.tier = tier
        self.directory = Path(absolute(tier.directory))
        self._writer = concurrent.futures.ThreadPoolExecutor(1, "jaxckpt-local")
        self._pending: tuple[int, concurrent.futures.Future] | None = None
        if not read_only:
            try:
                self.directory.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise ConfigError(
                    f"LocalTier.directory {self.directory} cannot be made: {e.strerror or e}"
                ) from None
            # a save killed mid-write, a deletion that never finished, a copy half received
            leftovers = [
                p
                for pattern in ("*", f"{_peers.REPLICAS}/*/*")
                for suffix in (TMP_SUFFIX, _layout.DELETING_SUFFIX)
                for p in self.directory.glob(pattern + suffix)
            ]
            for p in leftovers:
                self._writer.submit(shutil.rmtree, p, True)
        self._peers = None
        if tier.replicas and jax.process_count() > 1:  # a collective: every process makes it
            self._peers = _peers.Peers(
                tier.address or _orbax.coordinator_route(),
                serve=self._servable,
                receive=self.replica_dir,
                accept=self._accept_copy,
            )

    # ------------------------------------------------------------------------- saving

    def save(
        self,
        info: _layout.StepInfo,
        arrays: Mapping[str, Mapping[str, Any]],
        data: str | None,
        data_about: str | None,
    ) -> None:
        """Copies this process's shards to the host (blocking) and writes the step in the
        background. The previous local save is waited for first (its error raised)."""
        self.wait()
        arrays = {
            item: {n: a for n, a in leaves.items() if a.size} for item, leaves in arrays.items()
        }
        pieces = _packed.to_host(arrays, _orbax.device_buffers, local=True)
        packed = {item: frozenset(names) for item, names in arrays.items() if names}
        info = dataclasses.replace(info, packed=packed)
        self._pending = (
            info.step,
            self._writer.submit(self._write, info, pieces, data, data_about),
        )

    def wait(self) -> None:
        """Blocks until the local save in flight is written; raises its error (WriteFailed),
        once."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        step, future = pending
        try:
            future.result()
        except Exception as e:
            raise WriteFailed(step, e) from e

    def _write(self, info, pieces, data, data_about) -> None:
        tmp = self.directory / f"{info.step}{TMP_SUFFIX}"
        try:
            self._write_step(tmp, info, pieces, data, data_about)
        except Exception as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise RuntimeError(
                f"writing local step {info.step} into {self.directory}: {type(e).__name__}: {e}"
            ) from e

    def _write_step(self, tmp: Path, info, pieces, data, data_about) -> None:
        step, part = info.step, Part.here()
        if tmp.exists():
            shutil.rmtree(tmp)
        (tmp / _layout.PACKED).mkdir(parents=True)
        (tmp / _layout.META_DIR).mkdir()
        _packed.write(tmp / _layout.PACKED, pieces)
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
        _integrity.write_manifest(tmp)
        _fsync_dir(tmp / _layout.META_DIR)
        _fsync_dir(tmp)
        # A step this number or newer is of a timeline that did not go on (the run went
        # back to an older step since): never to be restored again.
        for old in self.steps():
            if old >= step:
                self._delete(old)
        tmp.rename(self.directory / str(step))
        _fsync_dir(self.directory)
        for old in self.steps()[: -self.tier.keep_last]:
            self._delete(old)
        if self._peers is not None:
            machines = [a[3] for a in self._peers.addresses]
            for peer in _peers.holders(part.process, machines, self.tier.replicas):
                try:
                    self._peers.put(peer, part.process, step, self.step_dir(step))
                except (_peers.PeerError, OSError) as e:  # the step still stands without it
                    log.warning("local tier: no copy of step %d at process %d: %s", step, peer, e)

    def _delete(self, step: int) -> None:
        _discard(self.step_dir(step))

    def prune_after(self, step: int) -> None:
        """Deletes the local steps newer than `step`, parts and copies (a restore went back
        to it: they are of a timeline that does not go on, and copies of every process's
        part of one would make it whole again)."""
        self.wait()
        doomed = [self.step_dir(s) for s in self.steps() if s > step]
        for owner, steps in self.copies().items():
            doomed += [self.replica_dir(owner, s) for s in steps if s > step]
        for folder in doomed:
            log.info("local tier: deleting %s, newer than the restored step %d", folder, step)
            _discard(folder)

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._writer.shutdown(wait=True)
            if self._peers is not None:
                self._peers.close()

    # ------------------------------------------------------------------------- copies

    def replica_dir(self, owner: int, step: int) -> Path:
        """Where this process keeps its copy of `owner`'s part of `step`."""
        return self.directory / _peers.REPLICAS / str(owner) / str(step)

    def copies(self) -> dict[int, list[int]]:
        """The copies this process keeps: {owner: [step, ...]}, oldest first."""
        found: dict[int, list[int]] = {}
        root = self.directory / _peers.REPLICAS
        if not root.is_dir() or root.is_symlink():
            return found
        for owner_dir in root.iterdir():
            owner = _layout.step_of(owner_dir.name)
            if owner is None or owner_dir.is_symlink() or not owner_dir.is_dir():
                continue
            steps = [_layout.step_of(p.name) for p in owner_dir.iterdir() if not p.is_symlink()]
            found[owner] = sorted(s for s in steps if s is not None)
        return found

    def _servable(self, owner: int, step: int) -> Path | None:
        """A part this process may send: its own, or a copy it keeps."""
        own = jax.process_index() == owner and self.step_dir(step).is_dir()
        folder = self.step_dir(step) if own else self.replica_dir(owner, step)
        return folder if folder.is_dir() and not folder.is_symlink() else None

    def _accept_copy(self, owner: int, step: int, tmp: Path) -> None:
        """A copy received (in the listener's thread): checked, then renamed into place;
        the owner's copies of newer steps (another timeline) and beyond keep_last go."""
        report = _integrity.verify_step(tmp, step)
        if report.problems:
            raise _peers.PeerError(f"the copy does not match its manifest: {report.problems}")
        with open_inside(tmp, PART_PATH) as f:
            part = Part.from_json(json.loads(f.read()))
        if part.process != owner:
            raise _peers.PeerError(f"the copy is process {part.process}'s, not {owner}'s")
        final = self.replica_dir(owner, step)
        for old in self.copies().get(owner, []):
            if old >= step:
                _discard(self.replica_dir(owner, old))
        tmp.rename(final)
        _fsync_dir(final.parent)
        for old in self.copies().get(owner, [])[: -self.tier.keep_last]:
            _discard(self.replica_dir(owner, old))

    def fetch(self, step: int, peer: int) -> str | None:
        """This process's own part of `step`, fetched from the copy `peer` keeps, in place
        of a missing or damaged one; why not, if it could not be (None: done)."""
        if self._peers is None:
            return "no copies are kept (LocalTier.replicas=0, or one process)"
        me = jax.process_index()
        tmp = self.directory / f"{step}{TMP_SUFFIX}"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            self._peers.get(peer, me, step, tmp)
            report = _integrity.verify_step(tmp, step)
            if report.problems:
                raise _peers.PeerError(f"it does not match its manifest: {report.problems}")
            with open_inside(tmp, PART_PATH) as f:
                if Part.from_json(json.loads(f.read())) != Part.here():
                    raise _peers.PeerError("it is not this process's part, on these devices")
            folder = self.step_dir(step)
            if folder.exists():
                self._delete(step)
            tmp.rename(folder)
            _fsync_dir(self.directory)
        except (_peers.PeerError, OSError) as e:
            shutil.rmtree(tmp, ignore_errors=True)
            return f"fetching step {step} from process {peer}'s copy failed: {e}"
        log.warning("local tier: step %d fetched from process %d's copy", step, peer)
        return None

    # ------------------------------------------------------------------------- reading

    def steps(self) -> list[int]:
        """The committed local steps of this process, oldest first (not checked yet)."""
        if not self.directory.is_dir():
            return []
        found = []
        for p in self.directory.iterdir():
            step = _layout.step_of(p.name)
            if step is not None and not p.is_symlink() and p.is_dir():
                found.append(step)
        return sorted(found)

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
            with open_inside(folder, PART_PATH) as f:
                part = Part.from_json(json.loads(f.read()))
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

    def read_arrays(
        self, info: _layout.StepInfo, item: str, requests: Mapping[str, ReadRequest], budget: int
    ) -> dict[str, Any]:
        """The named arrays of one item of a local step, each onto its sharding, from this
        process's part alone (checked beforehand with `holds`)."""
        return _orbax.read_packed(self._part(info), info, item, requests, budget, self.directory)

    def holds(
        self, info: _layout.StepInfo, item: str, requests: Mapping[str, ReadRequest]
    ) -> str | None:
        """Why this process's part cannot fill `requests` (None: it can), reading no array."""
        try:
            return self._part(info).holds(item, requests)
        except ValueError as e:
            return str(e)

    def _part(self, info: _layout.StepInfo) -> _packed.PackedStep:
        folder = self.step_dir(info.step) / _layout.PACKED
        return _packed.PackedStep(folder, jax.process_count(), parts=(jax.process_index(),))


def _discard(folder: Path) -> None:
    """Removes a part or a copy: renamed out of every listing first (a removal cut short
    leaves a `.jaxckpt-deleting` folder, swept at the next start), then deleted."""
    doomed = folder.with_name(folder.name + _layout.DELETING_SUFFIX)
    folder.rename(doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --- agreement between processes (collectives: every process calls these in turn) ---------


def holdings(store: LocalStore) -> dict[int, dict[int, list[int]]]:
    """Every process's local parts and copies, {step: {owner: [holders]}}, of the newest
    steps each reports (a collective)."""
    me = jax.process_index()
    mine = [(s, me) for s in store.steps()[-_AGREED_STEPS:]]
    for owner, steps in store.copies().items():
        mine += [(s, owner) for s in steps[-_AGREED_STEPS:]]
    mine = sorted(mine, reverse=True)[:_HELD]
    padded = np.full((_HELD, 2), -1, np.int64)
    if mine:
        padded[: len(mine)] = mine
    if jax.process_count() == 1:
        every = padded[None]
    else:
        gathered = multihost_utils.process_allgather(padded)
        every = np.asarray(gathered).reshape(-1, _HELD, 2)
    found: dict[int, dict[int, list[int]]] = {}
    for holder, rows in enumerate(every):
        for step, owner in rows:
            if step >= 0:
                found.setdefault(int(step), {}).setdefault(int(owner), []).append(holder)
    return found


def complete_steps(held: dict[int, dict[int, list[int]]]) -> list[int]:
    """The steps of which every process's part is somewhere, oldest first."""
    owners = set(range(jax.process_count()))
    return sorted(s for s, parts in held.items() if owners <= set(parts))


def refusing(problem: str | None) -> list[int]:
    """The processes that found a problem (this one's given), agreed by all."""
    if jax.process_count() == 1:
        return [] if problem is None else [0]
    flags = multihost_utils.process_allgather(np.int32(problem is not None))
    return [i for i, f in enumerate(np.ravel(flags)) if f]

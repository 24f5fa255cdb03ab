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

from jaxckpt import _integrity, _layout, _orbax, _packed
from jaxckpt._storage import absolute, is_remote, open_inside
from jaxckpt._tree import ReadRequest
from jaxckpt.errors import ConfigError

log = logging.getLogger("jaxckpt")

PART_PATH = f"{_layout.META_DIR}/part.json"
TMP_SUFFIX = ".jaxckpt-tmp"
_AGREED_STEPS = 32  # the newest local steps each process reports when they agree


@dataclasses.dataclass(frozen=True)
class LocalTier:
    """The host-local tier of a `CheckpointManager` (README, "Local tier").

    Attributes:
      directory: this process's own host-local directory (a RAM disk or local SSD); each
        process passes its own. Created if missing.
      every_steps: save to it at every step divisible by this number.
      keep_last: the newest local steps kept (older ones are deleted after each local save).
    """

    directory: str | os.PathLike
    every_steps: int
    keep_last: int = 2

    def __post_init__(self) -> None:
        for name in ("every_steps", "keep_last"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"LocalTier.{name} must be a positive int, got {value!r}")
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
        self._read_only = read_only
        self._writer = concurrent.futures.ThreadPoolExecutor(1, "jaxckpt-local")
        self._pending: tuple[int, concurrent.futures.Future] | None = None
        if not read_only:
            self.directory.mkdir(parents=True, exist_ok=True)
            # a save killed mid-write, a deletion that never finished
            leftovers = [p for p in self.directory.iterdir() if p.name.endswith(TMP_SUFFIX)]
            leftovers += self.directory.glob(f"*{_layout.DELETING_SUFFIX}")
            for p in leftovers:
                self._writer.submit(shutil.rmtree, p, True)

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

    def _delete(self, step: int) -> None:
        doomed = self.directory / f"{step}{_layout.DELETING_SUFFIX}"
        (self.directory / str(step)).rename(doomed)
        shutil.rmtree(doomed, ignore_errors=True)

    def prune_after(self, step: int) -> None:
        """Deletes the local steps newer than `step` (a restore went back to it: they are of
        a timeline that does not go on)."""
        self.wait()
        for old in self.steps():
            if old > step:
                log.info(
                    "local tier: deleting step %d of %s, newer than the restored %d",
                    old,
                    self.directory,
                    step,
                )
                self._delete(old)

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._writer.shutdown(wait=True)

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

    def problem(self, step: int) -> str | None:
        """Why this process's part of `step` cannot be used here (None: it can): missing,
        another process's or topology's, or not matching its manifest."""
        folder = self.step_dir(step)
        if not folder.is_dir():
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


def common_steps(steps: list[int]) -> list[int]:
    """Of each process's newest local steps, those every process has, oldest first."""
    mine = sorted(steps)[-_AGREED_STEPS:]
    if jax.process_count() == 1:
        return mine
    padded = np.full(_AGREED_STEPS, -1, np.int64)
    padded[: len(mine)] = mine
    every = np.asarray(multihost_utils.process_allgather(padded)).reshape(-1, _AGREED_STEPS)
    common = set(mine)
    for row in every:
        common &= {int(s) for s in row if s >= 0}
    return sorted(common)


def refusing(problem: str | None) -> list[int]:
    """The processes that found a problem (this one's given), agreed by all."""
    if jax.process_count() == 1:
        return [] if problem is None else [0]
    flags = multihost_utils.process_allgather(np.int32(problem is not None))
    return [i for i, f in enumerate(np.ravel(flags)) if f]

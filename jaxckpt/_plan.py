"""Restore dry-run: what each process will read and hold, before a single byte is read.

Computed from the checkpoint's leaf specs and the target's shardings alone: for every
process, the distinct slices its devices need (a slice replicated on several of its devices
is read once), the device memory those slices fill, and an estimate of its peak host memory.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping
from typing import Protocol

import jax

from jaxckpt import _memory
from jaxckpt._tree import ReadRequest

ProcessOf = Callable[[jax.Device], int]


class _Device(Protocol):
    """What a plan reads of a `jax.Device`. Its class is jaxlib's C++ one, which ships no
    stubs: mypy sees none of its attributes."""

    @property
    def id(self) -> int: ...

    @property
    def process_index(self) -> int: ...


@dataclasses.dataclass(frozen=True)
class ProcessPlan:
    """One process's share of a restore.

    Attributes:
      process: the process index.
      read_bytes: bytes of array data this process reads from storage.
      device_bytes: bytes its devices hold afterwards (replicas counted on each device).
      peak_host_bytes: a bound on the peak host memory of the restore above what the
        process held before: on CPU devices (whose memory is host memory) the restored
        arrays themselves, plus 1.25x the largest batch read at once (at most
        `restore_inflight_bytes`, or one larger leaf), plus RESTORE_FIXED_BYTES. Restores of
        64 MiB to 1.5 GiB on 8 CPU devices stayed below it with any budget
        (benchmarks/restore_memory.py).
    """

    process: int
    read_bytes: int
    device_bytes: int
    peak_host_bytes: int


@dataclasses.dataclass(frozen=True)
class RestorePlan:
    """What `CheckpointManager.plan` reports."""

    step: int
    leaves: int
    saved_bytes: int  # the bytes of all leaves in the target, as stored
    processes: tuple[ProcessPlan, ...]

    def __str__(self) -> str:
        rows = [
            f"restore plan for step {self.step}: {self.leaves} leaves, {size_text(self.saved_bytes)}",
            f"  {'process':>7}  {'reads':>10}  {'on devices':>10}  {'peak host (est.)':>16}",
        ]
        rows += (
            f"  {p.process:>7}  {size_text(p.read_bytes):>10}  {size_text(p.device_bytes):>10}"
            f"  {size_text(p.peak_host_bytes):>16}"
            for p in self.processes
        )
        return "\n".join(rows)


def plan_reads(
    step: int,
    requests: Mapping[str, ReadRequest],
    *,
    inflight_bytes: int,
    processes: int | None = None,
    devices_on_host: bool | None = None,
) -> RestorePlan:
    """The per-process plan for reading `requests` (as built by `tree.plan_restore`).

    `processes=n` plans for a job of n processes holding the mesh's devices in equal
    consecutive groups by device id (what `jaxckpt plan --hosts` shows from one machine);
    None: this job's processes. `devices_on_host`: whether the devices' memory is host
    memory (None: true on CPU devices).
    """
    process_of = None
    if processes is not None:
        devices: set[_Device] = {
            d for r in requests.values() if r.sharding for d in r.sharding.device_set
        }
        ids = sorted({d.id for d in devices})
        rank = {device_id: i * processes // len(ids) for i, device_id in enumerate(ids)}
        process_of = lambda device: rank[device.id]  # noqa: E731
    hosts = range(processes or jax.process_count())
    read = dict.fromkeys(hosts, 0)
    held = dict.fromkeys(hosts, 0)
    batch_peak = dict.fromkeys(hosts, 0)
    for batch in read_batches(requests, inflight_bytes, process_of):
        in_batch = dict.fromkeys(hosts, 0)
        for name in batch:
            request = requests[name]
            per_process = process_bytes(request, process_of)
            if request.sharding is None:  # on the host: every process reads it whole
                per_process = dict.fromkeys(hosts, per_process[0])
            for p, (nread, nheld) in per_process.items():
                read[p] += nread
                held[p] += nheld
                in_batch[p] += nread
        for p in hosts:
            batch_peak[p] = max(batch_peak[p], in_batch[p])
    on_cpu = _memory.devices_on_host() if devices_on_host is None else devices_on_host
    plans = tuple(
        ProcessPlan(p, read[p], held[p], peak_host_bytes(batch_peak[p], held[p], on_cpu))
        for p in hosts
    )
    total = sum(math.prod(r.shape) * r.dtype.itemsize for r in requests.values())
    return RestorePlan(step=step, leaves=len(requests), saved_bytes=total, processes=plans)


# What a restore of any size costs a process beyond its staging: thread pools,
# tensorstore's context and caches, the placing functions compiled.
RESTORE_FIXED_BYTES = 32 * 2**20


def peak_host_bytes(batch: int, held: int, devices_on_host: bool) -> int:
    """A bound on a process's peak host memory above its baseline while it restores, at
    most `batch` bytes read at once, onto devices that hold `held` bytes.

    Each slice is read into a host buffer, copied onto its device and the buffer freed and
    handed back to the system (`_memory.returning_freed`): the staging of one batch at a
    time, 1.25x it for the allocator's rounding, and a fixed cost. On CPU devices the
    restored arrays are host memory too (`held`).
    """
    staging = batch * 5 // 4 + RESTORE_FIXED_BYTES if batch else 0
    return (held if devices_on_host else 0) + staging


def read_batches(
    requests: Mapping[str, ReadRequest], budget: int, process_of: ProcessOf | None = None
) -> list[list[str]]:
    """The request names in consecutive batches that each read at most `budget` bytes on
    any process (a larger leaf makes a batch alone). A restore reads one batch at a time,
    which bounds its staging memory; the batches are the same on every process, since
    every batch is a collective read."""
    batches: list[list[str]] = []
    size = budget + 1
    for name, request in requests.items():
        nbytes = max(nread for nread, _ in process_bytes(request, process_of).values())
        if size + nbytes > budget:
            batches.append([])
            size = 0
        batches[-1].append(name)
        size += nbytes
    return batches


def process_bytes(
    request: ReadRequest, process_of: ProcessOf | None = None
) -> dict[int, tuple[int, int]]:
    """For each process: (bytes it reads, bytes its devices hold) of one request.

    A slice replicated on several devices of one process is read once. A host (NumPy)
    request is read whole by every process and held by no device. `process_of(device)`
    overrides `device.process_index`.
    """
    itemsize = request.dtype.itemsize
    if request.sharding is None:
        size = math.prod(request.shape) * itemsize
        return {p: (size, 0) for p in range(jax.process_count())}
    if process_of is None:  # a state repeats a few shardings and shapes over its leaves
        return dict(_sharded_bytes(request.sharding, tuple(request.shape), itemsize))
    return _sharded_bytes.__wrapped__(request.sharding, request.shape, itemsize, process_of)


@functools.lru_cache(maxsize=1024)
def _sharded_bytes(
    sharding: jax.sharding.Sharding,
    shape: tuple[int, ...],
    itemsize: int,
    process_of: ProcessOf | None = None,
) -> dict[int, tuple[int, int]]:
    # per process: the bytes of each distinct slice, keyed by its (start, stop) per dimension
    distinct: dict[int, dict[tuple[tuple[int | None, int | None], ...], int]] = {}
    held: dict[int, int] = {}
    device: _Device
    for device, index in sharding.devices_indices_map(shape).items():
        p = device.process_index if process_of is None else process_of(device)
        nbytes = itemsize * math.prod(
            len(range(*s.indices(n))) for s, n in zip(index, shape, strict=True)
        )
        distinct.setdefault(p, {})[tuple((s.start, s.stop) for s in index)] = nbytes
        held[p] = held.get(p, 0) + nbytes
    return {p: (sum(slices.values()), held[p]) for p, slices in distinct.items()}


@functools.lru_cache(maxsize=1024)
def holders(
    sharding: jax.sharding.Sharding, shape: tuple[int, ...]
) -> dict[tuple[tuple[int, int], ...], tuple[int, ...]]:
    """Each distinct shard of an array of `shape` on `sharding`, by its bounds ((start,
    stop) per dimension), with the processes holding it, in order."""
    found: dict[tuple[tuple[int, int], ...], set[int]] = {}
    device: _Device
    for device, index in sharding.devices_indices_map(shape).items():
        bounds = tuple(s.indices(n)[:2] for s, n in zip(index, shape, strict=True))
        found.setdefault(bounds, set()).add(device.process_index)
    return {b: tuple(sorted(p)) for b, p in sorted(found.items())}


def size_text(n: float) -> str:
    """Bytes as `jaxckpt plan`, `ls` and `inspect` print them: 512 B, 1.50 KiB, ..."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"

"""Restore dry-run: what each process will read and hold, before a single byte is read.

Computed from the checkpoint's leaf specs and the target's shardings alone: for every
process, the distinct slices its devices need (a slice replicated on several of its devices
is read once), the device memory those slices fill, and an estimate of its peak host memory.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import jax
import numpy as np

from jaxckpt.tree import ReadRequest


@dataclasses.dataclass(frozen=True)
class ProcessPlan:
    """One process's share of a restore.

    Attributes:
      process: the process index.
      read_bytes: bytes of array data this process reads from storage.
      device_bytes: bytes its devices hold afterwards (replicas counted on each device).
      peak_host_bytes: estimated peak host memory of the restore above what the process held
        before: the staging of reads in flight (a decode buffer and a device copy for at most
        `restore_inflight_bytes` at once), plus, on CPU devices (whose memory is host
        memory), the restored arrays themselves.
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
            f"restore plan for step {self.step}: {self.leaves} leaves, {_size(self.saved_bytes)}"
        ]
        rows.append(
            f"  {'process':>7}  {'reads':>10}  {'on devices':>10}  {'peak host (est.)':>16}"
        )
        for p in self.processes:
            rows.append(
                f"  {p.process:>7}  {_size(p.read_bytes):>10}  {_size(p.device_bytes):>10}"
                f"  {_size(p.peak_host_bytes):>16}"
            )
        return "\n".join(rows)


def plan_reads(
    step: int, requests: Mapping[str, ReadRequest], *, inflight_bytes: int
) -> RestorePlan:
    """The per-process plan for reading `requests` (as built by `tree.plan_restore`)."""
    processes = range(jax.process_count())
    read = dict.fromkeys(processes, 0)
    held = dict.fromkeys(processes, 0)
    total = 0
    for request in requests.values():
        itemsize = np.dtype(request.dtype).itemsize
        size = math.prod(request.shape) * itemsize
        total += size
        if request.sharding is None:  # NumPy on the host: every process reads it all
            for p in processes:
                read[p] += size
            continue
        distinct: dict[int, set] = {p: set() for p in processes}
        for device, index in request.sharding.devices_indices_map(request.shape).items():
            nbytes = _slice_bytes(index, request.shape) * itemsize
            held[device.process_index] += nbytes
            key = tuple((s.start, s.stop) for s in index)
            if key not in distinct[device.process_index]:
                distinct[device.process_index].add(key)
                read[device.process_index] += nbytes
    on_cpu = jax.devices()[0].platform == "cpu"
    plans = tuple(
        ProcessPlan(
            p, read[p], held[p], 2 * min(read[p], inflight_bytes) + (held[p] if on_cpu else 0)
        )
        for p in processes
    )
    return RestorePlan(step=step, leaves=len(requests), saved_bytes=total, processes=plans)


def _slice_bytes(index: tuple[slice, ...], shape: tuple[int, ...]) -> int:
    return math.prod(len(range(*s.indices(n))) for s, n in zip(index, shape, strict=True))


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")

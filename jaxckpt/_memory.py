"""The host memory a restore holds: its budget, and the staging it hands back.

A restore reads each slice into a host buffer and places it on its device. On CPU devices
the buffer is the device's array itself (`_host_buffers.host_buffer`, pages of its own), and
what is staged is tensorstore's: each chunk's bytes as read, freed once copied. Under
glibc's default rule (its mmap threshold rises to the largest block freed, up to 32 MiB)
the heap kept that freed staging between the arrays, and a restore of 1.5 GiB onto 8 CPU
devices peaked at 1.7-1.9x the state, 1.5x staying held after it
(benchmarks/restore_memory.py). Inside `returning_freed()` every block of `MAPPED_BYTES` or
more is mapped pages of its own, unmapped the moment it is freed: the same restore peaks at
1.02x, and holds 1.00x after. On accelerators the heap reuses the staging batch after batch
(the budget bounds it), and what it holds at the end is handed back (`malloc_trim`). On
leaving, the threshold is set where glibc's own rule takes it in a process that has freed
a large block (`HEAP_BYTES`).

Without glibc (musl, macOS, or tcmalloc preloaded, which ignores `mallopt`) this does
nothing, and the budget alone bounds the staging.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import logging
import os
import threading
from collections.abc import Iterator

import jax

from jaxckpt import _agree

log = logging.getLogger("jaxckpt")

# The bytes a restore reads at once per process by default (`restore_inflight_bytes=None`),
# or a quarter of the host's memory where that is less. From local disk, restores of 64 MiB
# to 1.5 GiB on 8 CPU devices took the same time with any budget from 64 MiB to all at once;
# from gs:// (fake-gcs-server), what is in flight is what a restore holds above the state:
# 512 MiB peaked at 1.23x with 256 MiB (0.78 s), 1.10x with 64 MiB (0.90 s).
DEFAULT_INFLIGHT_BYTES = 128 * 2**20
MAPPED_BYTES = 2**20  # from this size a block is mapped pages of its own, inside
HEAP_BYTES = 32 * 2**20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit hosts
_M_MMAP_THRESHOLD = -3  # glibc's malloc.h

_lock = threading.Lock()
_inside = 0  # restores under way (a manager's and an open checkpoint's may overlap)


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """The C library if it is glibc (it has `malloc_trim`), else None."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim  # noqa: B018  (glibc's alone)
        libc.mallopt  # noqa: B018
    except (OSError, AttributeError):
        return None
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.malloc_trim.argtypes = [ctypes.c_size_t]
    return libc


def devices_on_host() -> bool:
    """Whether this process's devices' memory is host memory (CPU devices)."""
    return jax.devices()[0].platform == "cpu"


@contextlib.contextmanager
def returning_freed(on_host: bool | None = None) -> Iterator[None]:
    """A block in which freed staging goes back to the operating system (see above);
    `on_host`: whether the devices' memory is host memory (None: `devices_on_host()`)."""
    libc = _glibc()
    if libc is None:
        yield
        return
    on_host = devices_on_host() if on_host is None else on_host
    try:
        with _mapped(libc) if on_host else contextlib.nullcontext():
            yield
    finally:
        libc.malloc_trim(0)


@contextlib.contextmanager
def _mapped(libc: ctypes.CDLL) -> Iterator[None]:
    """Blocks of `MAPPED_BYTES` or more mapped pages of their own, until the last of the
    restores under way ends."""
    global _inside
    with _lock:
        if _inside == 0:
            libc.mallopt(_M_MMAP_THRESHOLD, MAPPED_BYTES)
        _inside += 1
    try:
        yield
    finally:
        with _lock:
            _inside -= 1
            if _inside == 0:
                libc.mallopt(_M_MMAP_THRESHOLD, HEAP_BYTES)


def auto_inflight_bytes() -> int:
    """`DEFAULT_INFLIGHT_BYTES`, or a quarter of this host's memory where that is less
    (at least 16 MiB); in a multi-process job the smallest host's, since every process
    must read the same batches."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        total = 4 * 2**30
    mib = max(16, min(DEFAULT_INFLIGHT_BYTES, total // 4) // 2**20)
    if jax.process_count() > 1:
        mib = min(int(found) for found in _agree.gather("each host's restore budget", str(mib)))
    return mib * 2**20

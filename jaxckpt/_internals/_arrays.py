"""JAX's arrays below its public API: a sharded array's single-device buffers, host arrays
placed in a batch, and host buffers JAX's CPU client takes without a copy."""

from __future__ import annotations

import functools
import mmap
from typing import Any

import jax
import numpy as np

# The alignment at which JAX's CPU client takes a host buffer as the device's own (zero
# copy); at 16 (numpy's), it copies it (tests/test_orbax_boundary.py).
CPU_ALIGNMENT = 64
OWN_PAGES_BYTES = 2**20  # from this size a `host_buffer` is pages of its own


def host_buffer(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An uninitialized C-contiguous array that JAX's CPU client takes as a device's own
    buffer, with no copy. One of `OWN_PAGES_BYTES` or more is anonymous pages of its own,
    unmapped when the array dies: never in the heap, where the freed buffers around it
    could not go back to the system, and faulted in as plain pages (numpy asks the kernel
    for huge pages for its large arrays, and here their faults compacted memory: a 1.5 GiB
    restore onto 8 CPU devices took 2.9-3.4 s in such buffers, 1.8-1.9 s in these)."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    private = getattr(mmap, "MAP_PRIVATE", None)
    if nbytes < OWN_PAGES_BYTES or private is None:  # (page-aligned, below)
        return aligned_empty(shape, dtype)
    pages = mmap.mmap(-1, nbytes, flags=private | mmap.MAP_ANONYMOUS)
    return np.frombuffer(pages, dtype).reshape(shape)


def aligned_empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An uninitialized C-contiguous array at a `CPU_ALIGNMENT`-byte address: placed on a
    CPU device, it becomes that device's buffer with no copy."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + CPU_ALIGNMENT, np.uint8)
    at = -raw.ctypes.data % CPU_ALIGNMENT
    return raw[at : at + nbytes].view(dtype).reshape(shape)


def device_buffers(array: jax.Array) -> list[jax.Array]:
    """An array's addressable single-device arrays, in the order of `addressable_shards`,
    in one call: `addressable_shards` builds a Shard (its index, its replica id) for each,
    and `addressable_data(i)` all of them for each i; at thousands of small leaves either
    doubled the save's blocking time."""
    # (jax.Array is abstract: its one implementation, jax's ArrayImpl, holds `_arrays`)
    return array._arrays  # type: ignore[attr-defined]


def put_batched(hosts: list[np.ndarray], sharding: jax.sharding.Sharding) -> list[jax.Array]:
    """Host arrays of canonical dtypes onto one sharding of this process's devices: the
    per-array step of `jax.device_put(hosts, sharding)` without its per-array checks and
    abstractions, which were ~40% of placing thousands of small leaves."""
    from jax._src.interpreters import pxla

    out = []
    for host in hosts:
        devices, slices = _device_slices(sharding, host.shape)
        aval = _aval(host.shape, host.dtype)
        out.append(pxla.batched_device_put(aval, sharding, [host[i] for i in slices], devices))
    return out


@functools.lru_cache(maxsize=1024)
def _device_slices(sharding: jax.sharding.Sharding, shape: tuple[int, ...]) -> tuple:
    """This process's devices of `sharding` and the index of each one's shard of `shape`
    (the caller must not change the list)."""
    indices = sharding.addressable_devices_indices_map(shape)
    return list(indices), tuple(indices.values())


@functools.lru_cache(maxsize=1024)
def _aval(shape: tuple[int, ...], dtype: np.dtype) -> Any:
    from jax._src import core

    return core.ShapedArray(shape, dtype)

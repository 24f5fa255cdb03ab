"""Host buffers that JAX's CPU client takes as a device's own, with no copy
(`host_buffer`): a restore onto CPU devices reads each byte once, into its final place.
"""

from __future__ import annotations

import mmap

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

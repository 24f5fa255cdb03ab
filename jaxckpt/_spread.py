"""Restore traffic that does not grow with the replicas: each byte is read from storage
once in the job, and reaches the other processes that hold it over the job's own
collectives (JAX's: ICI/DCN on a pod, gloo on CPUs).

In a multi-process job a leaf that several processes hold whole or in part (data
parallelism, the slice axis of a multi-slice job) would otherwise be read by each of them.
`read_arrays` reads it spread instead:

- an array of the Orbax item onto a `NamedSharding`: read onto the same mesh with the mesh
  axes its spec leaves replicated (those spanning processes) added to a dimension they
  divide, so that each process reads a distinct part, then resharded onto the target by a
  jitted identity (an all-gather);
- packed leaves that more than one process needs whole or in part: the pieces in process
  i's file are read by process i (its own writes, in runs), a batch at a time, and the
  batch's bytes all-gathered as one array of bytes; every process assembles the leaves.

Every stage agrees first on whether each process's read succeeded (`_agree.refusing`,
bounded by the restore's deadline), so that no process waits in a gather for one that
failed: all raise, the failed one its own error.
The bytes in flight stay within a batch (`_plan.read_batches`) beside the restored arrays:
this is where a restore's reads are cut into batches, once, for either tier.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxckpt import _packed_index, _packed_read, _transfer
from jaxckpt._agree import refusing
from jaxckpt._layout import StepInfo
from jaxckpt._plan import holders
from jaxckpt._read_interfaces import Store, read_batched
from jaxckpt._transfer import place
from jaxckpt._tree import ReadRequest
from jaxckpt.errors import RestoreError

T = TypeVar("T")


def read_arrays(
    store: Store,
    info: StepInfo,
    item: str,
    requests: Mapping[str, ReadRequest],
    *,
    budget: int,
) -> dict[str, Any]:
    """The arrays `requests` names of one item of a step, read through `store` in batches
    of at most `budget` bytes (`_read_interfaces.read_batched`), each byte read once in the job
    where the store is shared by a job of several processes (every process calls it alike).
    The one place a restore's reads are cut into batches."""
    read = functools.partial(store.read_arrays, info, item)
    whole = store.layout(info).whole
    if jax.process_count() == 1 or not store.shared:
        return read_batched(read, requests, budget, whole=whole)
    packed = info.packed.get(item, frozenset())
    wide = {n: r for n, r in requests.items() if n in packed and _shared(r) and 0 not in r.shape}
    spread = {n: s for n, r in requests.items() if n not in packed and (s := _read_sharding(r))}
    rest = {n: r for n, r in requests.items() if n not in wide and n not in spread}
    out = _agreed(
        f"the read of step {info.step}'s arrays",
        lambda: read_batched(read, rest, budget, whole=whole),
    )

    def read_parts(batch: Mapping[str, ReadRequest]) -> dict[str, Any]:
        got = _agreed(
            f"the read of a part of step {info.step}'s arrays", functools.partial(read, batch)
        )
        return {n: _reshard(requests[n].sharding)(got[n]) for n in batch}

    parts = {n: dataclasses.replace(requests[n], sharding=s) for n, s in spread.items()}
    out.update(read_batched(read_parts, parts, budget, whole=whole))
    if wide:
        step, where = info.step, store.directory
        with (
            _transfer.read_errors(step, item, where),
            _transfer.corrupt_if_not_jaxckpts(step, where),
        ):
            steps = _agreed(
                f"the index of step {step}'s packed leaves",
                lambda: store.layout(info).packed_step(item),
            )
            out.update(read_batched(functools.partial(_broadcast, steps, item), wide, budget))
    return out


def _agreed(what: str, attempt: Callable[[], T]) -> T:
    """`attempt()` (`what`), once every process knows whether its own succeeded."""
    try:
        got, failed = attempt(), None
    except Exception as e:
        got, failed = None, e
    found = refusing(what, None if failed is None else type(failed).__name__)
    if failed is not None:
        raise failed
    if found:
        raise RestoreError(f"the restore failed on process(es) {found} (their errors say why)")
    return got  # type: ignore[return-value]  # (None only where attempt() raised)


# ------------------------------------------------------------------ arrays, read in parts


def _read_sharding(request: ReadRequest) -> NamedSharding | None:
    """The target's mesh, with each axis its spec leaves replicated across processes added
    to the first dimension it divides (None: no such axis, or none placed)."""
    target = request.sharding
    if not isinstance(target, NamedSharding) or target.is_fully_addressable:
        return None
    if 0 in request.shape:  # made, never read
        return None
    return _spread_on(target, tuple(request.shape))


@functools.lru_cache(maxsize=1024)
def _spread_on(target: NamedSharding, shape: tuple[int, ...]) -> NamedSharding | None:
    mesh, spec = target.mesh, list(target.spec) + [None] * (len(shape) - len(target.spec))
    used = {a for entry in spec for a in _names(entry)}
    placed = False
    for axis in mesh.axis_names:
        if axis in used or not _spans_processes(mesh, axis):
            continue
        for dim, n in enumerate(shape):
            names = _names(spec[dim])
            if n % (math.prod(mesh.shape[a] for a in names) * mesh.shape[axis]) == 0:
                spec[dim], placed = (*names, axis), True
                break
    return NamedSharding(mesh, P(*spec)) if placed else None


def _names(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def _spans_processes(mesh: Any, axis: str) -> bool:
    """Whether moving along `axis` of the mesh reaches devices of other processes."""
    processes = np.vectorize(lambda d: d.process_index)(mesh.devices)
    first = np.take(processes, [0], axis=mesh.axis_names.index(axis))
    return bool((processes != first).any())


@functools.lru_cache(maxsize=256)
def _reshard(target: jax.sharding.Sharding) -> Callable[[jax.Array], jax.Array]:
    """A jitted identity onto `target`: XLA's collectives bring each device its part."""
    return jax.jit(lambda x: x, out_shardings=target)


# ------------------------------------------------------------------ packed leaves, by piece


def _shared(request: ReadRequest) -> bool:
    """Whether more than one process needs some of the leaf (so each would read it)."""
    sharding = request.sharding
    if sharding is None or sharding.is_fully_addressable:
        return False
    return max(len(p) for p in holders(sharding, tuple(request.shape)).values()) > 1


def _broadcast(
    packed: _packed_read.PackedStep, item: str, batch: Mapping[str, ReadRequest]
) -> dict[str, Any]:
    """Packed leaves that several processes need: the pieces of the file process i wrote
    are read by process i (mod the processes now), in runs, as one process reads them; the
    bytes gathered by all (one all-gather of the batch); then each leaf is placed."""
    processes, me = jax.process_count(), jax.process_index()
    whole = {n: dataclasses.replace(r, sharding=None) for n, r in batch.items()}
    wanted = _agreed(f"the packed pieces of {item} wanted", lambda: packed.wanted(item, whole))
    pieces = [p for ps in wanted.values() for p in ps]
    share: list[list[_packed_index.Piece]] = [[] for _ in range(processes)]
    for p in pieces:
        share[p.process % processes].append(p)
    got = _agreed(f"the read of packed pieces of {item}", lambda: packed.read_pieces(share[me]))
    width = max(sum(p.nbytes for p in part) for part in share)
    row = np.zeros(1 << max(width - 1, 1).bit_length(), np.uint8)  # few shapes to compile
    at = 0
    for p in share[me]:
        row[at : at + p.nbytes] = got[p]
        at += p.nbytes
    rows = np.asarray(multihost_utils.process_allgather(row)).reshape(processes, -1)
    blobs = {}
    for part, data in zip(share, rows, strict=True):
        at = 0
        for p in part:
            blobs[p] = data[at : at + p.nbytes]
            at += p.nbytes
    return place(packed.assemble(item, wanted, blobs), batch)

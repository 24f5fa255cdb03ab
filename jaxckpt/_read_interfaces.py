"""The interfaces of the read path: a `Store` for each tier and a `Layout` for each kind of
step on disk, and the one place a read is cut into batches (`read_batched`).

    Store     `_orbax.OrbaxStore`, the persistent directory (one copy of each step for the
              whole job), and `_local.LocalStore`, this process's part of each step in its
              own directory. They differ in how they commit and who reads what.
    Layout    how one kind of step is read, a batch at a time, each array onto its sharding:
              a jaxckpt step of the persistent tier (`_jaxckpt_steps.JaxckptLayout`: Orbax's arrays
              and the packed leaves), a step plain Orbax wrote (`_orbax_steps.OrbaxLayout`),
              a process's part of a local step (`_transfer.PackedLayout`).

A store's `read_arrays(info, item, batch)` reads exactly the batch it is given, through the
step's layout: the budget of a restore (`restore_inflight_bytes`) is the reader's alone,
which cuts every read into batches once, here or in `_spread`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

from jaxckpt import _layout, _packed_read, _transfer
from jaxckpt._plan import read_batches
from jaxckpt._tree import ReadRequest

ReadBatch = Callable[[Mapping[str, ReadRequest]], dict[str, Any]]


class Layout(Protocol):
    """One kind of step on disk, as a reader reads it (one step, one item at a time)."""

    # Whether a read of any of its leaves costs a read of all of them (an Orbax item saved
    # before Orbax's metadata named each leaf): then it is read in one batch.
    whole: bool

    def read(self, item: str, batch: Mapping[str, ReadRequest]) -> dict[str, Any]:
        """The arrays `batch` names (none of them zero-size), each onto its request's
        sharding (None: to the host); a file unlike what the step records is a
        CorruptCheckpointError, a failure of the storage a RestoreError or StorageError."""
        ...

    def packed_step(self, item: str) -> _packed_read.PackedStep:
        """Its packed leaves' pieces, for `_spread` to read each once in the job (ValueError
        where it packs none: `StepInfo.packed` then names no leaf to ask for)."""
        ...


class Store(Protocol):
    """A tier's store: what the manager saves through and a reader reads through."""

    directory: Any
    # One copy of each step for the whole job, read by every process (so that `_spread`
    # reads each byte once in the job); False: each process reads its own part alone.
    shared: bool

    def steps(self) -> list[int]: ...  # committed, oldest first

    def info(self, step: int) -> _layout.StepInfo: ...

    def layout(self, info: _layout.StepInfo) -> Layout: ...

    def read_arrays(
        self, info: _layout.StepInfo, item: str, batch: Mapping[str, ReadRequest]
    ) -> dict[str, Any]: ...  # `layout(info).read(item, batch)`: one batch, as given

    def save(
        self,
        info: _layout.StepInfo,
        arrays: Mapping[str, Mapping[str, Any]],
        data: str | None,
        data_about: str | None,
    ) -> None: ...  # returns once the arrays are off the devices; commits in the background

    def wait(self) -> None: ...  # until the save in flight is committed (its error raised)

    def close(self) -> None: ...


def read_batched(
    read: ReadBatch, requests: Mapping[str, ReadRequest], budget: int, *, whole: bool = False
) -> dict[str, Any]:
    """`read(batch)` for consecutive batches of `requests` of at most `budget` bytes
    (`_plan.read_batches`; `whole`: one batch), the staging of one at a time in flight.
    Zero-size leaves are made, never read (`save` writes none).

    (Orbax's own limiter, `restore_concurrent_gb`, wakes every waiting leaf on each
    release: restoring thousands of leaves under it took 2.5x longer than one Orbax
    restore per batch.)"""
    out = {name: _transfer.empty(r) for name, r in requests.items() if 0 in r.shape}
    rest = {name: r for name, r in requests.items() if name not in out}
    for batch in [list(rest)] if whole and rest else read_batches(rest, budget):
        out.update(read({n: rest[n] for n in batch}))
    return out

"""jaxckpt's items as Orbax writes them: the type handlers of the arrays Orbax writes (with
replica-parallel writes only where they pay off, and the size of OCDBT's data files), and
jaxckpt's own items as Orbax checkpoint handlers: each process's data-iterator state and
its packed small leaves (their formats are `jaxckpt._layout`'s and `jaxckpt._packed`'s).
`jaxckpt._orbax`'s store saves them; what they write is read back without Orbax.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from jaxckpt import _incremental, _internals, _layout, _packed

# A replicated array (only those above `_packed.MAX_LEAF_BYTES` are Orbax's) is written by
# its replicas in slices of at least this many bytes each: the busiest process writes ~1/N
# of it (benchmarks/scale.py).
REPLICA_PARALLEL_MIN_BYTES = 256 * 2**10
# OCDBT packs a process's writes of an item into data files of about the size a save
# asks, written in parallel (without a target, one file at a time: 2-3x slower,
# BENCHMARKS.md): its share in DATA_FILES files, each of DATA_FILE_BYTES at most and
# MIN_DATA_FILE_BYTES at least. One 64 MiB file took 0.127 s to save where eight took
# 0.107 s (the disk's floor here 0.074 s); 1 GiB saves alike in 8 or 64 files.
DATA_FILES = 8
MIN_DATA_FILE_BYTES = 8 * 2**20
DATA_FILE_BYTES = 128 * 2**20


def data_file_bytes(leaves: Mapping[str, Any]) -> int:
    """The data-file size OCDBT is asked for when this process writes its share of `leaves`
    (every process about as much: each writes its shards, replicas spread among them)."""
    share = sum(a.size * a.dtype.itemsize for a in leaves.values()) // jax.process_count()
    return min(max(-(-share // DATA_FILES), MIN_DATA_FILE_BYTES), DATA_FILE_BYTES)


class DataStateHandler(ocp.AsyncCheckpointHandler):
    """Writes each process's data-iterator state to its own file, and beside it what the
    iterator was (`jaxckpt._iterators.describe`), checked at restore before any array is
    read. Per process, as the states are: each process's pipeline reads its own shard."""

    async def async_save(self, directory: epath.Path, args: DataSave) -> list[Any]:
        async def write() -> None:
            self.save(directory, args)

        # In a thread of its own once Orbax has made the step's folders (in the background:
        # every item's write waits for them, as Orbax's own handlers' do).
        return [ocp.future.CommitFutureAwaitingContractedSignals(write(), name="jaxckpt_data")]

    def save(self, directory: epath.Path, args: DataSave) -> None:
        self._path(directory, "process").write_text(args.text)
        if args.about is not None:
            self._path(directory, "iterator").write_text(args.about)

    def restore(self, directory: epath.Path, args: DataRestore | None = None) -> str:
        raise NotImplementedError("read as plain files: jaxckpt._layout.read_data_state")

    def metadata(self, directory: epath.Path) -> None:
        return None

    @staticmethod
    def _path(directory: epath.Path, kind: str) -> epath.Path:
        return directory / _layout.data_file(kind, jax.process_index(), jax.process_count())


@ocp.args.register_with_handler(DataStateHandler, for_save=True)
@dataclasses.dataclass
class DataSave(ocp.args.CheckpointArgs):
    text: str
    about: str | None = None


@ocp.args.register_with_handler(DataStateHandler, for_restore=True)  # Orbax needs both
@dataclasses.dataclass
class DataRestore(ocp.args.CheckpointArgs):
    pass


class PackedHandler(ocp.AsyncCheckpointHandler):
    """Writes this process's pieces of the packed leaves (`jaxckpt._packed`): copied to the
    host while the save blocks, written in one file in its background. `written`: each
    file of the save (by its path in the step) with its size and manifest digest, made as
    it was written: the manifest never reads it back. An incremental save writes only the
    pieces its `base` does not hold (`jaxckpt._incremental`): `base`, the newest committed
    step's, is what the last save `made` once the store saw it commit (`adopt`), each
    piece compressed with `codec` ("zstd") if any."""

    def __init__(self, codec: str | None = None) -> None:
        self.codec = codec
        self.written: dict[str, tuple[int, str]] = {}
        self.base: _incremental.SavedPieces | None = None
        self.made: _incremental.SavedPieces | None = None

    async def async_save(self, directory: epath.Path, args: PackedSave) -> list[Any]:
        self.made = None
        base = None
        if args.step is not None:  # incremental
            base = self.base or _incremental.empty(args.step)
        same = base.same if base is not None else None
        pieces = _packed.to_host(args.items, _internals.device_buffers, same=same)

        async def write() -> None:
            self.written, self.made = _packed.write(directory, pieces, base, args.step, self.codec)

        return [ocp.future.CommitFutureAwaitingContractedSignals(write(), name="jaxckpt_packed")]

    def adopt(self) -> None:
        """The save just committed: what it made is the next save's base."""
        if self.made is not None:
            self.base, self.made = self.made, None

    def forget(self, step: int) -> None:
        """Step `step` is deleted: a base holding bytes there is no base."""
        if self.base is not None and (self.base.step == step or step in self.base.owners()):
            self.base = None

    def save(self, directory: epath.Path, args: PackedSave) -> None:
        _packed.write(directory, _packed.to_host(args.items, _internals.device_buffers))

    def restore(self, directory: epath.Path, args: PackedRestore | None = None) -> None:
        raise NotImplementedError("read through jaxckpt._packed_read.PackedStep")

    def metadata(self, directory: epath.Path) -> None:
        return None


@ocp.args.register_with_handler(PackedHandler, for_save=True)
@dataclasses.dataclass
class PackedSave(ocp.args.CheckpointArgs):
    """`step`: an incremental save's step (format 3); None: format 2."""

    items: Mapping[str, Mapping[str, Any]]
    step: int | None = None


@ocp.args.register_with_handler(PackedHandler, for_restore=True)  # Orbax needs both
@dataclasses.dataclass
class PackedRestore(ocp.args.CheckpointArgs):
    pass


def registry(array_metadata: bool = True) -> ocp.type_handlers.TypeHandlerRegistry:
    """Orbax's handlers for the two leaf types jaxckpt hands it, with replica-parallel
    writes only where they pay off.

    Orbax splits a replicated shard among its replicas, one compiled `lax.slice` per
    distinct piece on the save's blocking path: the first save of a training state with
    replicated biases and norms compiled for ~2 s. One process gains nothing from it (it
    writes every piece anyway), so only several processes use it, and only for pieces of
    at least REPLICA_PARALLEL_MIN_BYTES (the small leaves are packed, `_packed`, their
    pieces spread over the processes holding them). `array_metadata`: with Orbax's
    per-process ArrayMetadata, which a save writes as Orbax's own would (a read needs none).
    """
    return ocp.type_handlers.create_type_handler_registry(
        (np.ndarray, ocp.type_handlers.NumpyHandler()),
        (
            jax.Array,
            ocp.type_handlers.ArrayHandler(
                use_replica_parallel=jax.process_count() > 1,
                min_slice_bytes_for_replica_parallel=REPLICA_PARALLEL_MIN_BYTES,
                array_metadata_store=_internals.array_metadata_store() if array_metadata else None,
            ),
        ),
    )

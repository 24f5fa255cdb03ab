"""Host <-> device: host arrays placed onto the devices of their shardings, and the packed
leaves read and placed (`PackedLayout`), for the persistent tier, the local tier and the
restore of a step plain Orbax wrote alike (the save side, shards copied off the devices, is
`jaxckpt._packed.to_host`, over `_internals.device_buffers`). The errors a read raises are
worded here: a file that is not what jaxckpt writes is a CorruptCheckpointError, a failure
of the storage itself a RestoreError (of a store that did not answer, a StorageError).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import numpy as np
from etils import epath

from jaxckpt import _packed_read
from jaxckpt._damage import Damaged, Incomplete
from jaxckpt._internals import put_batched
from jaxckpt._layout import INFO_PATH
from jaxckpt._packed import MAX_LEAF_BYTES
from jaxckpt._store_errors import storage_error
from jaxckpt._tree import ReadRequest
from jaxckpt.errors import (
    CorruptCheckpointError,
    IncompleteStepError,
    JaxckptError,
    RestoreError,
)


@contextlib.contextmanager
def read_errors(step: int, item: str, directory: epath.Path) -> Iterator[None]:
    """Orbax's and tensorstore's errors while reading a step, as one RestoreError; a
    store's failure (it did not answer, refused, ...) as the StorageError it is, naming the
    read and the item's folder."""
    try:
        yield
    except JaxckptError:
        raise
    except Exception as e:
        where = directory / str(step) / item
        if found := storage_error(directory, e, f"reading {item} of step {step} ({where})"):
            raise found from e
        raise RestoreError(
            f"reading {item} of step {step} in {directory} failed: {type(e).__name__}: "
            + first_line(e)
        ) from e


@contextlib.contextmanager
def corrupt_if_not_jaxckpts(step: int, directory: epath.Path) -> Iterator[None]:
    """A file that is not what jaxckpt writes, or bytes that disagree with their digest
    (`_damage.Damaged`), or a file that is missing, as the CorruptCheckpointError it is;
    anything else as it is (jaxckpt's own errors, a target it cannot place onto:
    `ShardingError`; the others `read_errors` names)."""
    try:
        yield
    except JaxckptError:
        raise
    except Incomplete as e:
        raise IncompleteStepError(step, [str(e)], str(directory)) from None
    except (Damaged, FileNotFoundError) as e:
        raise CorruptCheckpointError(step, [str(e)], str(directory)) from None


def first_line(error: BaseException) -> str:
    """The first line of an error's text (Orbax's and tensorstore's run long)."""
    return (str(error).strip().splitlines() or [""])[0][:300]


class PackedLayout:
    """The packed leaves of a step (`_read_interfaces.Layout`): a process's part of a local
    step, and the packed half of a jaxckpt step of the persistent tier
    (`_jaxckpt_steps.JaxckptLayout`). A file that is not what jaxckpt writes is a
    CorruptCheckpointError, another failure (of the storage itself) a RestoreError, never
    "corrupt", which fallback=True would pass over for an older step."""

    whole = False

    def __init__(self, packed: _packed_read.PackedStep, step: int, directory: epath.Path):
        self._packed, self._step, self._directory = packed, step, directory

    def read(self, item: str, batch: Mapping[str, ReadRequest]) -> dict[str, Any]:
        # a leaf above MAX_LEAF_BYTES (an incremental step's: a piece a shard) is read
        # shard by shard onto its devices, the others whole on the host and placed together
        large = {n: r for n, r in batch.items() if _by_shard(r)}
        rest = {n: r for n, r in batch.items() if n not in large}
        with (
            read_errors(self._step, item, self._directory),
            corrupt_if_not_jaxckpts(self._step, self._directory),
        ):
            out = self._packed.read_sharded(item, large) if large else {}
            hosts = self._packed.read(item, rest) if rest else {}
        return out | place(hosts, rest)

    def packed_step(self, item: str) -> _packed_read.PackedStep:
        return self._packed


def _by_shard(request: ReadRequest) -> bool:
    """Whether a packed leaf is read shard by shard (`PackedStep.read_sharded`): one above
    `_packed.MAX_LEAF_BYTES` (a piece a shard) placed on devices, of a dtype JAX keeps."""
    dtype = np.dtype(request.dtype)
    return (
        request.sharding is not None
        and math.prod(request.shape) * dtype.itemsize > MAX_LEAF_BYTES
        and dtype == jax.dtypes.canonicalize_dtype(dtype)
    )


def place(hosts: Mapping[str, np.ndarray], requests: Mapping[str, ReadRequest]) -> dict:
    """Host arrays onto their requests' shardings (None: left on the host). One process:
    all the leaves of a sharding at once; several: each process places the slices its
    devices hold (the rest of a host array is never read)."""
    out: dict[str, Any] = {}
    groups: dict[jax.sharding.Sharding, list[str]] = {}
    for name, host in hosts.items():
        sharding = requests[name].sharding
        if sharding is None:  # the caller's own, not a view pinning a whole read
            out[name] = np.array(host) if host.base is not None else host
        elif jax.process_count() > 1:
            out[name] = on(sharding, host)
        else:
            groups.setdefault(sharding, []).append(name)
    for sharding, names in groups.items():
        fast = [n for n in names if hosts[n].dtype == jax.dtypes.canonicalize_dtype(hosts[n].dtype)]
        out.update(zip(fast, put_batched([hosts[n] for n in fast], sharding), strict=True))
        if rest := [n for n in names if n not in out]:  # e.g. float64 without jax_enable_x64
            out.update(zip(rest, jax.device_put([hosts[n] for n in rest], sharding), strict=True))
    return out


def empty(request: ReadRequest) -> Any:
    """A zero-size array (never written, see `save`) where the request wants it."""
    host = np.zeros(request.shape, request.dtype)
    return host if request.sharding is None else on(request.sharding, host)


def on(sharding: jax.sharding.Sharding, host: np.ndarray) -> jax.Array:
    """A host array placed on `sharding` (on every process of a multi-process job)."""
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def check_read(
    step: int, item: str, name: str, value: Any, request: ReadRequest, directory: epath.Path
) -> None:
    """A leaf read must be what jaxckpt.json records (Orbax hands back the request itself
    for a leaf the arrays lack, and a host array in its stored shape)."""
    if isinstance(value, np.ndarray | jax.Array) and value.shape == request.shape:
        return
    found = (
        f"stored with shape {value.shape}"
        if isinstance(value, np.ndarray | jax.Array)
        else "not among the stored arrays"
    )
    raise CorruptCheckpointError(
        step,
        [f"{item} leaf {name!r} is {found}, but {INFO_PATH} records shape {request.shape}"],
        str(directory),
    )

"""The safetensors file format, streamed: write tensor by tensor, read headers strictly.

A file is an 8-byte little-endian header length N, N bytes of JSON header, then the tensor
bytes. The header maps each tensor name to `{"dtype", "shape", "data_offsets": [begin, end]}`
(offsets relative to the end of the header, contiguous, no gaps) and may hold
`"__metadata__"`: a string-to-string map. Because every offset follows from dtypes and shapes
alone, the header is written first and tensors are appended one at a time: writing needs
memory for one tensor, never for the file.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from jaxckpt.errors import FormatError, UnsupportedValueError
from jaxckpt.storage import is_remote

MAX_HEADER = 100 * 1000 * 1000  # the limit safetensors itself enforces

DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U64": np.dtype(np.uint64),
    "U32": np.dtype(np.uint32),
    "U16": np.dtype(np.uint16),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
CODES = {dtype: code for code, dtype in DTYPES.items()}


def dtype_code(dtype: np.dtype, what: str) -> str:
    try:
        return CODES[np.dtype(dtype)]
    except KeyError:
        raise UnsupportedValueError(
            f"{what} has dtype {dtype}, which safetensors cannot store"
        ) from None


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    begin: int  # absolute offset in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def nbytes(dtype: np.dtype, shape: Iterable[int]) -> int:
    return math.prod(shape) * np.dtype(dtype).itemsize


def encode_header(
    tensors: Iterable[tuple[str, np.dtype, tuple[int, ...]]],
    metadata: Mapping[str, str] | None = None,
) -> tuple[bytes, dict[str, int]]:
    """The file's first bytes (length + JSON header) and each tensor's absolute offset."""
    header: dict[str, object] = {}
    if metadata:
        bad = {
            k: v for k, v in metadata.items() if not isinstance(k, str) or not isinstance(v, str)
        }
        if bad:
            raise UnsupportedValueError(
                f"safetensors __metadata__ maps strings to strings; these entries are not: {bad!r}. "
                "Convert the values with str() or json.dumps()."
            )
        header["__metadata__"] = dict(metadata)
    offset, offsets = 0, {}
    for name, dtype, shape in tensors:
        size = nbytes(dtype, shape)
        header[name] = {
            "dtype": dtype_code(dtype, f"tensor {name!r}"),
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offsets[name] = offset
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # tensor data starts 8-byte aligned
    start = 8 + len(encoded)
    return struct.pack("<Q", len(encoded)) + encoded, {n: start + o for n, o in offsets.items()}


def write_file(
    path: Path,
    tensors: list[tuple[str, np.dtype, tuple[int, ...], Callable[[], np.ndarray]]],
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Writes `tensors` (name, dtype, shape, producer) in order, each produced when written.

    A local file is fsynced before returning; `path` may be an etils `epath` on object
    storage.
    """
    head, _ = encode_header([t[:3] for t in tensors], metadata)
    with path.open("wb") as f:
        f.write(head)
        for name, dtype, shape, produce in tensors:
            array = np.asarray(produce(), dtype=dtype, order="C")  # keeps 0-d as 0-d
            if array.shape != tuple(shape):
                raise AssertionError(f"{name}: produced {array.shape}, planned {tuple(shape)}")
            if array.dtype.byteorder == ">":
                array = array.astype(array.dtype.newbyteorder("<"))
            f.write(array.reshape(-1).view(np.uint8).data)
        f.flush()
        if not is_remote(path):  # on object storage the object exists once uploaded
            os.fsync(f.fileno())


def write_region(
    fd: int, offset: int, shape: tuple[int, ...], index: tuple[slice, ...], data: np.ndarray
) -> None:
    """Writes `data` = tensor[index] into an open file holding the tensor at `offset`.

    Each contiguous run of the tensor's C-order layout is one `pwrite`; a slice that spans
    whole trailing dimensions is one run.
    """
    data = np.asarray(data, order="C")  # (ascontiguousarray would make 0-d 1-d)
    if data.dtype.byteorder == ">":
        data = data.astype(data.dtype.newbyteorder("<"))
    starts = [s.indices(n)[0] for s, n in zip(index, shape, strict=True)]
    k = len(shape)  # the first axis from which the slice covers whole trailing dimensions
    while k > 0 and data.shape[k - 1] == shape[k - 1]:
        k -= 1
    k = max(k - 1, 0)
    strides = [math.prod(shape[j + 1 :]) for j in range(len(shape))]
    for outer in np.ndindex(*data.shape[:k]):
        element = sum((starts[j] + outer[j]) * strides[j] for j in range(k))
        if k < len(shape):
            element += starts[k] * strides[k]
        run = data[outer].reshape(-1).view(np.uint8)
        os.pwrite(fd, run.data, offset + element * data.dtype.itemsize)


# write_rows: row segments shorter than this are copied into blocks of COPY_BLOCK_BYTES
# rather than written from their own memory (a buffer object each costs ~1 us in Python).
GATHER_MIN_BYTES = 64 * 2**10
COPY_BLOCK_BYTES = 16 * 2**20

try:  # buffers per gathered write
    _IOV_MAX = max(16, min(1024, os.sysconf("SC_IOV_MAX")))
except (AttributeError, ValueError, OSError):
    _IOV_MAX = 1024


def write_rows(
    fd: int, offset: int, shape: tuple[int, ...], parts: list[tuple[tuple[slice, ...], np.ndarray]]
) -> bool:
    """Writes pieces of a tensor that sit side by side along its last axis and together span
    it, for rows that are contiguous in the file, with gathered writes (`os.pwritev`) straight
    from the pieces' memory (short row segments are copied side by side into blocks of
    `COPY_BLOCK_BYTES` first). Returns False, writing nothing, for pieces that do not
    form such a block (split on a middle axis, non-contiguous, big-endian): use
    `write_region` for those.
    """
    if not shape or not parts:
        return False
    parts = sorted(parts, key=lambda part: part[0][-1].indices(shape[-1])[0])
    leading = [
        tuple(s.indices(n)[:2] for s, n in zip(i[:-1], shape[:-1], strict=True)) for i, _ in parts
    ]
    if any(lead != leading[0] for lead in leading):
        return False
    for axis, (start, stop) in enumerate(leading[0][1:], start=1):
        if (start, stop) != (0, shape[axis]):  # rows would not be contiguous in the file
            return False
    edge = 0
    for index, data in parts:
        start, stop = index[-1].indices(shape[-1])[:2]
        if start != edge or not data.flags.c_contiguous or data.dtype.byteorder == ">":
            return False
        edge = stop
    if edge != shape[-1]:
        return False
    rows = math.prod(stop - start for start, stop in leading[0])
    first_row = leading[0][0][0] if leading[0] else 0
    row_bytes = shape[-1] * parts[0][1].dtype.itemsize
    position = offset + first_row * math.prod(shape[1:]) * parts[0][1].dtype.itemsize
    views = [data.reshape(rows, -1).view(np.uint8) for _, data in parts]
    if len(views) == 1:  # whole rows: one buffer
        _pwrite_all(fd, [views[0].reshape(-1)], position)
        return True
    if min(v.shape[1] for v in views) < GATHER_MIN_BYTES:
        # Short row segments: one Python buffer each would cost more than copying them
        # side by side, a block of rows at a time, into one buffer per write.
        per_block = max(1, COPY_BLOCK_BYTES // row_bytes)
        for r in range(0, rows, per_block):
            block = np.concatenate([v[r : r + per_block] for v in views], axis=1)
            _pwrite_all(fd, [block.reshape(-1)], position + r * row_bytes)
        return True
    per_call = max(1, _IOV_MAX // len(views))
    for r in range(0, rows, per_call):
        block = range(r, min(rows, r + per_call))
        _pwrite_all(fd, [v[i] for i in block for v in views], position + r * row_bytes)
    return True


def _pwrite_all(fd: int, buffers: list, position: int) -> None:
    """`os.pwritev` until every buffer is written (a call may write less)."""
    buffers = [memoryview(b).cast("B") for b in buffers]
    while buffers:
        written = os.pwritev(fd, buffers, position)
        if not written:
            raise OSError(f"pwritev wrote nothing at offset {position}")
        position += written
        while buffers and written >= len(buffers[0]):
            written -= len(buffers[0])
            buffers.pop(0)
        if buffers and written:
            buffers[0] = buffers[0][written:]


def read_header(path: Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """The tensors and metadata of one file (a local path, or an etils `epath` on object
    storage); FormatError for anything malformed."""
    try:
        stat = path.stat()
        size = stat.st_size if hasattr(stat, "st_size") else stat.length
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise FormatError(f"{path}: {size} bytes, too short for a safetensors header")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER or 8 + n > size:
                raise FormatError(f"{path}: header length {n} does not fit the file ({size} bytes)")
            raw = f.read(n)
    except OSError as e:
        raise FormatError(f"cannot read {path}: {e}") from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FormatError(
            f"{path}: the header is not valid JSON ({e}); the file is corrupt"
        ) from None
    if not isinstance(header, dict):
        raise FormatError(f"{path}: the header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise FormatError(f"{path}: __metadata__ must map strings to strings")
    tensors, data_start, expected = {}, 8 + n, 0
    for name, entry in sorted(header.items(), key=lambda kv: _offsets(path, kv)[0]):
        begin, end = _offsets(path, (name, entry))
        code, shape = entry.get("dtype"), entry.get("shape")
        if code not in DTYPES or not isinstance(shape, list):
            raise FormatError(f"{path}: tensor {name!r} has a bad dtype or shape: {entry!r}")
        if begin != expected or end - begin != nbytes(DTYPES[code], shape):
            raise FormatError(f"{path}: tensor {name!r} has offsets {begin}..{end} that do not fit")
        expected = end
        tensors[name] = TensorInfo(
            name, DTYPES[code], tuple(shape), data_start + begin, data_start + end
        )
    if data_start + expected != size:
        raise FormatError(
            f"{path}: the header describes {data_start + expected} bytes but the file has {size}; "
            "it is truncated or corrupt"
        )
    return tensors, metadata


def _offsets(path: Path, item: tuple[str, object]) -> tuple[int, int]:
    name, entry = item
    offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
    if not (
        isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
    ):
        raise FormatError(f"{path}: tensor {name!r} has no valid data_offsets: {entry!r}")
    return offsets[0], offsets[1]


def read_slice(path: Path, info: TensorInfo, index: tuple[slice, ...]) -> np.ndarray:
    """Reads `info[index]`: locally through a memory map (only the pages holding the slice),
    on object storage (`gs://`) as one ranged read of the rows the slice spans."""
    if not is_remote(path):
        whole = np.memmap(path, dtype=info.dtype, mode="r", offset=info.begin, shape=info.shape)
        return np.array(whole[index])
    shape, itemsize = info.shape, np.dtype(info.dtype).itemsize
    first, last = index[0].indices(shape[0])[:2] if shape else (0, 1)
    row_bytes = math.prod(shape[1:]) * itemsize
    with path.open("rb") as f:
        f.seek(info.begin + first * row_bytes)
        raw = f.read((last - first) * row_bytes)
    rows = np.frombuffer(raw, info.dtype).reshape((last - first, *shape[1:]) if shape else ())
    return np.array(rows[(slice(None), *index[1:])] if shape else rows)

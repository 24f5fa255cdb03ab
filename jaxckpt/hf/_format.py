"""The safetensors file format, streamed: write tensor by tensor, read headers strictly.

A file is an 8-byte little-endian header length N, N bytes of JSON header, then the tensor
bytes. The header maps each tensor name to `{"dtype", "shape", "data_offsets": [begin, end]}`
(offsets relative to the end of the header, contiguous, no gaps) and may hold
`"__metadata__"`: a string-to-string map. Because every offset follows from dtypes and shapes
alone, the header is written first and tensors are appended one at a time: writing needs
memory for one tensor, never for the file.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import re
import stat as stat_module
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import ml_dtypes
import numpy as np

from jaxckpt._storage import file_kind, is_remote
from jaxckpt.errors import FormatError, UnsupportedValueError

if TYPE_CHECKING:
    from etils import epath  # a file on object storage (gs://) is read as an epath

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
    "C64": np.dtype(np.complex64),  # two float32s, real then imaginary; no C128 exists
}
CODES = {dtype: code for code, dtype in DTYPES.items()}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    begin: int  # absolute offset in the file
    end: int
    file_id: tuple[int, int] | None = None  # (device, inode) of the local file read

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def nbytes(dtype: np.dtype, shape: Iterable[int]) -> int:
    return math.prod(shape) * np.dtype(dtype).itemsize


def encode_header(
    tensors: Iterable[tuple[str, np.dtype, tuple[int, ...]]], metadata: Mapping[str, str]
) -> tuple[bytes, dict[str, int]]:
    """The file's first bytes (length + JSON header) and each tensor's absolute offset.
    (Exports always have `metadata`: `format: pt` at least.)"""
    bad = {k: v for k, v in metadata.items() if not isinstance(k, str) or not isinstance(v, str)}
    if bad:
        raise UnsupportedValueError(
            f"safetensors __metadata__ maps strings to strings; these entries are not: {bad!r}. "
            "Convert the values with str() or json.dumps()."
        )
    header: dict[str, object] = {"__metadata__": dict(metadata)}
    offset, offsets = 0, {}
    for name, dtype, shape in tensors:
        if np.dtype(dtype) not in CODES:
            raise UnsupportedValueError(
                f"tensor {name!r} has dtype {dtype}, which safetensors cannot store"
            )
        size = nbytes(dtype, shape)
        header[name] = {
            "dtype": CODES[np.dtype(dtype)],
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
    tensors: Sequence[tuple[str, np.dtype, tuple[int, ...], Callable[[], np.ndarray]]],
    metadata: Mapping[str, str],
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
            f.write(array.reshape(-1).view(np.uint8).data)
        f.flush()
        if not is_remote(path):  # on object storage the object exists once uploaded
            os.fsync(f.fileno())


def write_region(
    fd: int, offset: int, shape: tuple[int, ...], index: tuple[slice, ...], data: np.ndarray
) -> None:
    """Writes `data` = tensor[index] (in the tensor's dtype, a safetensors one: native byte
    order) into an open file holding the tensor at `offset`.

    Each contiguous run of the tensor's C-order layout is one `pwrite`; a slice that spans
    whole trailing dimensions is one run.
    """
    data = np.asarray(data, order="C")  # (ascontiguousarray would make 0-d 1-d)
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
    form such a block (split on a middle axis, non-contiguous): use `write_region` for those.
    """
    if not shape or not parts:
        return False
    parts = sorted(parts, key=lambda part: part[0][-1].indices(shape[-1])[0])
    leading = [
        tuple(s.indices(n)[:2] for s, n in zip(i[:-1], shape[:-1], strict=True)) for i, _ in parts
    ]
    whole = tuple((0, n) for n in shape[1:-1])  # else rows are not contiguous in the file
    if any(lead != leading[0] for lead in leading) or leading[0][1:] != whole:
        return False
    edge = 0
    for index, data in parts:
        start, stop = index[-1].indices(shape[-1])[:2]
        if start != edge or not data.flags.c_contiguous:
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
        in_call = range(r, min(rows, r + per_call))
        _pwrite_all(fd, [v[i] for i in in_call for v in views], position + r * row_bytes)
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


def read_header(path: Path | epath.Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """The tensors and metadata of one file (a local path, or an etils `epath` on object
    storage); FormatError for anything the reference loader (`safetensors`) refuses.

    A local `path` must not be a symbolic link (resolve it first; see `open_regular`). The
    rules are those of safetensors' Rust loader: the header is a JSON object (nested at most
    127 deep, no NaN, no lone surrogates), `__metadata__` is absent, null or a string-to-string
    object, each tensor has a known dtype, a shape of non-negative integers and two
    data_offsets that follow one another without gap or overlap, cover the data exactly and
    match dtype x shape. Stricter on one point: a key twice in one object is refused
    (safetensors keeps the last), since two readers could then see two different tensors.
    Error text never quotes the file's bytes: a file that is not safetensors leaks nothing.
    """
    with open_regular(path) as (f, size, file_id):
        if size < 8:
            raise FormatError(f"{path}: {size} bytes, too short for a safetensors header")
        try:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > MAX_HEADER or 8 + n > size:
                # n is not shown: for a file that is not safetensors, it is its first 8 bytes.
                raise FormatError(
                    f"{path}: its first 8 bytes give a header length that does not fit the file "
                    f"({size} bytes) or passes the {MAX_HEADER // 10**6} MB limit: it is not a "
                    "safetensors file, or it is truncated"
                )
            raw = f.read(n)
        except OSError as e:
            raise FormatError(f"cannot read {path}: {e.strerror or type(e).__name__}") from None
        if len(raw) != n:
            raise FormatError(f"{path} became shorter while its header was read")
    header = parse_json(raw, f"{path}: the header")
    if not isinstance(header, dict):
        raise FormatError(
            f"{path}: the header is not a JSON object; this is not a safetensors file"
        )
    metadata = header.pop("__metadata__", None)
    if metadata is None:  # null: safetensors reads it as no metadata
        metadata = {}
    elif not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise FormatError(
            f"{path}: __metadata__ must be a JSON object mapping strings to strings (or be absent)"
        )
    entries = sorted(
        ((name, _entry(path, name, value)) for name, value in header.items()),
        key=lambda item: item[1][2:],  # by (begin, end), as safetensors does
    )
    tensors, data_start, expected = {}, 8 + n, 0
    for name, (dtype, shape, begin, end) in entries:
        where = f"{path}: tensor {quote_name(name)}"
        if begin != expected or end < begin:
            raise FormatError(
                f"{where} has data_offsets that overlap another tensor or leave a gap before it; "
                "the file is corrupt"
            )
        elements = 1
        for dim in shape:  # in order, overflowing as safetensors' 64-bit product does
            elements *= dim
            if elements > _U64:
                raise FormatError(f"{where} has a shape whose element count overflows 64 bits")
        if elements * dtype.itemsize * 8 > _U64:
            raise FormatError(f"{where} has a shape whose size in bits overflows 64 bits")
        if end - begin != elements * dtype.itemsize:
            raise FormatError(
                f"{where}: its data_offsets span {end - begin} bytes, but its dtype and shape "
                f"need {elements * dtype.itemsize}; the file is corrupt"
            )
        expected = end
        tensors[name] = TensorInfo(
            name, dtype, tuple(shape), data_start + begin, data_start + end, file_id
        )
    if data_start + expected != size:
        raise FormatError(
            f"{path}: the header describes {data_start + expected} bytes but the file has {size}; "
            "it is truncated or corrupt"
        )
    return tensors, metadata


_U64 = 2**64 - 1
_FIELDS = ("dtype", "shape", "data_offsets")
# dtypes safetensors knows that jaxckpt does not load (named in errors: they are not corrupt).
OTHER_DTYPES = ("F4", "F6_E2M3", "F6_E3M2", "F8_E8M0", "F8_E4M3FNUZ", "F8_E5M2FNUZ")


def _entry(path: Path, name: str, value: object) -> tuple[np.dtype, list[int], int, int]:
    """(dtype, shape, begin, end) of one header entry, its types checked. Values are never
    quoted in errors (see `read_header`)."""
    where = f"{path}: tensor {quote_name(name)}"
    if not isinstance(value, dict) or any(k not in value for k in _FIELDS):
        raise FormatError(
            f"{where} is not a JSON object with dtype, shape and data_offsets; the file is corrupt"
        )
    code, shape, offsets = (value[k] for k in _FIELDS)
    if not isinstance(code, str) or code not in DTYPES:
        if isinstance(code, str) and code in OTHER_DTYPES:
            raise UnsupportedValueError(
                f"{where} has dtype {code}: valid safetensors, but jaxckpt reads only "
                f"{', '.join(DTYPES)}; convert the tensor (e.g. with torch) first"
            )
        raise FormatError(f"{where} has an unknown dtype (jaxckpt reads {', '.join(DTYPES)})")
    if not isinstance(shape, list) or not all(_is_u64(d) for d in shape):
        raise FormatError(f"{where}: shape must be a list of non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_u64, offsets))):
        raise FormatError(f"{where}: data_offsets must be two non-negative integers [begin, end]")
    return DTYPES[code], shape, offsets[0], offsets[1]


def _is_u64(value: object) -> bool:
    return type(value) is int and 0 <= value <= _U64  # not bool, not 4.0


def quote_name(name: str, limit: int = 80) -> str:
    """A name from a file, for an error: quoted, control characters escaped (no terminal
    escapes), at most `limit` characters of it."""
    return repr(name if len(name) <= limit else name[:limit] + "...")


# ---------------------------------------------------------------------------------- strict JSON

MAX_JSON_DEPTH = 127  # arrays and objects nested deeper: safetensors (serde_json) refuses them
_SURROGATE = re.compile("[\ud800-\udfff]")


class _Refused(Exception):
    """A JSON rule broken inside `json.loads` (raised by its hooks)."""


def parse_json(raw: bytes, what: str) -> object:
    """`raw` as JSON, by the rules of safetensors' parser: UTF-8 (no BOM), no NaN or
    Infinity, numbers within the float range, strings without lone surrogates, nesting at
    most `MAX_JSON_DEPTH` deep; stricter: a key twice in one object is refused. FormatError
    ("{what} is not valid JSON: ...") otherwise, never quoting the bytes."""
    try:
        value = json.loads(
            raw.decode("utf-8"),
            object_pairs_hook=_object,
            parse_int=_int,
            parse_float=_float,
            parse_constant=_constant,
        )
        _check_tree(value)
        return value
    except UnicodeDecodeError as e:
        why = f": not UTF-8 (at byte {e.start})"
    except json.JSONDecodeError as e:  # e.msg is the parser's own words, no file text
        why = f": {e.msg} at line {e.lineno} column {e.colno}"
    except _Refused as e:
        why = f": {e}"
    except RecursionError:
        why = f": nested more than {MAX_JSON_DEPTH} deep"
    except ValueError:  # any other refusal of Python's parser
        why = ""
    raise FormatError(f"{what} is not valid JSON{why}") from None


def _object(pairs: list[tuple[str, object]]) -> dict[str, object]:
    obj: dict[str, object] = {}
    for key, value in pairs:
        if key in obj:
            raise _Refused(f"the key {quote_name(key)} appears twice in one object")
        obj[key] = value
    return obj


def _int(text: str) -> int | float:
    if text == "-0":
        return -0.0  # serde_json reads -0 as a float: no shape or offset
    if len(text) > 400:  # past the float range; and int() of 4300+ digits raises
        raise _Refused("a number is out of range")
    value = int(text)
    if abs(value) > _U64:  # serde_json reads it as a float, refused past the float range
        try:
            float(value)
        except OverflowError:
            raise _Refused("a number is out of range") from None
    return value


def _float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise _Refused("a number is out of range")
    return value


def _constant(text: str) -> float:
    raise _Refused(f"{text} is not a JSON value")  # one of NaN, Infinity, -Infinity


def _check_tree(value: object) -> None:
    """Nesting depth and lone surrogates, walked without recursion."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth > MAX_JSON_DEPTH:
                raise _Refused(f"nested more than {MAX_JSON_DEPTH} deep")
            if isinstance(item, dict):
                item = [*item, *item.values()]  # keys are strings, checked as values are
            stack.extend((child, depth + 1) for child in item)
        elif isinstance(item, str) and _SURROGATE.search(item):
            raise _Refused("a string holds a lone UTF-16 surrogate")


# ------------------------------------------------------------------------------------ reading


@contextlib.contextmanager
def open_regular(
    path: Path | epath.Path,
) -> Iterator[tuple[BinaryIO, int, tuple[int, int] | None]]:
    """Opens `path` to read, if it is a regular file: yields (file, size, (device, inode)).

    Every read of a local file goes through here. The last component must not be a symbolic
    link: callers resolve the path and check where it leads first, and O_NOFOLLOW refuses a
    link put in its place since. O_NONBLOCK keeps the open of a FIFO from waiting for a
    writer; `fstat` of the open descriptor then refuses whatever is not a regular file
    (FIFO, device, directory, socket). On object storage (no links, no FIFOs) it yields
    (file, size, None).
    """
    if is_remote(path):
        try:
            stat = path.stat()
            f = path.open("rb")
        except OSError as e:
            raise FormatError(f"cannot read {path}: {e}") from None
        with f:
            # (etils' StatResult has the size as `length`)
            yield f, stat.st_size if isinstance(stat, os.stat_result) else stat.length, None
        return
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise FormatError(
                f"{path} is a symbolic link; jaxckpt opens only the file a link resolves to, "
                "after checking where it leads"
            ) from None
        raise FormatError(f"cannot open {path}: {e.strerror}") from None
    except ValueError:  # a NUL in the name
        raise FormatError(f"cannot open {path!r}: the name holds a NUL character") from None
    try:
        info = os.fstat(fd)
        if not stat_module.S_ISREG(info.st_mode):
            raise FormatError(
                f"{path} is {file_kind(info.st_mode)}, not a regular file; safetensors are read only "
                "from regular files"
            )
        os.set_blocking(fd, True)
        f = os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    with f:
        yield f, info.st_size, (info.st_dev, info.st_ino)


def read_slice(path: Path | epath.Path, info: TensorInfo, index: tuple[slice, ...]) -> np.ndarray:
    """Reads `info[index]`: locally through a memory map (only the pages holding the slice)
    of the file `open_regular` opened, on object storage (`gs://`) as one ranged read of the
    rows the slice spans."""
    with open_regular(path) as (f, size, file_id):
        if (info.file_id is not None and file_id != info.file_id) or size < info.end:
            raise FormatError(
                f"{path} was replaced or truncated after its header was read; load it again"
            )
        if not is_remote(path):
            whole = np.memmap(f, dtype=info.dtype, mode="r", offset=info.begin, shape=info.shape)
            return np.array(whole[index])
        shape = info.shape
        first, last = index[0].indices(shape[0])[:2] if shape else (0, 1)
        row_bytes = math.prod(shape[1:]) * info.dtype.itemsize
        f.seek(info.begin + first * row_bytes)
        raw = f.read((last - first) * row_bytes)
    rows = np.frombuffer(raw, info.dtype).reshape((last - first, *shape[1:]) if shape else ())
    return np.array(rows[(slice(None), *index[1:])] if shape else rows)

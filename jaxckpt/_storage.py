"""What differs between a local directory and object storage (`gs://bucket/prefix`).

Object stores have no rename (a "rename" copies every object), no advisory locks, and an
object appears whole or not at all. Modules that must act differently ask `is_remote`;
`gcs_blob` gives the google-cloud-storage handle for the few operations epath lacks
(conditional writes for the writer lease).

Every request to object storage counts at pod scale, where each process makes it: a
listing here is one request per 1,000 names (a folder's whole tree in one), and a file is
read in one request per read, with none to open it (epath's `open` made four or five:
its metadata, a listing to tell it from a folder, ...).
"""

from __future__ import annotations

import errno
import functools
import io
import os
import stat
from collections.abc import Iterator
from typing import Any

from jaxckpt.errors import ConfigError

try:
    import fsspec

    # gcsfs (epath's backend for gs://) caches directory listings for ever and updates them
    # only for its own writes, so steps committed by other processes, tensorstore writes
    # and deletes through other clients went unseen by `iterdir` and `exists`. jaxckpt
    # needs the bucket's current state (an explicit user setting is kept).
    fsspec.config.conf.setdefault("gcs", {}).setdefault("use_listings_cache", False)
except ImportError:  # no gs:// support installed
    pass


def is_remote(path: str | os.PathLike) -> bool:
    """True for object-storage URLs (`gs://...`), False for local paths."""
    return "://" in str(path)


def absolute(path: Any) -> Any:
    """A local path made absolute, once, where a directory enters jaxckpt; URLs unchanged.

    Orbax and tensorstore take only absolute paths, and refused a relative one late: at the
    background write of the first save (raised by the next save or close), or as a raw
    error on restore. Resolved at the boundary, a later `os.chdir` cannot move it either.
    """
    if is_remote(path):
        return path
    return os.path.abspath(os.fspath(path))


def gcs_blob(path: str | os.PathLike) -> Any:
    """The `google.cloud.storage.Blob` at `gs://bucket/name` (only the writer lease, made
    for gs:// directories alone, asks for one)."""
    bucket, _, name = str(path).removeprefix("gs://").partition("/")
    return _client().bucket(bucket).blob(name)


def entries(directory: Any) -> list[tuple[str, str]]:
    """The names in `directory`, each with what it is: "dir", "file" or "link" (a symbolic
    link, never followed), from one listing: a `scandir` locally, one request per 1,000
    names on object storage (where no links exist). FileNotFoundError if it is not there."""
    if not is_remote(directory):
        with os.scandir(directory) as found:
            return [(e.name, _kind(e)) for e in found]
    fs, root = _filesystem(directory)
    kinds: dict[str, str] = {}
    for entry in fs.ls(root, detail=True):
        name = entry["name"].rstrip("/").rpartition("/")[2]
        if name and kinds.get(name) != "dir":  # a folder and an object of one name: a folder
            kinds[name] = "dir" if entry["type"] == "directory" else "file"
    return list(kinds.items())


def _kind(entry: os.DirEntry) -> str:
    if entry.is_symlink():
        return "link"
    return "dir" if entry.is_dir(follow_symlinks=False) else "file"


def file_kind(mode: int) -> str:
    """What a file that is not a regular one is, from its `st_mode`, for error messages."""
    for test, kind in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISLNK, "a symbolic link"),
    ):
        if test(mode):
            return kind
    return "not a regular file"


def file_sizes(directory: Any) -> dict[str, int]:
    """The regular files directly in `directory`, each with its size, from one listing (no
    link followed); FileNotFoundError if it is not there."""
    if not is_remote(directory):
        with os.scandir(directory) as found:
            return {
                e.name: e.stat(follow_symlinks=False).st_size
                for e in found
                if e.is_file(follow_symlinks=False)
            }
    fs, key = _filesystem(directory)
    return {
        e["name"].rpartition("/")[2]: int(e["size"])
        for e in fs.ls(key, detail=True)
        if e["type"] == "file"
    }


def files_below(root: Any) -> Iterator[Any]:
    """Every file below `root`: on object storage from one listing of all its objects, not
    one per folder (the folders of a step grow with the processes that wrote it); locally
    a listing per folder (links are followed: folders Orbax wrote)."""
    if is_remote(root):
        fs, key = _filesystem(root)
        prefix = key.rstrip("/") + "/"
        for name in sorted(fs.find(key)):
            if name.startswith(prefix) and not name.endswith("/"):
                yield root / name[len(prefix) :]
        return
    stack = [root]
    while stack:
        for path in stack.pop().iterdir():
            if path.is_dir():
                stack.append(path)
            else:
                yield path


def open_inside(root: Any, rel: str, size: int | None = None) -> Any:
    """Opens the file `root/rel` for reading. Locally it goes down one folder at a time
    without following a link, and opens only a regular file: a folder swapped for a link
    cannot lead out of `root`, nor a FIFO swapped in block the reader (OSError otherwise).
    On object storage it makes no request: each read makes one (`size`, the object's as
    listed, spares the one a read of part of it would make to learn it)."""
    if is_remote(root):
        fs, key = _filesystem(root)
        return _Object(fs, f"{key.rstrip('/')}/{rel}", size)
    *folders, name = rel.split("/")
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for folder in folders:
            inner = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = inner
        file_fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=fd)
    finally:
        os.close(fd)
    if not stat.S_ISREG(os.fstat(file_fd).st_mode):
        os.close(file_fd)
        raise OSError(f"{rel} is not a regular file")
    return os.fdopen(file_fd, "rb")


class _Object(io.RawIOBase):
    """An object read by ranged requests, one a read, unbuffered: never a byte more than
    asked (`read(n)` may return fewer, as a raw file's does). None to open it: a missing
    object is FileNotFoundError at the first read. Its size, unless given, is learnt from a
    read that returns fewer bytes than asked (then no request is made past it), or asked
    for (one request) by a seek from its end or when the store refuses a read from its end
    on (that read returns nothing). A store's own error is OSError, as is a response longer
    than the range asked for."""

    def __init__(self, fs: Any, key: str, size: int | None):
        self._fs, self._key, self._pos, self._size = fs, key, 0, size

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        if whence not in (os.SEEK_SET, os.SEEK_CUR, os.SEEK_END):
            raise ValueError(f"invalid whence ({whence})")
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos}.get(whence)
        pos = offset + (self._length() if base is None else base)
        if pos < 0:
            raise OSError(errno.EINVAL, f"{self._key}: a seek to before its start")
        self._pos = pos
        return pos

    def _length(self) -> int:
        if self._size is None:
            self._size = int(self._fs.size(self._key))
        return self._size

    def readall(self) -> bytes:
        data = self._get(self._pos, None)
        self._pos += len(data)
        self._size = self._pos
        return data

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        stop = self._pos + len(view)
        if self._size is not None:
            stop = min(stop, self._size)
        data = self._get(self._pos, stop)
        view[: len(data)] = data
        self._pos += len(data)
        if self._pos < stop:  # fewer bytes than asked: the end
            self._size = self._pos
        return len(data)

    def _get(self, start: int, stop: int | None) -> bytes:
        """Bytes [start, stop) (None: to the end), fewer at the end, none from the end on."""
        if (stop is not None and stop <= start) or (self._size is not None and start >= self._size):
            return b""
        try:
            data = self._fs.cat_file(self._key, start=start or None, end=stop)
        except FileNotFoundError:
            raise
        except Exception as e:  # the store's own (gcsfs: HttpError), or OSError
            if self._size is None and start >= self._length():  # a range from the end on
                return b""
            raise OSError(f"{self._key}: {e}") from e
        if stop is not None and len(data) > stop - start:
            raise OSError(f"{self._key}: {len(data)} bytes for a range of {stop - start}")
        return data


def _filesystem(url: Any) -> tuple[Any, str]:
    """The fsspec filesystem of an object-storage URL and the path in it (bucket/key)."""
    protocol, _, key = str(url).partition("://")
    return fsspec.filesystem(protocol), key


@functools.cache
def _client() -> Any:
    try:
        from google.cloud import storage
    except ImportError as e:
        raise ConfigError(
            "gs:// directories need google-cloud-storage and gcsfs: pip install 'jaxckpt[gcs]'"
        ) from e
    # STORAGE_EMULATOR_HOST (an emulator) is honoured by the client itself.
    return storage.Client()

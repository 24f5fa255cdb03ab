"""What differs between a local directory and object storage (`gs://bucket/prefix`).

Object stores have no rename (a "rename" copies every object), no advisory locks, and an
object appears whole or not at all. Modules that must act differently ask `is_remote`;
`gcs_blob` gives the google-cloud-storage handle for the few operations epath lacks
(conditional writes for the writer lease).
"""

from __future__ import annotations

import functools
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
    protocol, _, root = str(directory).partition("://")
    kinds: dict[str, str] = {}
    for entry in fsspec.filesystem(protocol).ls(root, detail=True):
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


def files_below(root: Any) -> Iterator[Any]:
    """Every file below `root`, a listing per folder (links are followed: for object
    storage, which has none, and folders Orbax wrote)."""
    stack = [root]
    while stack:
        for path in stack.pop().iterdir():
            if path.is_dir():
                stack.append(path)
            else:
                yield path


def open_inside(root: Any, rel: str) -> Any:
    """Opens the file `root/rel` for reading. Locally it goes down one folder at a time
    without following a link, and opens only a regular file: a folder swapped for a link
    cannot lead out of `root`, nor a FIFO swapped in block the reader (OSError otherwise)."""
    if is_remote(root):
        return (root / rel).open("rb")
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

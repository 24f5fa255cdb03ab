"""The files of a local part on the wire between peers (`jaxckpt._peers`' protocol): each
sent whole, or, where the holder keeps a copy of an earlier step of the same owner, only
its blocks that changed since.

A file is listed as [rel, size, xxh3_128 hex] and is checked against it as it arrives.
Its blocks are its BLOCK_BYTES-long runs of bytes (the last one shorter), each with its own
XXH3-128. A part's unchanged pieces sit at the same offsets step after step (the same
leaves, shards and order: `jaxckpt._packed`), so a frozen base's blocks are the same bytes
as in the last copy sent. The sender keeps the block digests of the last part a holder
took, and then sends each file as ranges of blocks: `send[rel]`, [[first, stop], ...]; the
holder takes every other block from its copy of that earlier step (`base`), at the same
offset. Two different blocks share a digest with probability about 2^-128 (the manifest's
own odds), and the file the holder puts together is checked against the whole file's
digest, as a file sent whole is.
"""

from __future__ import annotations

import os
import re
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import xxhash

from jaxckpt._replicas import folder as _folder
from jaxckpt._replicas import fsync_folder
from jaxckpt._storage import open_inside

BLOCK_BYTES = 128 * 2**10  # the unit a changed file is sent in
_CHUNK = 8 * 2**20
_MAX_FILES = 4096
_REL = re.compile(r"[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)*")

Ranges = list[list[int]]  # [[first block, stop block], ...], sorted, apart


class PeerError(Exception):
    """A transfer with a peer failed (its message says which and why)."""


def files_of(folder: Path) -> tuple[list[list], dict[str, list[int]]]:
    """Every file below `folder`: [rel, size, xxh3_128 hex] each, sorted, and each one's
    block digests; PeerError at a link or a special file."""
    out, blocks, stack = [], {}, [""]
    while stack:
        below = stack.pop()
        with os.scandir(folder / below) as entries:
            for entry in entries:
                rel = f"{below}/{entry.name}" if below else entry.name
                if entry.is_dir(follow_symlinks=False):
                    stack.append(rel)
                elif entry.is_file(follow_symlinks=False):
                    size, digest, blocks[rel] = _hashed(folder, rel)
                    out.append([rel, size, digest])
                else:
                    raise PeerError(f"{rel} is a link or a special file: it is never sent")
    return sorted(out), blocks


def _hashed(folder: Path, rel: str) -> tuple[int, str, list[int]]:
    whole, size, blocks = xxhash.xxh3_128(), 0, []
    with open_inside(folder, rel) as f:
        while block := f.read(BLOCK_BYTES):
            whole.update(block)  # (releases the GIL)
            blocks.append(xxhash.xxh3_128_intdigest(block))
            size += len(block)
    return size, whole.hexdigest(), blocks


def changed(before: dict[str, list[int]], now: dict[str, list[int]]) -> dict[str, Ranges]:
    """The blocks of each file `now` that differ from the same file's `before` (all of a
    file that was not there)."""
    out = {}
    for rel, digests in now.items():
        old = before.get(rel, [])
        flags = [i >= len(old) or old[i] != d for i, d in enumerate(digests)]
        ranges: Ranges = []
        for i, differs in enumerate(flags):
            if differs and ranges and ranges[-1][1] == i:
                ranges[-1][1] = i + 1
            elif differs:
                ranges.append([i, i + 1])
        out[rel] = ranges
    return out


def checked_files(files: Any) -> list[tuple[str, int, str]]:
    """A peer's list of files, refused unless every path stays inside the folder."""
    if not isinstance(files, list) or len(files) > _MAX_FILES:
        raise PeerError("a list of files that is not one")
    out = []
    for entry in files:
        if not (isinstance(entry, list) and len(entry) == 3):
            raise PeerError("a file entry that is not [path, size, hash]")
        rel, size, digest = entry
        if not (isinstance(rel, str) and _REL.fullmatch(rel) and ".." not in rel.split("/")):
            raise PeerError(f"a file path outside the folder: {str(rel)[:100]!r}")
        if not (type(size) is int and size >= 0 and isinstance(digest, str)):
            raise PeerError(f"{rel}: a size or hash that is not one")
        out.append((rel, size, digest))
    return out


def checked_delta(delta: Any, files: list[tuple[str, int, str]], step: int) -> tuple:
    """A put's `delta` ({base, block, send}) as (base step, block bytes, send), refused
    unless its base is an earlier step and `send` gives each file's blocks as ordered
    ranges within it."""
    if not isinstance(delta, dict):
        raise PeerError("a delta that is not one")
    base, block, send = delta.get("base"), delta.get("block"), delta.get("send")
    if not (type(base) is int and 0 <= base < step):
        raise PeerError(f"a delta against step {str(base)[:20]}, not one before {step}")
    if block != BLOCK_BYTES:
        raise PeerError(f"a delta in blocks of {str(block)[:20]} bytes, not {BLOCK_BYTES}")
    if not isinstance(send, dict) or set(send) != {rel for rel, _, _ in files}:
        raise PeerError("a delta that does not name each file's blocks")
    for rel, size, _ in files:
        ranges, after = send[rel], 0
        if not isinstance(ranges, list):
            raise PeerError(f"{rel}: blocks that are not ranges")
        for pair in ranges:
            if not (
                isinstance(pair, list) and len(pair) == 2 and all(type(i) is int for i in pair)
            ):
                raise PeerError(f"{rel}: blocks that are not ranges")
            if not after <= pair[0] < pair[1] <= _blocks(size):
                raise PeerError(f"{rel}: blocks out of order or past its {size} bytes")
            after = pair[1]
    return base, block, send


def _blocks(size: int) -> int:
    return -(-size // BLOCK_BYTES)


def send_file(conn: Any, folder: Path, rel: str, size: int, ranges: Ranges | None = None) -> None:
    """`rel`'s bytes (of these blocks; None: all of it) onto the connection."""
    with open_inside(folder, rel) as f:
        for first, stop in ranges if ranges is not None else [[0, _blocks(size)]]:
            at = first * BLOCK_BYTES
            count = min(stop * BLOCK_BYTES, size) - at
            if count > 0 and conn.sendfile(f, at, count) != count:
                raise PeerError(f"{rel} changed while it was sent")


def receive_files(
    conn: Any, dest: Path, files: list, base: Path | None = None, send: dict | None = None
) -> int:
    """The files' bytes from `conn` into the empty folder `dest`, each checked and fsynced;
    no link followed (a file or folder there already is an error). With a `base` folder
    (the holder's copy of the delta's base step), each file's blocks not in `send` are that
    file's bytes there. Returns the bytes received."""
    received = 0
    for rel, size, digest in files:
        below, _, name = rel.rpartition("/")
        ranges = send[rel] if send is not None else [[0, _blocks(size)]]
        kept = sum(b - a for a, b in ranges) < _blocks(size)
        with _folder(dest, below, create=True) as at:
            h = xxhash.xxh3_128()
            fd = os.open(at / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
            with open(fd, "wb") as f, _opened(base, rel) if kept else nullcontext() as old:
                done = 0
                for first, stop in [*ranges, [_blocks(size), _blocks(size)]]:
                    keep = min(first * BLOCK_BYTES, size) - done * BLOCK_BYTES
                    if keep > 0 and old is not None:  # the base's bytes, at the same offset
                        old.seek(done * BLOCK_BYTES)
                        short = f"{rel}: the copy of the delta's base step is shorter than it was"
                        _pump(old.read, f, h, keep, short)
                    count = min(stop * BLOCK_BYTES, size) - first * BLOCK_BYTES
                    _pump(conn.recv, f, h, count, f"the peer closed the connection during {rel}")
                    received, done = received + max(count, 0), stop
                f.flush()
                os.fsync(f.fileno())
            fsync_folder(at)
        if h.hexdigest() != digest:
            raise PeerError(f"{rel} arrived changed (checksum mismatch)")
    return received


def _opened(base: Path | None, rel: str) -> Any:
    if base is None:
        raise PeerError(f"{rel}: blocks to keep, and no earlier copy to keep them from")
    try:
        return open_inside(base, rel)
    except FileNotFoundError:
        raise PeerError(f"{rel}: not in the copy of the delta's base step") from None


def _pump(read: Any, f: Any, h: Any, left: int, ended: str) -> None:
    """`left` bytes from `read` (a file's, the connection's) into the new file, hashed;
    PeerError(`ended`) where they end before."""
    while left > 0:
        chunk = read(min(left, _CHUNK))
        if not chunk:
            raise PeerError(ended)
        h.update(chunk)
        f.write(chunk)
        left -= len(chunk)

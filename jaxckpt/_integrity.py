"""Integrity manifests: a checksum of every file of a step, written inside the commit.

Just before Orbax renames a finished step into place (its `post_finalization_callback`,
after every item is written on every process), process 0 writes `jaxckpt/manifest.json`,
the size and xxHash XXH3-128 (python-xxhash) of every file of the step: in a job of
several processes each hashed the files it wrote (`process_files`, `jaxckpt._orbax`),
process 0 the rest. So a committed step always carries its manifest, and `verify` can tell
exactly which file is missing, truncated or changed. Orbax's two commit files are left out:
Orbax itself rewrites them during the rename, after the manifest.

A restore reads each byte once. The manifest lists the files whose every byte a read checks
itself (`read_checked`): the arrays' data files (zarr3 chunks, each with a CRC-32C that
tensorstore checks as it decodes the chunk, `_internals.hold`) and the packed leaves'
files (each piece with its XXH3-64 in the index, `jaxckpt._packed`). A restore hashes only
the other, small files; a read that fails then has the whole step hashed, to name the file
that does not match. `verify` hashes every file.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import io
import json
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import xxhash
from etils import epath

from jaxckpt import _layout
from jaxckpt._storage import files_below, is_remote, open_inside, read_small, sizes_below
from jaxckpt._store_errors import storage_error, store_failed
from jaxckpt.errors import CorruptCheckpointError, RestoreError

HASH = "xxh3_128"
_CHUNK = 8 * 2**20
_LOCAL_CHUNK = 2**20


@dataclasses.dataclass(frozen=True)
class StepReport:
    """The result of verifying one step: the files checked and their bytes (of a step
    plain Orbax wrote: the arrays read and theirs)."""

    step: int
    files: int
    bytes: int
    problems: tuple[str, ...]
    # False for a step plain Orbax wrote: it has no manifest, so its arrays were read
    # whole instead (every chunk readable, as Orbax's metadata records it), not checked.
    checksummed: bool = True

    @property
    def ok(self) -> bool:
        """Whether the step verified: no problem found."""
        return not self.problems


def _listing(root: epath.Path) -> tuple[list[str], list[str]]:
    """The relative paths of every regular file below `root` (the manifest and Orbax's
    commit files excluded), and what else is there that jaxckpt never reads: symbolic links
    (which could lead out of the directory) and special files (a FIFO blocks a reader)."""
    if is_remote(root):  # object storage: no links, no special files
        files = sorted(str(p.relative_to(root)) for p in files_below(root))
        return [f for f in files if in_manifest(f)], []
    files, odd, stack = [], [], [""]
    while stack:
        folder = stack.pop()
        with os.scandir(os.path.join(root, folder)) as entries:
            for entry in sorted(entries, key=lambda e: e.name):
                rel = f"{folder}/{entry.name}" if folder else entry.name
                if entry.is_symlink():
                    odd.append(f"{rel}: a symbolic link (jaxckpt reads nothing through a link)")
                elif entry.is_dir(follow_symlinks=False):
                    stack.append(rel)
                elif entry.is_file(follow_symlinks=False):
                    files.append(rel)
                else:
                    odd.append(f"{rel}: not a regular file (a FIFO, socket or device)")
    return [f for f in files if in_manifest(f)], odd


def in_manifest(rel: str) -> bool:
    """Whether a step's file `rel` is one its manifest lists (all but the manifest itself
    and Orbax's two commit files, which Orbax rewrites as it commits)."""
    return rel not in _layout.ORBAX_COMMIT_FILES and rel != _layout.MANIFEST_PATH


def unsafe_entries(step_dir: epath.Path) -> list[str]:
    """The links and special files in a local step folder (the folder itself a link too),
    which a reader must refuse before Orbax or tensorstore opens anything there."""
    if is_remote(step_dir):
        return []
    if os.path.islink(step_dir):
        return [f"{step_dir.name}: the step folder is a symbolic link"]
    return _listing(step_dir)[1]


def hasher() -> Any:
    """A new hash of the manifest's kind (`HASH`): `update(bytes)`, then `hexdigest()`, for
    a file hashed as it is written (`_packed.write`), never read back."""
    return xxhash.xxh3_128()


def digest(root: epath.Path, rel: str, expected: int | None = None) -> tuple[int, str]:
    """The size and XXH3-128 hex digest of the file `root/rel` (opened without links); of
    a file not `expected` bytes long, its size and no digest (none of it is read)."""
    h, size = hasher(), 0
    with open_inside(root, rel) as f:
        local = isinstance(f, io.BufferedReader)
        if local and expected is not None and (found := os.fstat(f.fileno()).st_size) != expected:
            return found, ""
        for chunk in _chunks(f):
            h.update(chunk)  # releases the GIL: hashing does not stall the training thread
            size += len(chunk)
    return size, h.hexdigest()


def _chunks(f: Any) -> Iterator[Any]:
    """An open file's bytes: an object `_CHUNK` at most a request; a local file read into one
    buffer of _LOCAL_CHUNK at most (a new 8 MiB bytes object a read cost twice the CPU: 0.20
    against 0.12 s for a 1 GiB step, most of a save's hashing; a buffer the size of a core's
    cache, hashed while it is there, another 12%: 64 MiB in 12.2 ms, not 13.9)."""
    if not isinstance(f, io.BufferedReader):
        while chunk := f.read(_CHUNK):
            yield chunk
        return
    buffer = memoryview(bytearray(min(_LOCAL_CHUNK, os.fstat(f.fileno()).st_size) or 1))
    while n := f.readinto(buffer):
        yield buffer[:n]


def _pool() -> concurrent.futures.ThreadPoolExecutor:
    """Files are hashed in parallel: reading and xxh3 both release the GIL."""
    return concurrent.futures.ThreadPoolExecutor(min(8, os.cpu_count() or 1), "jaxckpt-hash")


def checked_on_read(rel: str) -> bool:
    """Whether a read checks every byte of the step's file `rel` itself, as a step saved
    with chunk checksums (`write_manifest(..., read_checked=True)`) holds it: an OCDBT data
    file of an item of arrays (`<item>/[ocdbt.process_<i>/]d/<name>`: its chunks' and
    nodes' checksums), or a packed file of bytes (its pieces' digests)."""
    parts = rel.split("/")
    if parts[0] == _layout.PACKED:
        return len(parts) == 2 and parts[1].endswith(".bin")
    return parts[0] in _layout.ITEMS and len(parts) >= 3 and parts[-2] == "d"


def digests(root: epath.Path, rels: list[str]) -> dict[str, tuple[int, str]]:
    """The size and digest of each file `root/rel`, hashed in parallel."""
    with _pool() as pool:
        return dict(zip(rels, pool.map(lambda rel: digest(root, rel), rels), strict=True))


def process_files(step_dir: epath.Path, process: int, count: int) -> dict[str, str]:
    """The files of a step that only `process` (of `count`) writes, each by its path in
    the committed step and where it is now, relative to the step's folder (Orbax writes an
    item into `<item>.orbax-checkpoint-tmp/` and renames it when the step is finalized):
    in each item of arrays its OCDBT folder and its array metadata (Orbax's names), its
    packed pieces and their index, its data-iterator files. The rest of a step (the items'
    tree metadata and merged OCDBT roots, jaxckpt's own files) process 0 writes."""
    own = {
        item: [f"ocdbt.process_{process}/", f"array_metadatas/process_{process}"]
        for item in _layout.ITEMS
    }
    own[_layout.PACKED] = list(_layout.packed_files(process, count))
    own[_layout.DATA] = [
        _layout.data_file(kind, process, count) for kind in ("process", "iterator")
    ]
    found: dict[str, str] = {}
    for item, names in own.items():
        folder = next(
            (f for f in (item + _layout.TMP_SUFFIX, item) if (step_dir / f).is_dir()), None
        )
        for name in names if folder else ():
            path = step_dir / folder / name
            if name.endswith("/"):
                below = (
                    [str(p.relative_to(step_dir / folder)) for p in files_below(path)]
                    if path.is_dir()
                    else []
                )
            else:
                below = [name] if path.is_file() else []
            found |= {f"{item}/{rel}": f"{folder}/{rel}" for rel in below}
    return found


def write_manifest(
    step_dir: epath.Path,
    *,
    read_checked: bool = False,
    hashed: Mapping[str, tuple[int, str]] | None = None,
) -> None:
    """The manifest of every file of a step; `read_checked`: its arrays were written with
    chunk checksums and its packed pieces with digests, so that the files a read checks
    itself (`checked_on_read`) are listed as such. `hashed`: the size and digest of files
    already hashed where they were written (`digests`, on each process of a job); the
    other files are hashed here."""
    rels, odd = _listing(step_dir)
    if odd:  # never written by Orbax: something else wrote into the step being saved
        raise OSError(f"{step_dir} holds what no save writes: {'; '.join(odd)}")
    hashed = hashed or {}
    known = {rel: tuple(hashed[rel]) for rel in rels if rel in hashed}
    known |= digests(step_dir, [rel for rel in rels if rel not in known])
    files = {rel: {"size": known[rel][0], HASH: known[rel][1]} for rel in rels}
    doc: dict[str, Any] = {
        "format": 1,
        "hash": f"{HASH} (python-xxhash {xxhash.VERSION})",
        "files": files,
    }
    if read_checked:
        doc["read_checked"] = [rel for rel in rels if checked_on_read(rel)]
    (step_dir / _layout.META_DIR).mkdir(exist_ok=True)
    (step_dir / _layout.MANIFEST_PATH).write_text(json.dumps(doc, indent=1, sort_keys=True))


Progress = Callable[[int, int, int], None]  # (step, bytes checked, bytes to check)


def verify_step(
    step_dir: epath.Path,
    step: int,
    *,
    share: tuple[int, int] = (0, 1),
    progress: Progress | None = None,
    unread: bool = False,
    stop: threading.Event | None = None,
) -> StepReport:
    """Checks every file of a step against its manifest; never raises for bad data. A
    store that fails a read (does not answer, sheds load past its retries) is raised as
    `StorageError`: what it did not return says nothing of the files.

    `share=(i, n)` checks only every n-th listed file starting at i, so that n processes
    verify a step together, each reading a part of it. `progress` is called after each file.
    `unread`: only the files a read does not check itself (the manifest's `read_checked`
    left out, their presence still checked): what a restore hashes before it reads.
    `stop`: once set, no file more is read (the report is then of no use).
    """
    try:
        listed, read_checked = read_manifest(step_dir)
    except FileNotFoundError:
        return StepReport(step, 0, 0, (f"{_layout.MANIFEST_PATH} is missing",))
    except (OSError, ValueError) as e:
        _raise_if_the_store_failed(step_dir, e)
        return StepReport(step, 0, 0, (f"{_layout.MANIFEST_PATH} is unreadable: {e}",))
    problems, total = [], 0
    # on object storage each object's size, from the listing: one of another size is not
    # read to be hashed (a local file's is learnt as it is opened: `digest`)
    listed_sizes = sizes_below(step_dir) if is_remote(step_dir) else {}
    files, odd = (
        ([f for f in sorted(listed_sizes) if in_manifest(f)], [])
        if listed_sizes
        else _listing(step_dir)
    )
    present = set(files)
    hashed = {r: e for r, e in listed.items() if not (unread and r in read_checked)}
    mine = sorted(hashed.items())[share[0] :: share[1]]
    to_check = sum(e["size"] for _, e in mine)

    def check(item: tuple[str, dict[str, Any]]) -> tuple[int, str | None]:
        rel, expected = item
        if stop is not None and stop.is_set():
            return 0, None
        if rel not in present:
            return 0, f"{rel}: missing"
        if listed_sizes.get(rel, expected["size"]) != expected["size"]:
            size = listed_sizes[rel]
            return size, f"{rel}: {size} bytes, {expected['size']} expected (truncated or grown)"
        try:
            size, found = digest(step_dir, rel, expected["size"])
        except OSError as e:
            _raise_if_the_store_failed(step_dir, e)
            return 0, f"{rel}: unreadable ({e.strerror or e})"
        if size != expected["size"]:
            return size, f"{rel}: {size} bytes, {expected['size']} expected (truncated or grown)"
        if found != expected[HASH]:
            return size, f"{rel}: contents changed (checksum mismatch)"
        return size, None

    with _pool() as pool:
        for size, problem in pool.map(check, mine):  # in order: the problems stay sorted
            total += size
            if problem is not None:
                problems.append(problem)
            if progress is not None:
                progress(step, total, to_check)
    if progress is not None:
        progress(step, to_check, to_check)
    if share[0] == 0:
        problems += odd
        problems += [f"{rel}: not in the manifest" for rel in sorted(present - set(listed))]
        problems += [f"{rel}: missing" for rel in sorted(set(listed) - set(hashed) - present)]
    return StepReport(step, len(listed), total, tuple(problems))


def _raise_if_the_store_failed(step_dir: epath.Path, error: BaseException) -> None:
    """`error` raised as the `StorageError` it is where the step's store failed the read."""
    if (failed := storage_error(step_dir, error, "verifying a step")) is not None:
        raise failed from error


def read_manifest(step_dir: epath.Path) -> tuple[dict[str, dict[str, Any]], frozenset[str]]:
    """The manifest's `files`, each entry checked (ValueError naming the first bad field),
    and those of them a read checks itself (`read_checked`)."""
    text = read_small(step_dir, _layout.MANIFEST_PATH)
    try:
        doc = json.loads(text)
    except RecursionError:
        raise ValueError("nested too deeply") from None
    files = doc.get("files") if isinstance(doc, dict) else None
    if not isinstance(files, dict):
        raise ValueError("'files' is not an object")
    for rel, entry in files.items():
        if not isinstance(entry, dict):
            raise ValueError(f"files[{rel!r}] is not an object")
        size = entry.get("size")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ValueError(f"files[{rel!r}].size is not a byte count")
        if not isinstance(entry.get(HASH), str):
            raise ValueError(f"files[{rel!r}].{HASH} is not a hex digest")
    read_checked = doc.get("read_checked", [])
    if not isinstance(read_checked, list) or not all(
        isinstance(rel, str) and rel in files and checked_on_read(rel) for rel in read_checked
    ):
        raise ValueError("'read_checked' is not a list of the data files it names")
    return files, frozenset(read_checked)


@contextlib.contextmanager
def verified_while_reading(
    directory: epath.Path,
    step: int,
    folder: epath.Path,
    *,
    verify: bool = True,
    unread: bool = False,
) -> Iterator[Callable[[], None]]:
    """Around a read of a step (restore, export): links and special files are refused before
    the body runs, and Orbax or tensorstore opens anything. With `verify`, the step's files
    are hashed in a worker thread while the body reads, and the `check()` yielded raises
    CorruptCheckpointError unless they match the manifest (waiting for the hashing); it also
    runs when the body leaves, and first when it fails: corruption explains a failed read.
    `unread`: the body reads every array it needs, so only the files a read does not check
    itself are hashed (`verify_step`), and a read that fails (`explains`) has them all
    hashed. `folder`: the step's folder (`OrbaxStore.step_dir`; a step Orbax wrote may be
    named otherwise than `<directory>/<step>`)."""
    if problems := unsafe_entries(folder):
        raise CorruptCheckpointError(step, problems, str(directory))
    if not verify:
        yield lambda: None
        return
    stop = threading.Event()
    pool = concurrent.futures.ThreadPoolExecutor(1, "jaxckpt-verify")
    report: concurrent.futures.Future[StepReport] | None = None

    def check() -> None:
        assert report is not None
        if problems := report.result().problems:
            raise CorruptCheckpointError(step, problems, str(directory))

    try:
        # Submitted inside the try: a KeyboardInterrupt (Ctrl-C) that lands while submit()
        # starts the pool's thread leaves a thread the pool does not count yet, which only
        # the shutdown below wakes; without it the process could never exit.
        report = pool.submit(verify_step, folder, step, unread=unread, stop=stop)
        try:
            yield check
        except Exception as e:
            if store_failed(directory, e):
                # The store failed the read (it did not answer, ...): what hashing on it
                # would find says nothing of the files. It stops after the request in
                # flight, and is not waited for.
                stop.set()
                raise
            check()
            if unread and explains(e) and (found := verify_step(folder, step).problems):
                raise CorruptCheckpointError(step, found, str(directory)) from e
            raise
        check()
    finally:
        pool.shutdown(wait=not stop.is_set())


def explains(error: BaseException) -> bool:
    """Whether a damaged file could explain a read's failure (a read error, or what was
    read not being what jaxckpt writes), so that hashing the step may name the file."""
    return isinstance(error, RestoreError | CorruptCheckpointError)

"""The local tier's copies' folder, `replicas/<owner>/<step>/` in each process's local
directory, and the folders beside it: read and changed without following a link. Every
folder is opened one at a time with O_NOFOLLOW (as `_storage.open_inside` opens files),
then used through `/proc/self/fd/<fd>`, which names the folder opened, not its path; a link
where a folder should be is refused. `jaxckpt._peers` fills it; `jaxckpt._local` lists,
sweeps and drops what it holds."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
from collections.abc import Iterator, Set
from pathlib import Path

from jaxckpt import _layout

log = logging.getLogger("jaxckpt")

REPLICAS = "replicas"
TMP_SUFFIX = ".jaxckpt-tmp"  # a folder being written (a part, or a copy received)
_FOLDER = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW


@contextlib.contextmanager
def folder(root: Path, rel: str, *, create: bool = False) -> Iterator[Path]:
    """The folder `root/rel`, reached one folder at a time without following a link (the
    missing ones made, with `create`), as a path naming the folder opened (`/proc/self/fd/N`,
    where there is one): a link swapped in later cannot redirect what is done through it.
    OSError: ELOOP or ENOTDIR at a link or a file on the way."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for name in filter(None, rel.split("/")):
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, dir_fd=fd)
            try:
                inner = os.open(name, _FOLDER, dir_fd=fd)
            except OSError as e:
                if e.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                where = os.path.join(root, rel)
                raise OSError(
                    e.errno,
                    f"{name} in {where} is a link or not a folder (jaxckpt follows no link "
                    "in its local directory: remove it)",
                ) from None
            os.close(fd)
            fd = inner
        pinned = Path(f"/proc/self/fd/{fd}")
        yield pinned if pinned.is_dir() else Path(root, rel)
    finally:
        os.close(fd)


def steps_in(folder: Path) -> list[int]:
    """The step folders (no link) in `folder`, oldest first."""
    with os.scandir(folder) as entries:
        steps = [_layout.step_of(e.name) for e in entries if e.is_dir(follow_symlinks=False)]
    return sorted(s for s in steps if s is not None)


def copies(root: Path) -> dict[int, list[int]]:
    """The copies kept in `root`: {owner: [step, ...]}, oldest first. A link where a folder
    should be is passed over (logged)."""
    found: dict[int, list[int]] = {}
    try:
        with folder(root, REPLICAS) as replicas, os.scandir(replicas) as entries:
            owners = [(e.name, _layout.step_of(e.name)) for e in entries]
            for name, owner in owners:
                if owner is None:
                    continue
                try:
                    with folder(replicas, name) as at:
                        found[owner] = steps_in(at)
                except OSError as e:
                    log.warning("local tier: copies passed over: %s", e.strerror or e)
    except FileNotFoundError:
        pass
    except OSError as e:  # unreadable: `LocalStore.steps` says so
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            log.warning("local tier: copies passed over: %s", e.strerror or e)
    return found


def drop_copies(root: Path, step: int, *, keep: Set[tuple[int, int]] = frozenset()) -> None:
    """Deletes the copies in `root` of steps from `step` on, but those in `keep`."""
    for owner, steps in copies(root).items():
        doomed = [s for s in steps if s >= step and (owner, s) not in keep]
        if doomed:
            with folder(root, f"{REPLICAS}/{owner}") as at:
                for s in doomed:
                    log.info("local tier: deleting process %d's copy of step %d", owner, s)
                    discard(at / str(s))


def sweep(root: Path) -> None:
    """Deletes what a save killed mid-write, a deletion that never finished or a copy half
    received left behind in `root` (best effort: what cannot be read is left as it is)."""
    leftovers = (TMP_SUFFIX, _layout.DELETING_SUFFIX)
    for rel in ["", *(f"{REPLICAS}/{owner}" for owner in copies(root))]:
        with contextlib.suppress(OSError), folder(root, rel) as at:
            for name in os.listdir(at):
                if name.endswith(leftovers):
                    _remove(at / name)


def discard(folder: Path) -> None:
    """Removes a part or a copy: renamed out of every listing first (a removal cut short
    leaves a `.jaxckpt-deleting` folder, swept at the next start), then deleted. A link is
    removed, never followed."""
    doomed = folder.with_name(folder.name + _layout.DELETING_SUFFIX)
    folder.rename(doomed)
    _remove(doomed)


def _remove(path: Path) -> None:
    if path.is_symlink():
        path.unlink()
    else:
        shutil.rmtree(path, ignore_errors=True)


def fsync_folder(path: Path) -> None:
    """Makes a folder's entries (a rename into it, a new file) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

"""Faults injected into real checkpoints, shared by the tests and the stress script.

Every corruption takes a checkpoint directory (a `pathlib.Path`, or an `epath.Path` on
object storage: `REMOTE_CORRUPTIONS`), damages step 2 in one way, and returns a regex that
`verify` and `restore` must report for it. `store` and `local_store` make the
storage of a tier fail or freeze where a test says, and `manager` opens a manager over
them: the manager's own seam (a subclass naming the classes that do each tier's storage
work), never a patch of jaxckpt's privates.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any


def stop_here() -> None:
    """Stops this process (SIGSTOP) before the calling thread does anything more: the
    signal goes to this thread, which stops the whole process as it returns. Sent to the
    process (`os.kill(os.getpid(), ...)`), the kernel wakes one thread to take it, the main
    one, and a background thread that sent it runs on until that thread is scheduled: on
    a loaded machine, Orbax's save thread reached the barrier before its commit first, and
    the step it was to stop before committed."""
    signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)


def manager(
    directory: Any, *, store: type | None = None, local_store: type | None = None, **options: Any
) -> Any:
    """A `jaxckpt.CheckpointManager(directory, **options)` whose persistent tier's storage
    work `store` does, and its local tier's `local_store` (each: jaxckpt's own, or a
    subclass of it: `store(...)`, `local_store(...)`, one that counts what it reads)."""
    import jaxckpt

    class Managed(jaxckpt.CheckpointManager):
        _store_class = store or jaxckpt.CheckpointManager._store_class
        _local_store_class = local_store or jaxckpt.CheckpointManager._local_store_class

    return Managed(directory, **options)


def store(**faults: Callable[..., Any]) -> type:
    """A `manager(store=...)` class: jaxckpt's persistent store, but each method
    named (`save`, `wait`, `read_arrays`, `before_commit`, `remove`, ...) runs
    `fault(real, *args)` instead, `real` being the store's own method (to call, or not)."""
    from jaxckpt._orbax import OrbaxStore

    return _faulty(OrbaxStore, faults)


def local_store(**faults: Callable[..., Any]) -> type:
    """A `manager(local_store=...)` class: `store`'s, for the local tier
    (`save`, `wait`, `write_part`, ...)."""
    from jaxckpt._local import LocalStore

    return _faulty(LocalStore, faults)


def _faulty(base: type, faults: dict[str, Callable[..., Any]]) -> type:
    unknown = sorted(n for n in faults if not callable(getattr(base, n, None)))
    if unknown:
        raise TypeError(f"{base.__name__} has no method {', '.join(unknown)} to fault")

    def method(name: str, fault: Callable[..., Any]) -> Callable[..., Any]:
        real = getattr(base, name)
        return lambda self, *args, **kw: fault(functools.partial(real, self), *args, **kw)

    return type(f"Faulty{base.__name__}", (base,), {n: method(n, f) for n, f in faults.items()})


def largest_data_file(step_dir: Any, within: tuple[str, ...] = ("state", "packed")) -> Any:
    """The step's largest file of array data: an Orbax array's, or a process's packed
    small leaves (format 2); `within`: of those folders of the step only."""
    from jaxckpt._storage import files_below  # (on object storage: one listing, no glob)

    folders = [step_dir / d for d in within if (step_dir / d).exists()]
    return max((p for folder in folders for p in files_below(folder)), key=size)


def size(f: Any) -> int:
    """A file's size, on local disk or object storage (an epath's stat says `length`)."""
    found = f.stat()
    return found.st_size if isinstance(f, Path) else found.length


def flip_middle_byte(f: Any) -> None:
    """One bit of the file's middle byte flipped (an object: rewritten so)."""
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01
    f.write_bytes(bytes(data))


def truncate(d: Any) -> str:
    f = largest_data_file(d / "2")
    f.write_bytes(f.read_bytes()[: size(f) // 2])
    return f"{f.relative_to(d / '2')}: .*truncated"


def flip_byte(d: Any) -> str:
    f = largest_data_file(d / "2")
    flip_middle_byte(f)
    return f"{f.relative_to(d / '2')}: contents changed"


def delete_file(d: Any) -> str:
    f = largest_data_file(d / "2")
    f.unlink()
    return f"{f.relative_to(d / '2')}: missing"


def garbage_metadata(d: Any) -> str:
    (d / "2" / "jaxckpt" / "jaxckpt.json").write_text("{not json")
    # (a listing reads the newest step's jaxckpt.json: found unreadable, the step is damaged)
    return "jaxckpt/jaxckpt.json(: (contents changed|.*truncated or grown)| is unreadable)"


def missing_metadata(d: Any) -> str:
    (d / "2" / "jaxckpt" / "jaxckpt.json").unlink()
    return "jaxckpt/jaxckpt.json is missing"


def swollen_manifest(d: Path) -> str:
    """The manifest made a 1.5 GiB sparse file (4 KiB of disk): refused by its size."""
    os.truncate(d / "2" / "jaxckpt" / "manifest.json", 3 * 2**29)
    return r"jaxckpt/manifest.json is unreadable: 1,610,612,736 bytes, over the"


def empty_step(d: Path) -> str:
    shutil.rmtree(d / "2")
    (d / "2").mkdir()
    return "empty step directory"


def manifest_mismatch(d: Any) -> str:
    path = d / "2" / "jaxckpt" / "manifest.json"
    manifest = json.loads(path.read_text())
    name = sorted(manifest["files"])[0]
    manifest["files"][name]["xxh3_128"] = "0" * 32
    path.write_text(json.dumps(manifest))
    return f"{name}: contents changed"


CORRUPTIONS = {
    "truncated data file": truncate,
    "one flipped byte": flip_byte,
    "deleted data file": delete_file,
    "garbage metadata JSON": garbage_metadata,
    "missing metadata JSON": missing_metadata,
    "empty step directory": empty_step,
    "swollen manifest": swollen_manifest,
    "manifest that does not match": manifest_mismatch,
}
# On object storage: every one but the empty step folder (with no objects, a folder is not
# there at all: the step is simply gone) and the swollen manifest (1.5 GiB to upload; that
# a swollen object is never fetched is tests/test_bounded_reads.py's).
REMOTE_CORRUPTIONS = {
    k: v for k, v in CORRUPTIONS.items() if v not in (empty_step, swollen_manifest)
}

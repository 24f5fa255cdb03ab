"""The only module that talks to Orbax.

jaxckpt hands Orbax flat `{name: array}` dicts (see `jaxckpt.tree`) and small JSON documents;
everything about handlers, restore args and step directories stays in this file, so the Orbax
API (v0 `CheckpointManager` today) can be swapped without touching the rest.

One step on disk (Orbax writes it into `<step>.orbax-checkpoint-tmp` and renames it into place
when every item is written, so a step directory exists only once committed):

    <directory>/<step>/
        state/                      the state tree: tensorstore OCDBT, one entry per leaf name
        rng/                        PRNG keys as raw key data (only when rng= was given)
        data/process_<i>-of-<n>.json  each process's data-iterator state (only with data=)
        data/iterator_<i>-of-<n>.json what that iterator was (jaxckpt.iterators.describe)
        jaxckpt/jaxckpt.json        leaf specs, user meta, versions: marks a jaxckpt step
        jaxckpt/manifest.json       size + checksum of every file (see jaxckpt.integrity)
        _CHECKPOINT_METADATA, commit_success.txt   Orbax's own
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import json
import logging
import os
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from jaxckpt.errors import (
    CorruptCheckpointError,
    JaxckptError,
    NoCheckpointError,
    RestoreError,
    StepNotFoundError,
)
from jaxckpt.plan import read_batches
from jaxckpt.storage import absolute, is_remote, open_inside
from jaxckpt.tree import LeafSpec, ReadRequest

log = logging.getLogger("jaxckpt")


# --- Orbax's log noise (issue 15) ------------------------------------------------------
# Orbax logs through absl's logger: two warnings for every read-only manager, and a
# traceback per thread for a save that failed in the background, which jaxckpt raises
# itself as SaveError by the next save/wait/close. These known messages go to the debug
# log (`logging.getLogger("jaxckpt.orbax").setLevel(logging.DEBUG)` shows them); every
# other Orbax message passes unchanged.
_ORBAX_NOISE = re.compile(
    r"CheckpointManagerOptions\.read_only=True, setting save_interval_steps=0"
    r"|Given directory is read only="
    r"|Failed to run \d+ Handler Commit operations or the Commit callback in background"
    r"|_SignalingThread\.run\(\) raised an exception"
    r"|Save Finalize thread \(\w+\) failed"
    r"|Checkpointer failed: one or more items may not be finalized"
)
_orbax_debug_log = log.getChild("orbax")


def _demote_orbax_noise(record: logging.LogRecord) -> bool:
    """A filter on absl's logger: the known messages above are handed to jaxckpt.orbax's
    handlers at DEBUG level (if enabled there) instead of absl's; all else passes."""
    try:
        noise = bool(_ORBAX_NOISE.search(record.getMessage()))
    except Exception:  # a record whose arguments do not format: not ours to judge
        return True
    if not noise:
        return True
    if _orbax_debug_log.isEnabledFor(logging.DEBUG):
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        _orbax_debug_log.handle(record)
    return False


logging.getLogger("absl").addFilter(_demote_orbax_noise)
# --- end of Orbax's log noise -----------------------------------------------------------


# --- Orbax's and JAX's internals (issue 16) ---------------------------------------------
# Every use of a private Orbax name, or of text Orbax or JAX do not promise, is here and
# nowhere else; tests/test_orbax_boundary.py fails by name when an upgrade removes one.


def _wait_for_background_commit(mngr: ocp.CheckpointManager) -> None:
    """Waits for a step's commit that Orbax runs in the background. `wait_until_finished`
    waits only for the manager's finalize thread, which its save starts last: when that save
    failed after starting the commit (a barrier meeting a dead process), only the manager's
    checkpointer knows of the commit still running."""
    mngr._checkpointer.wait_until_finished()


def _array_metadata_store() -> Any:
    """Orbax's default store of per-host ArrayMetadata (PRNG key impls among them), which an
    `ArrayHandler` built by hand has only when given it."""
    from orbax.checkpoint._src.metadata import array_metadata_store

    return array_metadata_store.Store()


# Recorded (jax.monitoring) in Orbax's background save once this process's arrays of a step
# are written, before the barrier between processes and the commit.
_WRITES_DONE_EVENT = "/jax/checkpoint/write/async/commit_duration_sec"


@contextlib.contextmanager
def on_writes_done(callback: Callable[[], None]) -> Iterator[None]:
    """Calls `callback()` in the background save each time this process's arrays of a step
    are written, before its commit: where tests and reliability trials kill, freeze or
    fail a writer, at that moment for sure rather than by timing."""

    def listener(event: str, duration: float, **kwargs: Any) -> None:
        if event == _WRITES_DONE_EVENT:
            callback()

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def missing_processes(error: BaseException) -> list[int]:
    """The processes a multi-host barrier waited for in vain, as JAX's coordination service
    names them: after the barrier timeout, or after a dead task's heartbeat timeout."""
    text = str(error)
    found = re.search(r"timed out task names:\s*([\d\s,]+)", text)
    tasks = re.findall(r"\d+", found.group(1)) if found else []
    tasks += re.findall(r"Task (\d+) heartbeat timeout", text)
    return sorted({int(t) for t in tasks})


# --- end of Orbax's and JAX's internals -------------------------------------------------

STATE, RNG, DATA, INFO = "state", "rng", "data", "jaxckpt"
INFO_FILE = "jaxckpt.json"
FORMAT_VERSION = 1  # of jaxckpt.json
DATA_STATE_FILE = re.compile(r"process_(\d+)-of-(\d+)\.json")  # as _DataStateHandler names them
MAX_DATA_STATE_BYTES = 2**20  # what inspect --data reads of one
TMP_SUFFIX = ".orbax-checkpoint-tmp"  # where Orbax writes a step until it commits
REPLICA_PARALLEL_MIN_BYTES = 4 * 2**20
# Retention deletes in the background. On local disk the step folder is first renamed to
# `<step>.jaxckpt-deleting`; object storage has no rename (it copies every object), so a
# `<step>.jaxckpt-tombstone` object hides the step until its objects are gone.
DELETING_SUFFIX = ".jaxckpt-deleting"
TOMBSTONE_SUFFIX = ".jaxckpt-tombstone"
# OCDBT packs a process's writes into data files of about this size, written in parallel;
# without a target it writes one file at a time (2-3x slower, BENCHMARKS.md).
DATA_FILE_BYTES = 128 * 2**20


def step_of(name: str) -> int | None:
    """The step a folder name stands for: ASCII digits in canonical form (`12`, never `012`,
    `²` or `①`), which is how jaxckpt names step folders; None for any other name."""
    if not (name.isascii() and name.isdigit()) or (name != "0" and name.startswith("0")):
        return None
    return int(name)


class _DataStateHandler(ocp.CheckpointHandler):
    """Writes each process's data-iterator state to its own file, and beside it what the
    iterator was (`jaxckpt.iterators.describe`), checked at restore before any array is
    read. Per process, as the states are: each process's pipeline reads its own shard.

    The state files are named as grain's own Orbax handler names them
    (`process_<i>-of-<n>.json`), the descriptions `iterator_<i>-of-<n>.json`.
    """

    def save(self, directory: epath.Path, args: DataSave) -> None:
        self._path(directory).write_text(args.text)
        if args.about is not None:
            (directory / about_file()).write_text(args.about)

    def restore(self, directory: epath.Path, args: DataRestore | None = None) -> str:
        path = self._path(directory)
        if not path.exists():
            saved = sorted(p.name for p in directory.glob("process_*.json"))
            raise FileNotFoundError(
                f"no data-iterator state for this process ({path.name}); the step holds "
                f"{saved}. It was saved with a different number of processes."
            )
        return path.read_text()

    def metadata(self, directory: epath.Path) -> None:
        return None

    @staticmethod
    def _path(directory: epath.Path) -> epath.Path:
        return directory / f"process_{jax.process_index()}-of-{jax.process_count()}.json"


def about_file() -> str:
    """This process's iterator description, in the data item's folder."""
    return f"iterator_{jax.process_index()}-of-{jax.process_count()}.json"


@ocp.args.register_with_handler(_DataStateHandler, for_save=True)
@dataclasses.dataclass
class DataSave(ocp.args.CheckpointArgs):
    text: str
    about: str | None = None


@ocp.args.register_with_handler(_DataStateHandler, for_restore=True)
@dataclasses.dataclass
class DataRestore(ocp.args.CheckpointArgs):
    pass


class OrbaxStore:
    """Async saves and reads of jaxckpt steps through one Orbax `CheckpointManager`."""

    def __init__(
        self,
        directory: str | epath.PathLike,
        *,
        timeout_s: int = 1200,
        restore_inflight_bytes: int = 2**30,
        compression: str | None = None,
        read_only: bool = False,
        before_commit: Callable[[epath.Path], None] | None = None,
    ):
        """`before_commit(step_dir)` runs on process 0 once every item of a step is written
        on every process, just before the step is renamed into place (committed)."""
        self.directory = epath.Path(absolute(directory))
        self._before_commit = before_commit
        self._saving: int | None = None
        self._restore_inflight_bytes = restore_inflight_bytes
        # zstd saves ~7% of the bytes of float weights and halves the write rate
        # (BENCHMARKS.md); reading either kind back needs no option.
        arrays = ocp.PyTreeCheckpointHandler(
            use_compression=compression == "zstd", type_handler_registry=_registry()
        )
        if read_only and not self.directory.exists():
            raise NoCheckpointError(f"{self.directory} does not exist; nothing to read there")
        options = ocp.CheckpointManagerOptions(
            enable_async_checkpointing=not read_only,
            create=not read_only,
            read_only=read_only,
            # jaxckpt removes unfinished saves' leftovers itself (below), in its deleter.
            cleanup_tmp_directories=False,
            async_options=ocp.AsyncOptions(
                timeout_secs=timeout_s,
                post_finalization_callback=None if read_only else self._on_finalized,
                # The step's folders are made in save() itself. Made in the background,
                # each of Orbax's (non-daemon) writer threads waits for a "created" signal
                # for Orbax's own 300 s, not timeout_s, and a failed creation never sends
                # it: a process could not exit for five minutes after a failed save (or a
                # Ctrl-C inside one). Such a failure is now raised by save() at once.
                create_directories_asynchronously=False,
            ),
        )
        self._mngr = ocp.CheckpointManager(
            self.directory,
            options=options,
            item_handlers={
                STATE: arrays,
                RNG: arrays,
                DATA: _DataStateHandler(),
                INFO: ocp.JsonCheckpointHandler(filename=INFO_FILE),
            },
        )
        self._deleter = concurrent.futures.ThreadPoolExecutor(1, "jaxckpt-delete")
        self._leftovers: list[concurrent.futures.Future] = []
        if not read_only and jax.process_index() == 0:
            # In the background from start-up (a reader never deletes anything): saves that
            # never committed (a killed process), and deletions that never finished.
            self._leftovers = [
                self._deleter.submit(_remove, self.directory / name)
                for name in ocp.path.step.tmp_checkpoints(self.directory)
            ]
            for leftover in self.directory.glob(f"*{DELETING_SUFFIX}"):
                self._deleter.submit(_remove, leftover)
            for step in self._tombstoned():
                self._deleter.submit(self._remove_tombstoned, step)

    def committed_steps(self) -> list[int]:
        """Committed steps written by jaxckpt (Orbax-only or foreign directories are ignored)."""
        if not self.directory.exists():  # removed under a reader
            return []
        self._mngr.reload()  # re-read the directory: another process may have written
        hidden = self._tombstoned()
        return sorted(
            s
            for s in self._mngr.all_steps()
            if s not in hidden
            and (self.step_dir(s) / INFO / INFO_FILE).exists()
            and not (not is_remote(self.directory) and os.path.islink(self.step_dir(s)))
        )

    def resolve(self, step: int | None) -> int:
        """`step` if committed (None: the latest committed); jaxckpt's errors otherwise."""
        steps = self.committed_steps()
        if not steps:
            raise NoCheckpointError(f"no committed checkpoint in {self.directory}")
        if step is None:
            return steps[-1]
        if step not in steps:
            raise StepNotFoundError(step, steps, str(self.directory))
        return step

    def step_folder_exists(self, step: int) -> bool:
        """Whether anything (committed, foreign, or Orbax's own) sits at the step's path."""
        # On object storage an unfinished save sits at its step's path: its removal, started
        # at start-up, ends first (a failed one is logged, and the next writer tries again).
        concurrent.futures.wait(self._leftovers)
        return (self.directory / str(step)).exists()

    def save(
        self,
        step: int,
        *,
        state: Mapping[str, Any],
        rng: Mapping[str, Any],
        data: str | None,
        info: Mapping[str, Any],
        data_about: str | None = None,
    ) -> None:
        """Starts an async save; returns once device arrays are copied to host memory."""
        args: dict[str, Any] = {INFO: ocp.args.JsonSave(dict(info))}
        for item, arrays in ((STATE, state), (RNG, rng)):
            # Orbax refuses zero-size arrays; their specs are enough to remake them.
            arrays = {name: a for name, a in arrays.items() if a.size}
            if arrays:
                args[item] = ocp.args.PyTreeSave(
                    arrays, ocdbt_target_data_file_size=DATA_FILE_BYTES
                )
        if data is not None:
            args[DATA] = DataSave(data, data_about)
        self._saving = step
        self._mngr.save(step, args=ocp.args.Composite(**args), force=True)

    def _on_finalized(self) -> None:
        # Orbax calls this in its background thread after all items are finalized and
        # before it renames the step's temporary directory into place.
        if self._before_commit is None or self._saving is None or jax.process_index() != 0:
            return
        tmp = self.directory / f"{self._saving}{TMP_SUFFIX}"
        self._before_commit(tmp if tmp.exists() else self.step_dir(self._saving))

    def step_dir(self, step: int) -> epath.Path:
        return self.directory / str(step)

    def step_dirs(self) -> dict[int, epath.Path]:
        """Every step-named directory, committed or not jaxckpt's; never a save still in
        progress or cut off (on object storage such a save sits at its step's path)."""
        if not self.directory.exists():
            return {}
        hidden = self._tombstoned()
        if is_remote(self.directory):
            hidden |= set(self.uncommitted_steps())
        return {
            step: p
            for p in self.directory.iterdir()
            if (step := step_of(p.name)) is not None and step not in hidden and p.is_dir()
        }

    def uncommitted_steps(self) -> list[int]:
        """Steps whose save is in progress or never finished: Orbax's temporary folders
        (`<step>.orbax-checkpoint-tmp` on local disk; on object storage, step folders
        without Orbax's commit marker)."""
        if not self.directory.exists():
            return []
        names = (n.split(".")[0] for n in ocp.path.step.tmp_checkpoints(self.directory))
        return sorted(step for n in names if (step := step_of(n)) is not None)

    def wait(self) -> None:
        """Blocks until the in-flight save commits; raises its background error, once."""
        self._mngr.wait_until_finished()
        _wait_for_background_commit(self._mngr)

    def read_info(self, step: int) -> dict[str, Any]:
        """The step's jaxckpt.json, every field checked: CorruptCheckpointError naming the
        first one that is not what jaxckpt writes (FileNotFoundError if there is none). Read
        as the plain JSON file Orbax's JsonCheckpointHandler wrote, which costs no Orbax
        restore (and no barrier between processes)."""
        rel = f"{INFO}/{INFO_FILE}"
        try:
            return _check_info(self._read_json(step, rel))
        except ValueError as e:
            raise CorruptCheckpointError(
                step, [f"{rel} is unreadable: {e}"], str(self.directory)
            ) from None

    def _read_json(self, step: int, rel: str) -> Any:
        """A small JSON file of the step, opened without following links: FileNotFoundError
        if it is not there, CorruptCheckpointError naming it if it cannot be read."""
        try:
            with open_inside(self.step_dir(step), rel) as f:
                return json.loads(f.read())
        except FileNotFoundError:
            raise
        except (OSError, ValueError, RecursionError) as e:
            problem = "nested too deeply" if isinstance(e, RecursionError) else str(e)
            raise CorruptCheckpointError(
                step, [f"{rel} is unreadable: {problem}"], str(self.directory)
            ) from None

    def read_arrays(
        self, step: int, item: str, requests: Mapping[str, ReadRequest]
    ) -> dict[str, Any]:
        """Reads the named arrays of one item, each onto its sharding (or to the host)."""
        out = {name: _empty(r) for name, r in requests.items() if 0 in r.shape}
        to_read = {name: r for name, r in requests.items() if name not in out}
        # One Orbax restore per batch bounds the bytes in flight. (Orbax's own limiter,
        # restore_concurrent_gb, wakes every waiting leaf on each release: restoring
        # thousands of leaves under it took 2.5x longer.)
        for batch in read_batches(to_read, self._restore_inflight_bytes):
            args = ocp.args.PyTreeRestore(
                item={n: jax.ShapeDtypeStruct(to_read[n].shape, to_read[n].dtype) for n in batch},
                restore_args={n: _restore_args(to_read[n]) for n in batch},
                # read only the requested leaves, never the rest of the step
                partial_restore=True,
            )
            with _read_errors(step, item, self.directory):
                got = self._mngr.restore(step, args=ocp.args.Composite(**{item: args}))[item]
            for name in batch:
                _check_read(step, item, name, got.get(name), to_read[name], self.directory)
            out.update(got)
        return out

    def read_data_about(self, step: int) -> dict[str, Any] | None:
        """What this process's data iterator was at save (None: a step saved before jaxckpt
        recorded it, or by another number of processes); read as a plain file, before any
        array. CorruptCheckpointError when it is not what jaxckpt writes."""
        rel = f"{DATA}/{about_file()}"
        try:
            about = self._read_json(step, rel)
        except FileNotFoundError:
            return None
        if not (
            isinstance(about, dict)
            and isinstance(about.get("type"), str)
            and all(
                isinstance(about.get(k, []), list)
                and all(isinstance(e, str) for e in about.get(k, []))
                for k in ("state", "pipeline")
            )
            and isinstance(about.get("config", {}), dict)
        ):
            raise CorruptCheckpointError(
                step, [f"{rel} is not an iterator description"], str(self.directory)
            )
        return about

    def read_data_states(self, step: int, kind: str | None) -> list[dict[str, Any]]:
        """Every process's saved data-iterator state (`data/process_<i>-of-<n>.json`, for
        `jaxckpt inspect --data`), parsed when it is JSON (grain's states are), else the
        saved text; read as plain files (never through a link), at most 1 MiB each."""
        if kind is None:
            return []
        try:
            names = sorted(p.name for p in (self.step_dir(step) / DATA).iterdir())
        except FileNotFoundError:
            names = []
        found = sorted(
            (int(m[1]), int(m[2]), name) for name in names if (m := DATA_STATE_FILE.fullmatch(name))
        )
        if not found:
            raise CorruptCheckpointError(
                step, [f"{DATA}/ holds no process_<i>-of-<n>.json file"], str(self.directory)
            )
        states = []
        for process, processes, name in found:
            rel = f"{DATA}/{name}"
            try:
                with open_inside(self.step_dir(step), rel) as f:
                    raw = f.read(MAX_DATA_STATE_BYTES + 1)
            except OSError as e:
                problem = f"{rel} is unreadable: {e.strerror or e}"
                raise CorruptCheckpointError(step, [problem], str(self.directory)) from None
            if len(raw) > MAX_DATA_STATE_BYTES:
                problem = f"{rel} is over {MAX_DATA_STATE_BYTES:,} bytes: not a data-iterator state"
                raise CorruptCheckpointError(step, [problem], str(self.directory))
            text = raw.decode("utf-8", errors="replace")
            try:
                state = json.loads(text)
            except (ValueError, RecursionError):
                if kind == "json":
                    problem = f"{rel} is not JSON, but the step records a JSON state"
                    raise CorruptCheckpointError(step, [problem], str(self.directory)) from None
                state = text
            states.append({"process": process, "processes": processes, "state": state})
        return states

    def read_data_state(self, step: int) -> str:
        with _read_errors(step, DATA, self.directory):
            return self._mngr.restore(step, args=ocp.args.Composite(**{DATA: DataRestore()}))[DATA]

    def delete(self, step: int) -> None:
        """Removes a committed step from the listing now and deletes its files in the
        background (off the save's blocking path). On process 0: on local disk the step
        folder is renamed to `<step>.jaxckpt-deleting` (which no listing reads); on object
        storage one `<step>.jaxckpt-tombstone` object is written, which hides the step until
        its objects and then the tombstone are deleted."""
        if jax.process_index() == 0:
            if is_remote(self.directory):
                (self.directory / f"{step}{TOMBSTONE_SUFFIX}").write_bytes(b"")
                self._deleter.submit(self._remove_tombstoned, step)
            else:
                doomed = self.directory / f"{step}{DELETING_SUFFIX}"
                self.step_dir(step).rename(doomed)
                self._deleter.submit(_remove, doomed)
        if jax.process_count() > 1:
            ocp.multihost.sync_global_processes(f"jaxckpt:deleted:{step}")
        self._mngr.reload()

    def close(self) -> None:
        self._mngr.close()
        self._deleter.shutdown(wait=True)

    def _tombstoned(self) -> set[int]:
        """Steps hidden by a tombstone: being deleted from object storage."""
        if not is_remote(self.directory):
            return set()
        names = (
            p.name.removesuffix(TOMBSTONE_SUFFIX)
            for p in self.directory.glob(f"*{TOMBSTONE_SUFFIX}")
        )
        return {step for n in names if (step := step_of(n)) is not None}

    def _remove_tombstoned(self, step: int) -> None:
        """The step's objects, then its tombstone (kept, and retried later, on failure)."""
        if _remove(self.step_dir(step)):
            _remove(self.directory / f"{step}{TOMBSTONE_SUFFIX}")


def _check_info(doc: Any) -> dict[str, Any]:
    """A jaxckpt.json document, checked field by field (ValueError naming the field)."""
    if not isinstance(doc, dict):
        raise ValueError("it is not a JSON object")
    version = doc.get("format")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise ValueError("'format' is not a format version")
    if version > FORMAT_VERSION:
        raise ValueError(
            f"it has format {version}, written by a newer jaxckpt (this one reads format "
            f"{FORMAT_VERSION}); upgrade jaxckpt to read it"
        )
    items = doc.get("items")
    if not isinstance(items, dict):
        raise ValueError("'items' is not an object")
    for item in (STATE, RNG):
        specs = items.get(item)
        if not isinstance(specs, list):
            raise ValueError(f"'items.{item}' is not a list of leaves")
        for spec in specs:
            try:
                LeafSpec.from_json(spec)
            except ValueError as e:
                raise ValueError(f"'items.{item}': {e}") from None
    if doc.get("data") not in (None, "json", "bytes"):
        raise ValueError('\'data\' is not null, "json" or "bytes"')
    kinds = doc.get("node_types")
    if kinds is not None and not (
        isinstance(kinds, dict)
        and all(
            isinstance(names, list) and all(isinstance(n, str) for n in names)
            for names in kinds.values()
        )
    ):
        raise ValueError("'node_types' is not an object of lists of type names")
    for key, kind in (("saved_at", str), ("process_count", int), ("versions", dict)):
        if doc.get(key) is not None and not isinstance(doc[key], kind):
            raise ValueError(f"{key!r} is not a {kind.__name__}")
    return doc


@contextlib.contextmanager
def _read_errors(step: int, item: str, directory: epath.Path) -> Iterator[None]:
    """Orbax's and tensorstore's errors while reading a step, as one RestoreError."""
    try:
        yield
    except JaxckptError:
        raise
    except Exception as e:
        first = (str(e).strip().splitlines() or [""])[0][:300]
        raise RestoreError(
            f"reading {item} of step {step} in {directory} failed: {type(e).__name__}: {first}"
        ) from e


def _check_read(
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
        [f"{item} leaf {name!r} is {found}, but {INFO}/{INFO_FILE} records shape {request.shape}"],
        str(directory),
    )


def _registry() -> ocp.type_handlers.TypeHandlerRegistry:
    """Orbax's handlers for the two leaf types jaxckpt hands it, with replica-parallel
    writes only where they pay off.

    Orbax splits a replicated shard among its replicas, one compiled `lax.slice` per
    distinct piece on the save's blocking path: the first save of a training state with
    replicated biases and norms compiled for ~2 s. One process gains nothing from it (it
    writes every piece anyway), so only several processes use it, and only for pieces of
    at least REPLICA_PARALLEL_MIN_BYTES.
    """
    return ocp.type_handlers.create_type_handler_registry(
        (np.ndarray, ocp.type_handlers.NumpyHandler()),
        (
            jax.Array,
            ocp.type_handlers.ArrayHandler(
                use_replica_parallel=jax.process_count() > 1,
                min_slice_bytes_for_replica_parallel=REPLICA_PARALLEL_MIN_BYTES,
                array_metadata_store=_array_metadata_store(),
            ),
        ),
    )


def _remove(path: epath.Path) -> bool:
    """Deletes a folder or object; a failure is logged (the next writer retries it)."""
    try:
        if path.is_dir():
            path.rmtree()
        else:
            path.unlink(missing_ok=True)
        return True
    except Exception as e:
        log.warning("could not delete %s (retried when a writer next opens it): %s", path, e)
        return False


def _empty(request: ReadRequest) -> Any:
    """A zero-size array (never written, see `save`) where the request wants it."""
    host = np.zeros(request.shape, request.dtype)
    if request.sharding is None:
        return host
    return jax.make_array_from_callback(request.shape, request.sharding, lambda index: host[index])


def _restore_args(request: ReadRequest) -> ocp.RestoreArgs:
    if request.sharding is None:
        return ocp.RestoreArgs(restore_type=np.ndarray, dtype=request.dtype)
    return ocp.ArrayRestoreArgs(
        sharding=request.sharding, global_shape=request.shape, dtype=request.dtype
    )

"""The Orbax adapter: the persistent tier through Orbax (with `_internals`, the only modules
that import Orbax).

jaxckpt hands Orbax flat `{name: array}` dicts (see `jaxckpt._tree`) and small JSON documents;
everything about handlers, restore args and Orbax's step folders stays in this file, so the
Orbax API (v0 `CheckpointManager` today) can be swapped without touching the rest. What a
step is on disk is `jaxckpt._layout`'s.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import json
import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from jaxckpt import _integrity, _internals, _layout, _packed, _transfer
from jaxckpt._lock import ObjectLease, WriterLock
from jaxckpt._plan import read_batches
from jaxckpt._storage import absolute, is_remote
from jaxckpt._tree import ARRAY, KEY, PYTHON, LeafSpec, ReadRequest, leaf_name
from jaxckpt.errors import (
    ConfigError,
    CorruptCheckpointError,
    NoCheckpointError,
)

log = logging.getLogger("jaxckpt")


class _UnlistedSteps:
    """Orbax's own step names (`<step>`), with a listing that finds no step: Orbax's manager
    lists a directory through `find_all` (at start-up and each `reload`), reading every step's
    `_CHECKPOINT_METADATA`, so that one unreadable file stopped the whole directory and
    10,000 steps took seconds; jaxckpt lists it itself (`_layout.Listing`). Orbax's manager
    then tracks only the steps it saved since its last `reload`."""

    def __init__(self) -> None:
        self._names = ocp.path.step.standard_name_format()

    def build_name(self, step: int) -> str:
        return self._names.build_name(step)

    def find_step(self, base_path: epath.PathLike, step: int) -> Any:
        return self._names.find_step(base_path, step)

    def find_all(self, base_path: epath.PathLike) -> Iterator[Any]:
        return iter(())


REPLICA_PARALLEL_MIN_BYTES = 4 * 2**20
# OCDBT packs a process's writes into data files of about this size, written in parallel;
# without a target it writes one file at a time (2-3x slower, BENCHMARKS.md).
DATA_FILE_BYTES = 128 * 2**20


class _DataStateHandler(ocp.CheckpointHandler):
    """Writes each process's data-iterator state to its own file, and beside it what the
    iterator was (`jaxckpt._iterators.describe`), checked at restore before any array is
    read. Per process, as the states are: each process's pipeline reads its own shard."""

    def save(self, directory: epath.Path, args: DataSave) -> None:
        self._path(directory, "process").write_text(args.text)
        if args.about is not None:
            self._path(directory, "iterator").write_text(args.about)

    def restore(self, directory: epath.Path, args: DataRestore | None = None) -> str:
        raise NotImplementedError("read as plain files: jaxckpt._layout.read_data_state")

    def metadata(self, directory: epath.Path) -> None:
        return None

    @staticmethod
    def _path(directory: epath.Path, kind: str) -> epath.Path:
        return directory / _layout.data_file(kind, jax.process_index(), jax.process_count())


@ocp.args.register_with_handler(_DataStateHandler, for_save=True)
@dataclasses.dataclass
class DataSave(ocp.args.CheckpointArgs):
    text: str
    about: str | None = None


@ocp.args.register_with_handler(_DataStateHandler, for_restore=True)  # Orbax needs both
@dataclasses.dataclass
class DataRestore(ocp.args.CheckpointArgs):
    pass


class _PackedHandler(ocp.AsyncCheckpointHandler):
    """Writes this process's pieces of every small leaf (`jaxckpt._packed`): copied to the
    host while the save blocks, written in one file in its background."""

    def __init__(self) -> None:
        self._writer = concurrent.futures.ThreadPoolExecutor(1, "jaxckpt-packed")

    async def async_save(
        self, directory: epath.Path, args: PackedSave
    ) -> list[concurrent.futures.Future]:
        pieces = _packed.to_host(args.items, _internals.device_buffers)
        return [self._writer.submit(_packed.write, directory, pieces)]

    def save(self, directory: epath.Path, args: PackedSave) -> None:
        _packed.write(directory, _packed.to_host(args.items, _internals.device_buffers))

    def restore(self, directory: epath.Path, args: PackedRestore | None = None) -> None:
        raise NotImplementedError("read through jaxckpt._packed.PackedStep")

    def metadata(self, directory: epath.Path) -> None:
        return None

    def close(self) -> None:
        self._writer.shutdown(wait=True)


@ocp.args.register_with_handler(_PackedHandler, for_save=True)
@dataclasses.dataclass
class PackedSave(ocp.args.CheckpointArgs):
    items: Mapping[str, Mapping[str, Any]]


@ocp.args.register_with_handler(_PackedHandler, for_restore=True)  # Orbax needs both
@dataclasses.dataclass
class PackedRestore(ocp.args.CheckpointArgs):
    pass


class OrbaxStore:
    """Async saves and reads of jaxckpt steps through one Orbax `CheckpointManager`; the
    owner of the commit protocol (see `save`)."""

    def __init__(
        self,
        directory: str | epath.PathLike,
        *,
        timeout_s: int = 1200,
        restore_inflight_bytes: int = 2**30,
        compression: str | None = None,
        read_only: bool = False,
        lock: WriterLock | ObjectLease | None = None,
        pack: bool = True,
    ):
        """`lock`: the writer's lock (held by process 0), checked before each save, each
        commit and each delete. `pack`: leaves of at most `_packed.MAX_LEAF_BYTES` are
        packed (format 2); False writes each as an Orbax array of its own."""
        self.directory = epath.Path(absolute(directory))
        self._lock = lock
        self._saving: int | None = None
        self._orbax_steps: dict[int, _layout.OrbaxStep] = {}
        self._prefixed: frozenset[int] = frozenset()
        self._orbax_trees: dict[epath.Path, Any] = {}  # Orbax's metadata, read once an item
        # Read once a step; keyed by when it was saved too, as a deleted step's number may
        # be saved again.
        self._packed: dict[tuple[epath.Path, str | None], _packed.PackedStep] = {}
        self._pack = pack
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
            step_name_format=_UnlistedSteps(),
            # jaxckpt removes unfinished saves' leftovers itself (below), in its deleter.
            cleanup_tmp_directories=False,
            async_options=ocp.AsyncOptions(
                timeout_secs=timeout_s,
                post_finalization_callback=None if read_only else self._before_commit,
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
                _layout.STATE: arrays,
                _layout.RNG: arrays,
                _layout.DATA: _DataStateHandler(),
                _layout.PACKED: _PackedHandler(),
                _layout.META_DIR: ocp.JsonCheckpointHandler(filename=_layout.INFO_FILE),
            },
        )
        self._deleter = concurrent.futures.ThreadPoolExecutor(1, "jaxckpt-delete")
        self._leftovers: list[concurrent.futures.Future] = []
        # Down to the newest committed step only: opening costs the same at any step count.
        listing = self.scan(newest=True)
        if not read_only and jax.process_index() == 0:
            # In the background from start-up (a reader never deletes anything): saves that
            # never committed (a killed process; on object storage, those above the newest
            # committed step, as any other was there when a writer started after it), and
            # deletions that never finished.
            self._leftovers = [
                self._deleter.submit(_remove, self.directory / n, "an unfinished save's leftovers")
                for n in listing.unfinished
            ]
            for name in listing.deleting:
                if name.endswith(_layout.TOMBSTONE_SUFFIX):
                    step = _layout.step_of(name.removesuffix(_layout.TOMBSTONE_SUFFIX))
                    if step is not None:
                        self._deleter.submit(self._remove_tombstoned, step)
                else:
                    self._deleter.submit(_remove, self.directory / name)

    def scan(self, *, newest: bool = False) -> _layout.Listing:
        """The directory as it is now (another process may have written or deleted);
        `newest`: only down to the newest committed step (`_layout.Listing.of`)."""
        listing = _layout.Listing.of(self.directory, newest=newest, known=self._orbax_steps)
        self._orbax_steps = dict(listing.orbax)
        self._prefixed = listing.prefixed
        return listing

    def latest(self) -> _layout.Listing:
        """A listing down to the newest committed step (`Listing.latest`): a stat or two, or
        requests, whatever the number of steps."""
        return self.scan(newest=True)

    def committed_steps(self) -> list[int]:
        """Committed steps, jaxckpt's and plain Orbax's, oldest first."""
        return list(self.scan().committed)

    def own_steps(self) -> list[int]:
        """The committed steps jaxckpt wrote, oldest first: the only ones it deletes."""
        return list(self.scan().own)

    def tree(self, step: int, item: str | None = None) -> tuple[_layout.StepInfo, str]:
        """A committed step's metadata and which of its trees `item` names: of a jaxckpt
        step "state" (None) or "rng"; of a plain Orbax step one of its pytree items (None or
        "state": its only one)."""
        if self.is_orbax(step):
            return self.info(step, None if item in (None, _layout.STATE) else item), _layout.STATE
        if item not in (None, *_layout.ITEMS):
            raise ConfigError(
                f"item must be one of {list(_layout.ITEMS)} for step {step} in "
                f"{self.directory}, a jaxckpt step (a pytree item's name chooses among those "
                f"of a step plain Orbax wrote), got {item!r}"
            )
        return self.info(step), item or _layout.STATE

    def _item_tree(self, path: epath.Path) -> Any:
        """An Orbax pytree item's metadata tree (`_orbax_tree`), read once by this store:
        jaxckpt never rewrites a step that plain Orbax wrote."""
        if path not in self._orbax_trees:
            self._orbax_trees[path] = _orbax_tree(path)
        return self._orbax_trees[path]

    def is_orbax(self, step: int) -> bool:
        """Whether the last `scan` found `step` to be a step plain Orbax wrote."""
        return step in self._orbax_steps

    def info(self, step: int, item: str | None = None) -> _layout.StepInfo:
        """What a committed step that the last `scan` listed holds: a jaxckpt step's
        jaxckpt.json (FileNotFoundError if it is gone), or what Orbax recorded of a plain
        Orbax step's pytree item `item` (None: its only one)."""
        found = self._orbax_steps.get(step)
        if found is not None:
            if problems := _integrity.unsafe_entries(found.path):  # before Orbax opens any
                raise CorruptCheckpointError(step, problems, str(self.directory))
            return _orbax_info(self.directory, step, found, item, self._item_tree)
        if item not in (None, _layout.STATE):
            raise ConfigError(
                f"step {step} in {self.directory} is a jaxckpt step: item= chooses among the "
                f"pytree items of a step plain Orbax wrote (got item={item!r})"
            )
        return _layout.read_info(self.directory, step)

    def step_folder_exists(self, step: int) -> bool:
        """Whether anything (committed, foreign, or Orbax's own) sits at the step's path."""
        # On object storage an unfinished save sits at its step's path: its removal, started
        # at start-up, ends first (a failed one is logged, and the next writer tries again).
        concurrent.futures.wait(self._leftovers)
        if self.step_dir(step).exists():
            return True
        # `checkpoint_<step>/`, say, below the newest step, which a newest-only scan did not
        # look into: listed whole now (a save under the step of a folder of another name)
        return step in self._prefixed and step in self.scan().orbax

    def save(
        self,
        step: int,
        *,
        state: Mapping[str, Any],
        rng: Mapping[str, Any],
        data: str | None,
        info: _layout.StepInfo,
        data_about: str | None = None,
    ) -> None:
        """Starts an async save; returns once device arrays are copied to host memory.

        The commit protocol, all of it here:
        1. Before anything is written, the writer's lock is checked (`LockedError` if this
           job lost it: its lock file was removed or replaced, or its lease taken over).
        2. Orbax makes `<step>.orbax-checkpoint-tmp` (on object storage, `<step>` itself)
           now, and every process writes its shards into it in the background.
        3. Once every item is written on every process (Orbax's post-finalization
           callback, `_before_commit`), process 0 writes the manifest of every file
           (`_integrity.write_manifest`), then asks the lock again, of the server itself
           for a lease: a writer that lost it raises there and the step never commits.
        4. Orbax renames the folder to `<step>` (object storage: writes its
           `commit_success.txt`). The step is committed, and listed, from then on.
        A failure at 2-4 is raised by `wait` (as the background error it is).
        """
        if self._lock is not None:
            self._lock.check()
        args: dict[str, Any] = {}
        small: dict[str, dict[str, Any]] = {}
        for item, arrays in ((_layout.STATE, state), (_layout.RNG, rng)):
            # Orbax refuses zero-size arrays; their specs are enough to remake them.
            arrays = {name: a for name, a in arrays.items() if a.size}
            if self._pack:
                small[item] = {n: a for n, a in arrays.items() if _packed.is_small(a)}
                arrays = {n: a for n, a in arrays.items() if n not in small[item]}
            if arrays:
                args[item] = ocp.args.PyTreeSave(
                    arrays, ocdbt_target_data_file_size=DATA_FILE_BYTES
                )
        if any(small.values()):
            args[_layout.PACKED] = PackedSave(small)
            packed = {item: frozenset(names) for item, names in small.items() if names}
            info = dataclasses.replace(info, packed=packed)
        args[_layout.META_DIR] = ocp.args.JsonSave(info.to_json())
        if data is not None:
            args[_layout.DATA] = DataSave(data, data_about)
        self._saving = step
        self._mngr.save(step, args=ocp.args.Composite(**args), force=True)

    def _before_commit(self) -> None:
        # Orbax calls this in its background thread, on every process, after all items
        # are finalized and before it renames the step's temporary folder into place.
        if self._saving is None or jax.process_index() != 0:
            return
        tmp = self.directory / f"{self._saving}{_layout.TMP_SUFFIX}"
        _integrity.write_manifest(tmp if tmp.exists() else self.step_dir(self._saving))
        if self._lock is not None:  # last: a writer that lost its lock never commits
            self._lock.check(confirm=True)

    def step_dir(self, step: int) -> epath.Path:
        """The step's folder (of a step plain Orbax wrote: as the last `scan` found it)."""
        found = self._orbax_steps.get(step)
        return found.path if found else self.directory / str(step)

    def wait(self) -> None:
        """Blocks until the in-flight save commits; raises its background error, once."""
        self._mngr.wait_until_finished()
        _internals.wait_for_background_commit(self._mngr)

    def read_arrays(
        self, info: _layout.StepInfo, item: str, requests: Mapping[str, ReadRequest]
    ) -> dict[str, Any]:
        """Reads the named arrays of one item of a step, each onto its sharding (or to the
        host); of a plain Orbax step, of its pytree item `info.item`."""
        step = info.step
        out = {name: _transfer.empty(r) for name, r in requests.items() if 0 in r.shape}
        to_read = {name: r for name, r in requests.items() if name not in out}
        if packed := {n: r for n, r in to_read.items() if n in info.packed.get(item, ())}:
            to_read = {n: r for n, r in to_read.items() if n not in packed}
            out.update(self._read_packed(info, item, packed))
        if info.orbax is None and to_read and not (self.step_dir(step) / item).exists():
            # every leaf was packed, yet jaxckpt.json names one more: as Orbax's would be
            name, request = next(iter(to_read.items()))
            _check_read(step, item, name, None, request, self.directory)
        # One Orbax restore per batch bounds the bytes in flight. (Orbax's own limiter,
        # restore_concurrent_gb, wakes every waiting leaf on each release: restoring
        # thousands of leaves under it took 2.5x longer.)
        batches = read_batches(to_read, self._restore_inflight_bytes)
        if info.orbax is not None:
            item = info.item
            path = info.orbax.item_dir(item)
            tree = self._item_tree(path)
            if _legacy(path):  # Orbax reads every leaf of such an item on each restore
                batches = [list(to_read)]
        for batch in batches:
            with _transfer.read_errors(step, item, self.directory):
                if info.orbax is None:
                    got = self._read_batch(step, item, {n: to_read[n] for n in batch})
                else:
                    got = _read_orbax_batch(path, tree, {n: to_read[n] for n in batch})
            for name in batch:
                _check_read(step, item, name, got.get(name), to_read[name], self.directory)
            out.update(got)
        return out

    def _read_packed(
        self, info: _layout.StepInfo, item: str, requests: Mapping[str, ReadRequest]
    ) -> dict[str, Any]:
        """The packed leaves `requests` names, each process's index read once a step."""
        key = (info.folder(self.directory), info.saved_at)
        with (
            _transfer.read_errors(info.step, item, self.directory),
            _transfer.corrupt_if_not_jaxckpts(info.step, self.directory),
        ):
            if key not in self._packed:
                if len(self._packed) >= 4:  # the steps being read now, not every one read
                    self._packed.clear()
                self._packed[key] = _packed.PackedStep(
                    key[0] / _layout.PACKED, info.process_count or 1
                )
        return _transfer.read_packed(
            self._packed[key], info, item, requests, self._restore_inflight_bytes, self.directory
        )

    def _read_batch(self, step: int, item: str, batch: Mapping[str, ReadRequest]) -> dict:
        args = ocp.args.PyTreeRestore(
            item={n: jax.ShapeDtypeStruct(r.shape, r.dtype) for n, r in batch.items()},
            restore_args={n: _restore_args(r) for n, r in batch.items()},
            # read only the requested leaves, never the rest of the step
            partial_restore=True,
        )
        return self._mngr.restore(step, args=ocp.args.Composite(**{item: args}))[item]

    def delete(self, step: int) -> None:
        """Removes a committed step from the listing now and deletes its files in the
        background (off the save's blocking path). On process 0: on local disk the step
        folder is renamed to `<step>.jaxckpt-deleting` (which no listing reads); on object
        storage one `<step>.jaxckpt-tombstone` object is written, which hides the step until
        its objects and then the tombstone are deleted. A writer that lost its lock
        deletes nothing (LockedError)."""
        if self.is_orbax(step):
            raise ConfigError(
                f"step {step} in {self.directory} was written by plain Orbax; jaxckpt never "
                "deletes such a step (remove its folder yourself if you mean to)"
            )
        if self._lock is not None:
            self._lock.check()
        self._packed = {k: v for k, v in self._packed.items() if k[0] != self.step_dir(step)}
        if jax.process_index() == 0:
            if is_remote(self.directory):
                (self.directory / f"{step}{_layout.TOMBSTONE_SUFFIX}").write_bytes(b"")
                self._deleter.submit(self._remove_tombstoned, step)
            else:
                doomed = self.directory / f"{step}{_layout.DELETING_SUFFIX}"
                self.step_dir(step).rename(doomed)
                self._deleter.submit(_remove, doomed)
        if jax.process_count() > 1:
            ocp.multihost.sync_global_processes(f"jaxckpt:deleted:{step}")
        self._mngr.reload()

    def close(self) -> None:
        self._mngr.close()
        self._deleter.shutdown(wait=True)

    def _remove_tombstoned(self, step: int) -> None:
        """The step's objects, then its tombstone (kept, and retried later, on failure)."""
        if _remove(self.step_dir(step)):
            _remove(self.directory / f"{step}{_layout.TOMBSTONE_SUFFIX}")


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
        [f"{item} leaf {name!r} is {found}, but {_layout.INFO_PATH} records shape {request.shape}"],
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
                array_metadata_store=_internals.array_metadata_store(),
            ),
        ),
    )


# --- steps that plain Orbax wrote -------------------------------------------------------


def write_plain(out_dir: epath.Path, tree: Any) -> None:
    """`tree` as a plain Orbax checkpoint at `out_dir`, which must not exist: what
    `ocp.StandardCheckpointer().save(out_dir, tree)` writes (and Orbax commits atomically),
    so that `ocp.StandardCheckpointer().restore(out_dir, target)` reads it."""
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(out_dir, tree)
        checkpointer.wait_until_finished()


def _orbax_info(
    directory: epath.Path,
    step: int,
    found: _layout.OrbaxStep,
    item: str | None,
    tree_of: Callable[[epath.Path], Any],
) -> _layout.StepInfo:
    """A plain Orbax step as jaxckpt sees one: the leaves of its pytree item `item` (None:
    its only one) as Orbax's metadata records them (`tree_of` an item's folder), its grain
    states as data."""
    trees = found.items_of("pytree")
    if item is None and len(trees) == 1:
        item = trees[0]
    if item not in trees:
        held = ", ".join(f"{name} ({kind})" for name, kind in sorted(found.items.items()))
        ask = (
            "choose one with item= (CLI: --item)"
            if item is None
            else f"it has no pytree item {item!r}"
        )
        raise ConfigError(f"step {step} in {directory}, written by Orbax, holds {held}: {ask}")
    try:
        tree = tree_of(found.item_dir(item))
        impls = _internals.key_impls(found.item_dir(item))
        # (None in the tree is an empty node: optax's EmptyState is saved as one)
        leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
        specs = [_orbax_spec(path, meta, impls) for path, meta in leaves]
    except Exception as e:
        problem = f"Orbax cannot read the metadata of its item {item!r}: {_transfer.first_line(e)}"
        raise CorruptCheckpointError(step, [problem], str(directory)) from None
    return _layout.StepInfo(
        step=step,
        state=tuple(s for s in specs if s is not None),
        data="grain" if found.items_of("grain") else None,
        orbax=found,
        item=item,
    )


def _orbax_tree(path: epath.Path) -> Any:
    """The nested tree of an Orbax pytree item, its leaves Orbax's value metadata."""
    if _legacy(path):
        return _legacy_tree(path)
    return ocp.PyTreeCheckpointHandler().metadata(path).tree


def _legacy(path: epath.Path) -> bool:
    """An item of an Orbax release before `_METADATA` (0.2-0.4): its tree is the msgpack
    file `checkpoint`, each leaf a zarr (v2) array of its own, named by its leaf name."""
    return not (path / _layout.ORBAX_TREE_FILE).exists()


def missing_chunks(path: epath.Path) -> list[str]:
    """Of a legacy item, the arrays whose chunk files are not all there: Orbax reads a
    missing chunk of such an item as zeros, so only the listing tells. (An array with a fill
    value may leave chunks out: not counted.)"""
    if not _legacy(path):
        return []
    problems = []
    for leaf in sorted(p for p in path.iterdir() if (p / ".zarray").exists()):
        try:
            zarray = json.loads((leaf / ".zarray").read_text())
            grid = [-(-n // c) for n, c in zip(zarray["shape"], zarray["chunks"], strict=True)]
        except (OSError, ValueError, TypeError, KeyError, ZeroDivisionError) as e:
            problems.append(f"{leaf.name}/.zarray is unreadable: {_transfer.first_line(e)}")
            continue
        if zarray.get("fill_value") is not None:
            continue
        separator = zarray.get("dimension_separator", ".")
        expected = {
            separator.join(map(str, i)) or "0" for i in itertools.product(*map(range, grid))
        }
        present = _files_below(leaf)
        if missing := sorted(expected - present):
            problems.append(
                f"{leaf.name}: {len(missing)} of {len(expected)} chunk files are missing "
                f"(first: {missing[0]}), which Orbax would read as zeros"
            )
    return problems


def _files_below(root: epath.Path) -> set[str]:
    """The files below `root`, as paths relative to it (a listing per folder)."""
    found, stack = set(), [root]
    while stack:
        for p in stack.pop().iterdir():
            if p.is_dir():
                stack.append(p)
            else:
                found.add(str(p.relative_to(root)))
    return found


def _legacy_tree(path: epath.Path) -> Any:
    """A legacy item's tree, each array's metadata from its `.zarray`: shape and dtype (no
    sharding is recorded there). A value stored in the msgpack file itself is left out."""
    tree = ocp.aggregate_handlers.MsgpackHandler().deserialize(path / _layout.ORBAX_LEGACY_FILE)

    def meta(value: Any) -> Any:
        if not ocp.utils.leaf_is_placeholder(value):
            log.warning("Orbax leaf stored in %s/checkpoint itself: jaxckpt skips it", path)
            return None
        name = ocp.utils.name_from_leaf_placeholder(value)
        if not name or "/" in name or "\\" in name or name in (".", ".."):
            raise ValueError(f"a leaf is named {name!r}, which is no folder of the item")
        try:
            zarray = json.loads((path / name / ".zarray").read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"{name}/.zarray is unreadable: {e}") from None
        return ocp.metadata.ArrayMetadata(
            name=name,
            directory=path,
            shape=tuple(zarray["shape"]),
            sharding=None,
            dtype=np.dtype(zarray["dtype"]),
        )

    return jax.tree.map(meta, tree)


def _orbax_spec(path: tuple, meta: Any, impls: Mapping[str, str]) -> LeafSpec | None:
    """The LeafSpec of one leaf of Orbax's metadata (None: a string leaf, which jaxckpt
    does not restore, logged); a typed PRNG key (its impl in `impls`) is a KEY leaf."""
    name = leaf_name(path)
    if not isinstance(meta, ocp.metadata.ArrayMetadata):
        log.warning("Orbax leaf %s is a %s: jaxckpt skips it", name, type(meta).__name__)
        return None
    kind = PYTHON if isinstance(meta, ocp.metadata.ScalarMetadata) else ARRAY
    shape, dtype, impl = tuple(meta.shape), meta.dtype, impls.get(name)
    if impl is not None:  # Orbax's metadata has the key data: (*shape, *impl's own dims)
        key = jax.eval_shape(lambda: jax.random.key(0, impl=impl))
        own = jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0, impl=impl))).shape
        kind, shape, dtype = KEY, shape[: len(shape) - len(own)], str(key.dtype)
    sharding = None
    if isinstance(meta.sharding, ocp.metadata.NamedShardingMetadata):
        spec = [list(e) if isinstance(e, tuple) else e for e in meta.sharding.partition_spec]
        mesh = dict(zip(meta.sharding.axis_names, map(int, meta.sharding.shape), strict=True))
        sharding = {"mesh": mesh, "spec": spec}
    elif isinstance(meta.sharding, ocp.metadata.SingleDeviceShardingMetadata):
        sharding = {"devices": 1}
    return LeafSpec.at(path, shape, dtype, kind=kind, key_impl=impl, sharding=sharding)


def _read_orbax_batch(
    path: epath.Path, tree: Any, batch: Mapping[str, ReadRequest]
) -> dict[str, Any]:
    """Reads the leaves `batch` names of an Orbax pytree item: the item's whole tree with
    Orbax's placeholder for every other leaf, so that none of those is read."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    names = [leaf_name(p) for p, _ in leaves]
    scalar = {
        n
        for n, (_, meta) in zip(names, leaves, strict=True)
        if isinstance(meta, ocp.metadata.ScalarMetadata)
    }
    item = [_target(batch[n]) if n in batch else ocp.PLACEHOLDER for n in names]
    restore_args = [
        _restore_args(batch[n]) if n in batch and n not in scalar else ocp.RestoreArgs()
        for n in names
    ]
    got = ocp.PyTreeCheckpointHandler().restore(
        path,
        args=ocp.args.PyTreeRestore(
            item=jax.tree_util.tree_unflatten(treedef, item),
            restore_args=jax.tree_util.tree_unflatten(treedef, restore_args),
        ),
    )
    values = jax.tree_util.tree_leaves(got, is_leaf=lambda x: x is ocp.PLACEHOLDER)
    out = {}
    for name, value in zip(names, values, strict=True):
        if jax.dtypes.issubdtype(getattr(value, "dtype", np.float32), jax.dtypes.prng_key):
            value = jax.random.key_data(value)  # Orbax wraps typed keys; jaxckpt reads data
        if name in scalar and name in batch:  # Orbax hands back a Python or NumPy scalar
            value = np.asarray(value, batch[name].dtype)
            if batch[name].sharding is not None:
                value = _transfer.on(batch[name].sharding, value)
        if name in batch:
            out[name] = value
    return out


def _target(request: ReadRequest) -> Any:
    return jax.ShapeDtypeStruct(request.shape, request.dtype, sharding=request.sharding)


def _remove(path: epath.Path, what: str = "a deleted step's files") -> bool:
    """Deletes a folder or object; a failure is logged (the next writer retries it)."""
    try:
        if path.is_dir():
            path.rmtree()
        else:
            path.unlink(missing_ok=True)
        return True
    except Exception as e:
        log.warning("could not remove %s, %s (retried by the next writer): %s", what, path, e)
        return False


def _restore_args(request: ReadRequest) -> ocp.RestoreArgs:
    if request.sharding is None:
        return ocp.RestoreArgs(restore_type=np.ndarray, dtype=request.dtype)
    return ocp.ArrayRestoreArgs(
        sharding=request.sharding, global_shape=request.shape, dtype=request.dtype
    )

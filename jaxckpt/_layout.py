"""What a jaxckpt directory holds on disk: the one owner of every file and folder name, of
the step's metadata document (`StepInfo`) and of the reading of a step's small files, each
bounded (`_storage.read_small`). Everything else asks here; the directory listed once is
`jaxckpt._listing`'s.

    <directory>/
        .jaxckpt-writer.lock                 the writer's lock (jaxckpt._lock)
        <step>/                              a committed step (canonical ASCII digits)
        <step>.orbax-checkpoint-tmp/         a save in progress, or cut off (Orbax's)
        <step>.jaxckpt-deleting/             being deleted by retention (local disk)
        <step>.jaxckpt-tombstone             hides a step being deleted (object storage)
    <directory>/<step>/
        state/                      the state tree's leaves above 1 MiB: tensorstore OCDBT,
                                    one entry per leaf name
        rng/                        PRNG keys as raw key data, as state/ (only with rng=)
        packed/<i>-of-<n>.bin|json  every smaller leaf of both, each process's pieces in one
                                    file with its index (format 2, jaxckpt._packed)
        data/process_<i>-of-<n>.json  each process's data-iterator state (only with data=)
        data/iterator_<i>-of-<n>.json what that iterator was (jaxckpt._iterators.describe)
        jaxckpt/jaxckpt.json        StepInfo: leaf specs, user meta, versions
        jaxckpt/manifest.json       size + checksum of every file (jaxckpt._integrity)
        _CHECKPOINT_METADATA, commit_success.txt   Orbax's own commit files

Orbax writes a step into `<step>.orbax-checkpoint-tmp` and renames it into place once every
item is written; object storage has no rename, so there a step is committed once Orbax's
`commit_success.txt` is in it. A committed step folder holding `jaxckpt/jaxckpt.json` is a
jaxckpt step; one holding `jaxckpt/` without it, or nothing, is a damaged one.

A step folder plain Orbax wrote (`ocp.CheckpointManager`, MaxText) is an Orbax step
(`OrbaxStep`): named `[<prefix>_]<step>` (digits, zero-padded or not), it holds Orbax items,
each a folder: a pytree (its `_METADATA` file, any of Orbax's array layouts; before
Orbax 0.5, a msgpack `checkpoint` file and a zarr folder per leaf), grain's
iterator states (`process_<i>-of-<n>.json`, as jaxckpt's data/), or a JSON document.
A step folder may be itself one pytree: `flax.training.checkpoints` writes
`checkpoint_<step>/` so (Flax's imagenet, wmt and lm1b examples). A directory that is itself one pytree (`ocp.StandardCheckpointer().save(directory, tree)`)
is a bare Orbax checkpoint: step 0, one item, "default". jaxckpt reads Orbax steps and
never writes, deletes or checksums them. Any other step-like folder is foreign: never
touched, and listed with why it cannot be read (`_listing.Listing.unreadable`).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from typing import Any

from etils import epath

from jaxckpt._storage import (
    SMALL_FILE_LIMIT_VARIABLE,
    StoreReadError,
    read_small,
    small_file_limit,
)
from jaxckpt._tree import EmptyNode, LeafSpec, empty_from_json, empty_to_json
from jaxckpt.errors import ConfigError, CorruptCheckpointError, DataStateError

STATE, RNG, DATA, PACKED = "state", "rng", "data", "packed"  # Orbax items: step folders
ITEMS = (STATE, RNG)  # the items of arrays
META_DIR = "jaxckpt"  # jaxckpt's item: its own files
INFO_FILE = "jaxckpt.json"
INFO_PATH = f"{META_DIR}/{INFO_FILE}"
MANIFEST_PATH = f"{META_DIR}/manifest.json"
ORBAX_STEP_METADATA, ORBAX_COMMIT_FILE = "_CHECKPOINT_METADATA", "commit_success.txt"
ORBAX_COMMIT_FILES = frozenset({ORBAX_STEP_METADATA, ORBAX_COMMIT_FILE})
ORBAX_TREE_FILE = "_METADATA"  # an Orbax pytree item's tree metadata
ORBAX_LEGACY_FILE = "checkpoint"  # its msgpack tree, in Orbax releases before _METADATA
ORBAX_JSON_FILE = "metadata"  # ocp.JsonCheckpointHandler's default file
ORBAX_DEFAULT_ITEM = "default"  # the item of a single-item ocp.CheckpointManager
TMP_SUFFIX = ".orbax-checkpoint-tmp"
DELETING_SUFFIX = ".jaxckpt-deleting"
TOMBSTONE_SUFFIX = ".jaxckpt-tombstone"
# beside a step retention would delete but a kept step shares bytes with (`_incremental`):
# out of every listing, its folder kept until no kept step refers to it
RETIRED_SUFFIX = ".jaxckpt-retired"
LOCK_FILE = ".jaxckpt-writer.lock"
DATA_STATE_FILE = re.compile(r"process_(\d+)-of-(\d+)\.json")  # as grain's handler names them
MAX_DATA_STATE_BYTES = 2**20  # what inspect --data reads of one
# Of jaxckpt.json; a later format adds its reading of older ones here. 2: small leaves are
# packed (`StepInfo.packed`); 1: every leaf is an Orbax array of its own.
FORMAT_VERSION = 2
MAX_PROCESSES = 2**16  # the most processes a step's jaxckpt.json may name


def step_of(name: str) -> int | None:
    """The step a folder name stands for: ASCII digits in canonical form (`12`, never `012`,
    `²` or `①`), which is how jaxckpt names step folders; None for any other name."""
    if not (name.isascii() and name.isdigit()) or (name != "0" and name.startswith("0")):
        return None
    return int(name)


_ORBAX_STEP_NAME = re.compile(r"(?:.+_)?(\d+)")


def orbax_step_of(name: str) -> int | None:
    """The step of a folder name Orbax may have written: `[<prefix>_]<digits>`, the digits
    zero-padded or not (Orbax's `step_prefix` and `step_format_fixed_length`)."""
    found = _ORBAX_STEP_NAME.fullmatch(name) if name.isascii() else None
    return int(found[1]) if found else None


def data_file(kind: str, process: int, count: int) -> str:
    """A process's data-iterator file: kind "process" (its state) or "iterator" (what it was)."""
    return f"{kind}_{process}-of-{count}.json"


PACKED_INDEX = "index.json"  # in the packed folder: every process's index (`_packed`)


def packed_files(process: int, count: int) -> tuple[str, str]:
    """Process `process`'s files (bytes, index) in the step's packed folder."""
    return f"{process}-of-{count}.bin", f"{process}-of-{count}.json"


@dataclasses.dataclass(frozen=True)
class StepInfo:
    """A step's `jaxckpt/jaxckpt.json`: what was saved, enough to check a restore target and
    rebuild the trees before any array is read."""

    step: int
    state: tuple[LeafSpec, ...]
    rng: tuple[LeafSpec, ...] = ()
    # the data-iterator state's kind: "json", "bytes", "grain" (an Orbax step's) or None
    data: str | None = None
    meta: Any = None  # the user's meta=
    # The rng tree's node types a restore without an rng= target cannot rebuild (nnx.Rngs).
    rng_node_types: tuple[str, ...] = ()
    saved_at: str | None = None
    process_count: int | None = None
    versions: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    # The leaves of each item written to packed/ rather than as Orbax arrays (format 2).
    packed: Mapping[str, frozenset[str]] = dataclasses.field(default_factory=dict)
    # Each item's nodes without children (`EmptyNode`); None: a step saved before they were.
    empty: Mapping[str, tuple[EmptyNode, ...]] | None = None
    # Not in jaxckpt.json: set for a step that plain Orbax wrote, whose `state` leaves are
    # those of its pytree item `item` (`data`, "grain": its grain item's states).
    orbax: OrbaxStep | None = None
    item: str = STATE

    def leaves(self, item: str) -> tuple[LeafSpec, ...]:
        return {STATE: self.state, RNG: self.rng}[item]

    def folder(self, directory: epath.Path) -> epath.Path:
        """The step's folder in `directory`."""
        return self.orbax.path if self.orbax else directory / str(self.step)

    @property
    def data_item(self) -> str:
        """The step's folder of per-process data-iterator states (grain's, for Orbax's)."""
        grain = self.orbax.items_of("grain") if self.orbax else []
        return grain[0] if grain else DATA

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT_VERSION if self.packed else 1,  # readable by older jaxckpt
            "step": self.step,
            "saved_at": self.saved_at,
            "versions": dict(self.versions),
            "process_count": self.process_count,
            "items": {item: [s.to_json() for s in self.leaves(item)] for item in ITEMS},
            "data": self.data,
            "node_types": {RNG: list(self.rng_node_types)},
            "packed": {item: sorted(names) for item, names in self.packed.items()},
            "empty": empty_to_json(self.empty),
            "meta": self.meta,
        }

    @classmethod
    def from_json(cls, doc: Any, step: int) -> StepInfo:
        """The document of step folder `step`, checked field by field: ValueError naming the
        first one that is not what jaxckpt writes, or a format newer than this jaxckpt's."""
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
        specs = {}
        for item in ITEMS:
            if not isinstance(items.get(item), list):
                raise ValueError(f"'items.{item}' is not a list of leaves")
            try:
                specs[item] = tuple(LeafSpec.from_json(spec) for spec in items[item])
            except ValueError as e:
                raise ValueError(f"'items.{item}': {e}") from None
        if doc.get("data") not in (None, "json", "bytes"):
            raise ValueError('\'data\' is not null, "json" or "bytes"')
        kinds = doc.get("node_types") or {}
        if not (
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
        packed = doc.get("packed") or {} if version >= 2 else {}
        if not isinstance(packed, dict):
            raise ValueError("'packed' is not an object")
        for item, names in packed.items():
            leaves = {s.name for s in specs.get(item, ())}
            if not (
                item in ITEMS
                and isinstance(names, list)
                and all(isinstance(n, str) and n in leaves for n in names)
            ):
                raise ValueError(f"'packed.{item}' is not a list of the item's leaf names")
        count = doc.get("process_count")
        if packed and not (isinstance(count, int) and 1 <= count <= MAX_PROCESSES):
            raise ValueError(
                f"'process_count' is not a process count (1 to {MAX_PROCESSES}), which "
                "packed leaves need"
            )
        return cls(
            step=step,
            state=specs[STATE],
            rng=specs[RNG],
            data=doc.get("data"),
            meta=doc.get("meta"),
            rng_node_types=tuple(kinds.get(RNG) or ()),
            saved_at=doc.get("saved_at"),
            process_count=doc.get("process_count"),
            versions=doc.get("versions") or {},
            packed={item: frozenset(names) for item, names in packed.items()},
            empty=empty_from_json(doc.get("empty"), ITEMS),
        )


@dataclasses.dataclass(frozen=True)
class OrbaxStep:
    """A step folder plain Orbax wrote, and its items: name -> kind ("pytree", "grain",
    "json", or "other": a folder no handler jaxckpt knows wrote). `bare`: the folder is
    itself the one pytree item, "default": a bare checkpoint directory, or a step that
    `flax.training.checkpoints` wrote (`checkpoint_<step>/`, one pytree)."""

    path: epath.Path
    items: Mapping[str, str]
    bare: bool = False

    def item_dir(self, item: str) -> epath.Path:
        return self.path if self.bare else self.path / item

    def items_of(self, kind: str) -> list[str]:
        return sorted(name for name, k in self.items.items() if k == kind)


# ------------------------------------------------------------------ a step's small files


def _corrupt(directory: epath.Path, step: int, problem: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(step, [problem], str(directory))


def _read_json(directory: epath.Path, step: int, rel: str) -> Any:
    """A small JSON file of the step, opened without following links: FileNotFoundError
    if it is not there, CorruptCheckpointError naming it if it cannot be read."""
    try:
        return json.loads(read_small(directory / str(step), rel))
    except (FileNotFoundError, StoreReadError):  # (the store failed, not the step)
        raise
    except (OSError, ValueError, RecursionError) as e:
        problem = "nested too deeply" if isinstance(e, RecursionError) else str(e)
        raise _corrupt(directory, step, f"{rel} is unreadable: {problem}") from None


def check_readable_size(info: StepInfo) -> None:
    """ConfigError when the step's jaxckpt.json would be longer than a reader reads whole
    (`_storage.small_file_limit`): a step no one could restore is never written. A rough
    bound first (a leaf's spec is its name and ~250 bytes); exact only near the limit."""
    specs = (*info.state, *info.rng)
    limit = small_file_limit()
    meta = len(json.dumps(info.meta)) if info.meta is not None else 0
    if 2 * meta + sum(2 * len(s.name) + 400 for s in specs) < limit:
        return
    size = len(json.dumps(info.to_json()).encode())
    if size > limit:
        raise ConfigError(
            f"step {info.step}: its metadata ({INFO_PATH}, {len(specs):,} leaves) would be "
            f"{size:,} bytes, over the {limit:,} a reader reads whole. Set "
            f"{SMALL_FILE_LIMIT_VARIABLE} above it, for the writer and every reader, or save "
            "fewer, larger leaves (or a smaller meta)"
        )


def read_info(directory: epath.Path, step: int) -> StepInfo:
    """The step's jaxckpt.json, every field checked: CorruptCheckpointError naming the first
    one that is not what jaxckpt writes (FileNotFoundError if there is none). Read as the
    plain file it is: no Orbax restore, no barrier between processes."""
    try:
        return StepInfo.from_json(_read_json(directory, step, INFO_PATH), step)
    except ValueError as e:
        raise _corrupt(directory, step, f"{INFO_PATH} is unreadable: {e}") from None


def read_data_about(
    directory: epath.Path, step: int, process: int, count: int
) -> dict[str, Any] | None:
    """What a process's data iterator was at save (None: a step saved before jaxckpt
    recorded it, or by another number of processes). CorruptCheckpointError when it is not
    what jaxckpt writes."""
    rel = f"{DATA}/{data_file('iterator', process, count)}"
    try:
        about = _read_json(directory, step, rel)
    except FileNotFoundError:
        return None
    if not (
        isinstance(about, dict)
        and isinstance(about.get("type"), str)
        and all(
            isinstance(about.get(k, []), list) and all(isinstance(e, str) for e in about.get(k, []))
            for k in ("state", "pipeline")
        )
        and isinstance(about.get("config", {}), dict)
    ):
        raise _corrupt(directory, step, f"{rel} is not an iterator description")
    return about


def read_data_state(directory: epath.Path, info: StepInfo, process: int, count: int) -> str:
    """A process's saved data-iterator state, the text it saved; read as a plain file (never
    through a link). DataStateError when the step holds none for this process."""
    name, folder = data_file("process", process, count), info.folder(directory)
    try:
        return read_small(folder, f"{info.data_item}/{name}").decode("utf-8")
    except FileNotFoundError:
        saved = sorted(p.name for p in (folder / info.data_item).glob("process_*.json"))
        raise DataStateError(
            f"step {info.step}: no data-iterator state for this process ({name}); the step "
            f"holds {saved}. It was saved with a different number of processes."
        ) from None
    except (OSError, UnicodeDecodeError) as e:
        problem = f"{info.data_item}/{name} is unreadable: {e}"
        raise _corrupt(directory, info.step, problem) from None


def read_data_states(directory: epath.Path, info: StepInfo) -> list[dict[str, Any]]:
    """Every process's saved data-iterator state (for `jaxckpt inspect --data`), parsed when
    it is JSON (grain's states are), else the saved text; read as plain files (never through
    a link), at most MAX_DATA_STATE_BYTES each."""
    kind, step, folder, item = info.data, info.step, info.folder(directory), info.data_item
    if kind is None:
        return []
    try:
        names = sorted(p.name for p in (folder / item).iterdir())
    except FileNotFoundError:
        names = []
    found = sorted(
        (int(m[1]), int(m[2]), name) for name in names if (m := DATA_STATE_FILE.fullmatch(name))
    )
    if not found:
        raise _corrupt(directory, step, f"{item}/ holds no process_<i>-of-<n>.json file")
    states = []
    for process, processes, name in found:
        rel = f"{item}/{name}"
        try:
            raw = read_small(folder, rel, limit=MAX_DATA_STATE_BYTES)
        except OSError as e:
            raise _corrupt(directory, step, f"{rel} is unreadable: {e.strerror or e}") from None
        text = raw.decode("utf-8", errors="replace")
        try:
            state = json.loads(text)
        except (ValueError, RecursionError):
            if kind == "json":
                problem = f"{rel} is not JSON, but the step records a JSON state"
                raise _corrupt(directory, step, problem) from None
            state = text
        states.append({"process": process, "processes": processes, "state": state})
    return states

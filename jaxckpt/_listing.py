"""A checkpoint directory listed once (`Listing.of`): its committed steps, jaxckpt's and
those plain Orbax wrote (`OrbaxStep`), the saves unfinished, the deletions under way, the
step-like folders no one can read and why, and a step number resolved (`Listing.resolve`).
What each name means is `jaxckpt._layout`'s.

jaxckpt lists a directory itself, once per listing, and never through Orbax's own listing,
which reads every step's metadata: one unreadable folder then stopped the whole directory,
and 10,000 steps took seconds for each listing. A listing stats each step folder it looks
into; the newest committed step alone is also read (its metadata parsed: O(1) reads), so
that a folder that only looks like a step is never the one a run resumes from.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

from etils import epath

from jaxckpt._layout import (
    DATA_STATE_FILE,
    DELETING_SUFFIX,
    INFO_PATH,
    META_DIR,
    ORBAX_COMMIT_FILE,
    ORBAX_COMMIT_FILES,
    ORBAX_DEFAULT_ITEM,
    ORBAX_JSON_FILE,
    ORBAX_LEGACY_FILE,
    ORBAX_TREE_FILE,
    RETIRED_SUFFIX,
    TMP_SUFFIX,
    TOMBSTONE_SUFFIX,
    OrbaxStep,
    orbax_step_of,
    read_info,
    step_of,
)
from jaxckpt._storage import StoreReadError, entries, file_sizes, is_remote, read_small
from jaxckpt.errors import (
    CorruptCheckpointError,
    NoCheckpointError,
    StepNotFoundError,
)


def no_checkpoint(
    directory: Any, unreadable: Mapping[str, str] | None = None, uncommitted: tuple[int, ...] = ()
) -> NoCheckpointError:
    """No committed step in `directory`; `unreadable`: the step-like folders found there,
    and why none of them can be read; `uncommitted`: the saves found unfinished."""
    found = [f"{name}: {why}" for name, why in sorted((unreadable or {}).items())[:5]]
    if uncommitted:
        steps = ", ".join(map(str, uncommitted))
        found.append(f"unfinished saves of step(s) {steps} (in progress, or cut off)")
    if found:
        return NoCheckpointError(
            f"no committed checkpoint in {directory}, which holds only what jaxckpt cannot "
            f"read: {'; '.join(found)}"
        )
    return NoCheckpointError(
        f"no committed checkpoint in {directory}. Check the path (a job starting from "
        "scratch finds latest_step() None)."
    )


def orbax_step(path: epath.Path) -> OrbaxStep | str:
    """The Orbax step in a step-like folder, or why it is none (a plain text)."""
    if _is_link(path):
        return "a symbolic link, which jaxckpt never follows"
    try:
        entries = list(path.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return "gone while it was listed"
    names = {p.name for p in entries}
    if is_remote(path) and ORBAX_COMMIT_FILE not in names:
        return f"no {ORBAX_COMMIT_FILE}: an Orbax save on object storage that never finished"
    if ORBAX_TREE_FILE in names or (path / ORBAX_LEGACY_FILE).is_file():
        return OrbaxStep(path, {ORBAX_DEFAULT_ITEM: "pytree"}, bare=True)
    kinds = {p.name: _item_kind(p) for p in entries if p.name not in names & ORBAX_COMMIT_FILES}
    items = {name: kind for name, kind in kinds.items() if kind is not None}
    if "pytree" not in items.values():
        held = ", ".join(sorted(names)[:8]) or "nothing"
        return f"no Orbax pytree item (a folder with {ORBAX_TREE_FILE}) in it; it holds: {held}"
    return OrbaxStep(path, items)


def _item_kind(path: epath.Path) -> str | None:
    """What an entry of an Orbax step folder is (None: a file, not an item)."""
    if _is_link(path) or not path.is_dir():
        return None
    names = {p.name for p in path.iterdir()}
    if ORBAX_TREE_FILE in names or ORBAX_LEGACY_FILE in names:
        return "pytree"
    if any(DATA_STATE_FILE.fullmatch(n) for n in names):
        return "grain"
    return "json" if names == {ORBAX_JSON_FILE} else "other"


@dataclasses.dataclass(frozen=True)
class Listing:
    """A checkpoint directory as one listing found it.

    committed: the committed steps, oldest first: jaxckpt's and those plain Orbax wrote.
    orbax: of those, the ones plain Orbax wrote, which jaxckpt reads and never touches.
    unfinished: the folders of saves in progress or cut off: name -> step (Orbax's
      `<step>.orbax-checkpoint-tmp`; on object storage, `<step>` without its commit file).
    folders: every step folder (committed, damaged or foreign; never one being written).
    unreadable: step-like folders no one can read here: name -> why.
    damaged: step folders that look like damaged steps: step -> why (jaxckpt's: empty, its
      metadata missing or unreadable; plain Orbax's: its tree metadata unreadable).
    deleting: the folders and tombstones of deletions under way (jaxckpt's own).
    retired: the steps retired (`_incremental`): their folders kept, out of every listing.
    prefixed: the steps of folders named otherwise than jaxckpt names them (`checkpoint_12`),
      looked into or not.
    read: the committed steps whose metadata was read and found readable, each with its
      folder's name (a later listing does not read them again).
    """

    directory: epath.Path
    committed: tuple[int, ...] = ()
    unfinished: Mapping[str, int] = dataclasses.field(default_factory=dict)
    folders: Mapping[int, epath.Path] = dataclasses.field(default_factory=dict)
    orbax: Mapping[int, OrbaxStep] = dataclasses.field(default_factory=dict)
    unreadable: Mapping[str, str] = dataclasses.field(default_factory=dict)
    damaged: Mapping[int, str] = dataclasses.field(default_factory=dict)
    deleting: tuple[str, ...] = ()
    retired: tuple[int, ...] = ()
    prefixed: frozenset[int] = frozenset()
    read: frozenset[tuple[int, str]] = frozenset()

    @property
    def own(self) -> tuple[int, ...]:
        """The committed steps jaxckpt wrote: the only ones its retention deletes."""
        return tuple(s for s in self.committed if s not in self.orbax)

    @property
    def uncommitted(self) -> tuple[int, ...]:
        """The steps of the saves in progress or cut off."""
        return tuple(sorted(set(self.unfinished.values())))

    @property
    def latest(self) -> int | None:
        return self.committed[-1] if self.committed else None

    @classmethod
    def of(
        cls,
        directory: epath.Path,
        *,
        newest: bool = False,
        known: Mapping[int, OrbaxStep] | None = None,
        read: frozenset[tuple[int, str]] = frozenset(),
    ) -> Listing:
        """Lists `directory` once, then looks into its step folders: a stat or two each
        (requests, on object storage), none read through Orbax; the newest committed step's
        metadata is read too (until one reads: O(1) reads). `newest`: from the newest step
        down, only until a committed one is found, so that the newest committed step costs
        the same whatever the number of steps. `known`: the Orbax steps an earlier listing
        found, and `read` the steps whose metadata it read (`Listing.read`), neither read
        again while their folder is there."""
        try:
            found = entries(directory)
        except (FileNotFoundError, NotADirectoryError):  # removed under a reader
            return cls(directory)
        return _Lister(directory, dict(found), known or {}, read).listing(newest)

    def resolve(self, step: int | None) -> int:
        """`step` if committed (None: the latest committed); jaxckpt's errors otherwise."""
        if step is None:
            if not self.committed:
                damaged = {str(s): f"damaged: {why}" for s, why in self.damaged.items()}
                damaged.update(self.unreadable)
                raise no_checkpoint(self.directory, damaged, self.uncommitted)
            return self.committed[-1]
        if step in self.damaged:
            raise CorruptCheckpointError(step, [self.damaged[step]], str(self.directory))
        if step not in self.committed:
            raise StepNotFoundError(step, self.committed, str(self.directory))
        return step


class _Lister:
    """One `Listing.of`: the directory's names, sorted into what each step folder is."""

    def __init__(self, directory: epath.Path, kinds: dict[str, str], known: Mapping, read: Any):
        self.directory, self.kinds, self.known, self.was_read = directory, kinds, known, read
        self.read: set[tuple[int, str]] = set()
        self.remote, self.base = is_remote(directory), str(directory)
        self.own: set[int] = set()
        self.orbax: dict[int, OrbaxStep] = {}
        self.folders: dict[int, epath.Path] = {}
        self.unreadable: dict[str, str] = {}
        self.damaged: dict[int, str] = {}
        self.unfinished: dict[str, int] = {}

    def listing(self, newest: bool) -> Listing:
        deleting, hidden, retired = [], set(), set()
        steps: dict[int, list[str]] = {}  # step: the names of its folders
        for name, kind in self.kinds.items():
            if name.endswith(RETIRED_SUFFIX) and kind == "file":
                if (step := step_of(name.removesuffix(RETIRED_SUFFIX))) is not None:
                    retired.add(step)
            elif name.endswith((DELETING_SUFFIX, TOMBSTONE_SUFFIX)):
                deleting.append(name)
                if name.endswith(TOMBSTONE_SUFFIX):  # it hides its step (object storage)
                    hidden.add(step_of(name.removesuffix(TOMBSTONE_SUFFIX)))
            elif TMP_SUFFIX in name and (step := step_of(name.split(".")[0])) is not None:
                self.unfinished[name] = step
            elif kind != "file" and (step := orbax_step_of(name)) is not None:
                steps.setdefault(step, []).append(name)
        bare = ORBAX_TREE_FILE in self.kinds or self.kinds.get(ORBAX_LEGACY_FILE) == "file"
        for step in sorted(steps.keys() - hidden - retired, reverse=newest):
            # its canonical folder first: `12` before `checkpoint_12`
            for name in sorted(steps[step], key=lambda n: (n != str(step), n)):
                self._sort(step, name, orbax=not bare)
            if newest and (self.own or self.orbax) and self._readable(step):
                break
        if not newest:  # the newest step a run would resume from, read; else the next
            for step in sorted(self.own | self.orbax.keys(), reverse=True):
                if self._readable(step):
                    break
        if bare and not self.own:  # the directory is itself one pytree: its folders are its own
            self.orbax = {0: OrbaxStep(self.directory, {ORBAX_DEFAULT_ITEM: "pytree"}, True)}
            self.folders, self.unreadable, self.damaged = {}, {}, {}
        return Listing(
            self.directory,
            committed=tuple(sorted(self.own | self.orbax.keys())),
            unfinished=self.unfinished,
            folders=self.folders,
            orbax=self.orbax,
            unreadable=self.unreadable,
            damaged=self.damaged,
            deleting=tuple(sorted(deleting)),
            retired=tuple(sorted(retired - hidden)),
            prefixed=frozenset(s for s, names in steps.items() if names != [str(s)]),
            read=frozenset(self.read),
        )

    def _readable(self, step: int) -> bool:
        """Whether the metadata of the committed `step` can be read: its jaxckpt.json, or
        each of its Orbax pytree items' tree metadata. If not, it is filed as damaged, with
        why, and is no longer committed."""
        found = self.orbax.get(step)
        key = (step, str(step) if found is None else found.path.name)
        if key in self.was_read or key in self.read:
            self.read.add(key)
            return True
        if step in self.own:
            try:
                read_info(self.directory, step)
            except FileNotFoundError:  # deleted since it was listed
                self.own.discard(step)
                return False
            except CorruptCheckpointError as e:
                self.own.discard(step)
                self.damaged[step] = "; ".join(e.problems)
                return False
            self.read.add(key)
            return True
        assert found is not None  # (committed: jaxckpt's or Orbax's)
        for item in found.items_of("pytree"):
            if why := _tree_problem(found.item_dir(item)):
                del self.orbax[step]
                self.folders[step] = found.path
                where = "" if found.bare else f"{item}/"
                folder = "" if found.path.name == str(step) else f"{found.path.name}: "
                self.damaged[step] = f"{folder}{where}{why}"
                return False
        self.read.add(key)
        return True

    def _has_info(self, name: str) -> bool:
        if self.remote:
            return (self.directory / name / INFO_PATH).exists()
        return os.path.exists(f"{self.base}/{name}/{INFO_PATH}")  # epath's joins cost more

    def _sort(self, step: int, name: str, *, orbax: bool) -> None:
        """Files the folder `name`, of `step`: a jaxckpt step, a damaged one, a save not
        committed, an Orbax step, or unreadable."""
        path = self.directory / name
        if name == str(step):
            if self.remote and not (path / ORBAX_COMMIT_FILE).exists():
                self.unfinished[name] = step  # a save's objects sit at its step's path
                return
            self.folders[step] = path
            if self.kinds[name] != "link" and self._has_info(name):  # (it follows links)
                self.own.add(step)
                return
            if why := damage(path):
                self.damaged[step] = why
                return
        if not orbax:
            return
        if step in self.own or step in self.orbax:
            other = self.folders[step].name if step in self.own else self.orbax[step].path.name
            self.unreadable[name] = f"step {step} is in folder {other} too"
            return
        found = self.known.get(step)
        if found is None or found.path != path:
            found = orbax_step(path)
        if isinstance(found, str):
            self.unreadable[name] = found
            return
        self.orbax[step] = found
        self.folders.setdefault(step, path)


def _tree_problem(item_dir: epath.Path) -> str | None:
    """Why the tree metadata of an Orbax pytree item cannot be read (None: it can): its
    `_METADATA` not a JSON object, or an empty msgpack `checkpoint` (releases before it)."""
    try:
        sizes = file_sizes(item_dir)
        if ORBAX_TREE_FILE in sizes:
            doc = json.loads(read_small(item_dir, ORBAX_TREE_FILE, sizes[ORBAX_TREE_FILE]))
            return None if isinstance(doc, dict) else f"{ORBAX_TREE_FILE} is not a JSON object"
        return None if sizes.get(ORBAX_LEGACY_FILE) else f"{ORBAX_LEGACY_FILE} is empty"
    except FileNotFoundError:
        return f"its tree metadata ({ORBAX_TREE_FILE}) is gone"
    except StoreReadError:  # the store failed, not the step: never a reason to pass it over
        raise
    except (OSError, ValueError, RecursionError) as e:
        return f"{ORBAX_TREE_FILE} is unreadable: {e}"


def is_bare(directory: epath.Path) -> bool:
    """Whether `directory` is itself one Orbax pytree (StandardCheckpointer's), not steps."""
    return (directory / ORBAX_TREE_FILE).exists() or (directory / ORBAX_LEGACY_FILE).is_file()


def _is_link(path: epath.Path) -> bool:
    return not is_remote(path) and os.path.islink(path)


def damage(step_dir: epath.Path) -> str | None:
    """Why a step folder that is not a committed jaxckpt step looks like a damaged one."""
    if _is_link(step_dir):
        return "the step folder is a symbolic link, which jaxckpt never follows"
    try:
        if not any(step_dir.iterdir()):
            return "empty step directory"
    except (FileNotFoundError, NotADirectoryError):  # deleted since it was listed
        return None
    if (step_dir / META_DIR).exists():
        return f"{INFO_PATH} is missing: the step's metadata is gone"
    return None

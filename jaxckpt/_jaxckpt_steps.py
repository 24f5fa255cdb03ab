"""Reading a jaxckpt step of the persistent tier: `JaxckptLayout`, the
`_read_interfaces.Layout` of a step jaxckpt wrote (`_orbax_steps.OrbaxLayout` reads one
plain Orbax wrote)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from etils import epath

from jaxckpt import _layout, _packed_read, _transfer
from jaxckpt._tree import ReadRequest


class StepFiles(Protocol):
    """What a step's layout reads its files through (`_orbax.OrbaxStore` is one)."""

    directory: epath.Path

    def step_dir(self, step: int) -> epath.Path: ...

    def check_sizes(self, info: _layout.StepInfo, item: str) -> None: ...

    def read_orbax_arrays(
        self, step: int, item: str, batch: Mapping[str, ReadRequest]
    ) -> dict[str, Any]: ...

    def open_file(self, folder: epath.Path, name: str, size: int | None = None) -> Any: ...


class JaxckptLayout:
    """A jaxckpt step of the persistent tier (`_read_interfaces.Layout`): its Orbax arrays, read
    through Orbax's handler (each file it reads whole checked for size first), and its
    packed leaves (`_transfer.PackedLayout`, every process's index read once); each leaf
    read checked against jaxckpt.json. Made once a step by its store (`OrbaxStore.layout`)."""

    whole = False

    def __init__(self, store: StepFiles, info: _layout.StepInfo):
        self._store, self._info = store, info
        self._checked: set[str] = set()  # items whose folder and file sizes were checked
        self._packed: _packed_read.PackedStep | None = None

    def read(self, item: str, batch: Mapping[str, ReadRequest]) -> dict[str, Any]:
        store, info, step = self._store, self._info, self._info.step
        packed = info.packed.get(item, frozenset())
        out: dict[str, Any] = {}
        if mine := {n: r for n, r in batch.items() if n in packed}:
            part = _transfer.PackedLayout(self.packed_step(item), step, store.directory)
            out.update(part.read(item, mine))
        if not (rest := {n: r for n, r in batch.items() if n not in packed}):
            return out
        if item not in self._checked:
            if not (store.step_dir(step) / item).exists():
                # every leaf was packed, yet jaxckpt.json names one more: as Orbax's would be
                name, request = next(iter(rest.items()))
                _transfer.check_read(step, item, name, None, request, store.directory)
            store.check_sizes(info, item)
            self._checked.add(item)
        with _transfer.read_errors(step, item, store.directory):
            got = store.read_orbax_arrays(step, item, rest)
        for name, request in rest.items():
            _transfer.check_read(step, item, name, got.get(name), request, store.directory)
        out.update(got)
        return out

    def packed_step(self, item: str) -> _packed_read.PackedStep:
        """The step's packed leaves, each process's index read once."""
        info, directory = self._info, self._store.directory
        with (
            _transfer.read_errors(info.step, item, directory),
            _transfer.corrupt_if_not_jaxckpts(info.step, directory),
        ):
            if self._packed is None:
                self._packed = _packed_read.PackedStep(
                    info.folder(directory) / _layout.PACKED,
                    info.process_count or 1,
                    opener=self._store.open_file,
                )
        return self._packed

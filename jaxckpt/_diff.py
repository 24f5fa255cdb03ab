"""What differs between two committed steps: leaves added, removed, changed in shape or
dtype, and (reading both) the largest absolute difference of each other leaf."""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Mapping

import numpy as np

from jaxckpt import _reader
from jaxckpt._plan import read_batches
from jaxckpt._tree import ReadRequest

COMPARE_BATCH_BYTES = 128 * 2**20  # read from each step at a time


@dataclasses.dataclass(frozen=True)
class StepDiff:
    """What `diff` found: leaf names added in b, removed from a, and changed in shape or
    dtype; with `values=True`, `max_abs_diff` for every other leaf both hold (0.0 where
    equal, None without `values`). `a` and `b` map each side's leaf names to their shape
    and dtype name (`((4, 2), "float32")`)."""

    steps: tuple[int, int]
    item: str
    a: Mapping[str, tuple[tuple[int, ...], str]]
    b: Mapping[str, tuple[tuple[int, ...], str]]
    added: list[str]
    removed: list[str]
    changed: list[str]
    max_abs_diff: Mapping[str, float] | None = None

    @property
    def differing(self) -> dict[str, float]:
        """The leaves whose values differ, with their largest absolute difference."""
        return {n: d for n, d in (self.max_abs_diff or {}).items() if d != 0}

    @property
    def different(self) -> bool:
        """Whether the steps differ: a leaf added, removed, changed, or differing."""
        return bool(self.added or self.removed or self.changed or self.differing)


def diff(
    directory_a: str | os.PathLike[str],
    directory_b: str | os.PathLike[str] | None = None,
    *,
    step_a: int | None = None,
    step_b: int | None = None,
    item: str = "state",
    values: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> StepDiff:
    """Compares a step of `directory_a` with one of `directory_b` (None: the same directory);
    a step None is the directory's latest committed one. `item`: "state" or "rng"; of a
    step plain Orbax wrote, "state" is its only pytree item, or name one of its pytree items.
    Reads metadata only, unless `values`: then each leaf both hold alike is read from both
    (on the host, in batches) and `progress(bytes compared, bytes to compare)` is called
    after each."""
    sides = ((directory_a, step_a), (directory_b or directory_a, step_b))
    with contextlib.ExitStack() as stack:
        ckpts = [stack.enter_context(_reader.open_reader(d)) for d, _ in sides]
        trees = [c.describe(s, item) for c, (_, s) in zip(ckpts, sides, strict=True)]
        (info_a, _), (info_b, _) = trees
        steps = (info_a.step, info_b.step)
        a, b = ({s.name: s for s in info.leaves(which)} for info, which in trees)
        both = a.keys() & b.keys()
        shape_a, shape_b = ({n: (s.shape, s.dtype) for n, s in side.items()} for side in (a, b))
        changed = sorted(n for n in both if shape_a[n] != shape_b[n])
        added, removed = sorted(b.keys() - a.keys()), sorted(a.keys() - b.keys())
        found = StepDiff(steps, item, shape_a, shape_b, added, removed, changed)
        if not values:
            return found
        same = {n: a[n] for n in sorted(both) if n not in changed}
        requests = {n: ReadRequest(s.stored_shape, s.stored_dtype, None) for n, s in same.items()}
        deltas, done, total = {}, 0, sum(s.nbytes for s in same.values())
        for ckpt, step in zip(ckpts, steps, strict=True):  # like every read: verified
            stack.enter_context(ckpt.verified(step))
        for batch in read_batches(requests, COMPARE_BATCH_BYTES):
            x_batch, y_batch = (
                ckpt.read_arrays(info, which, {n: requests[n] for n in batch})
                for ckpt, (info, which) in zip(ckpts, trees, strict=True)
            )
            for name in batch:
                deltas[name] = _max_abs_diff(x_batch[name], y_batch[name])
                done += same[name].nbytes
                if progress is not None:
                    progress(done, total)
        return dataclasses.replace(found, max_abs_diff=deltas)


def _max_abs_diff(x: np.ndarray, y: np.ndarray) -> float:
    x, y = np.asarray(x), np.asarray(y)
    wide: type[np.generic]
    if x.dtype.kind in "fcV" or x.dtype.name == "bfloat16":
        wide = np.float64
    elif x.dtype.kind == "b":
        wide = np.int8
    else:
        wide = np.int64
    return float(np.max(np.abs(x.astype(wide) - y.astype(wide)))) if x.size else 0.0

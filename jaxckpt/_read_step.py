"""One step's trees read onto a target, from either tier's `Store` (`jaxckpt._reader`'s
`Reader` for the persistent one, `jaxckpt._tiers` for the local one): the data iterator
checked against what was saved, each item planned (`_match.plan_restore`), its arrays read
through the store in batches (`_spread.read_arrays`), the trees rebuilt; and what a restore
asks for and returns."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from typing import Any

import jax

from jaxckpt import _iterators, _layout, _spread
from jaxckpt._agree import refusing
from jaxckpt._match import nest, plan_restore, replicated_sharding, uniform_requests
from jaxckpt._memory import returning_freed
from jaxckpt._read_interfaces import Store
from jaxckpt._tree import ReadRequest
from jaxckpt.errors import DataStateError, JaxckptError, TreeMismatchError

log = logging.getLogger("jaxckpt")


@dataclasses.dataclass(frozen=True)
class Restored:
    """What `CheckpointManager.restore` (and `Checkpoint.read`) returns.

    Attributes:
      step: the step restored.
      state: the state tree: the target's structure and shardings, or nested dicts/lists of
        host NumPy arrays when restored without a target (typed PRNG keys in it as JAX key
        arrays; empty nodes as plain Orbax restores them: None for optax's EmptyState).
      rng: the PRNG keys saved with `rng=` (same dtype and impl), or None.
      meta: the JSON `meta=` saved with the step, or None.
      data: the data iterator passed to `restore`, now at the saved position, or None.
      tier: where it came from: "local" (the local tier, `LocalTier`) or "persistent".
    """

    step: int
    state: Any
    rng: Any
    meta: Any
    data: Any
    tier: str = "persistent"


@dataclasses.dataclass(frozen=True)
class Wanted:
    """What a restore asks for (`CheckpointManager.restore`'s arguments)."""

    state: Any = None
    rng: Any = None
    data: Any = None
    mismatch_ok: bool = False
    partial: bool = False
    item: str | None = None


def check_data(info: _layout.StepInfo, data: Any, mismatch_ok: bool, directory: Any) -> None:
    """Refuses, before any array is read, a data iterator unlike the one saved (or one
    for a step saved without data=). Every process decides on its own iterator, then all
    agree (a collective), so that none reads arrays while another gave up."""
    if data is None:
        return
    try:
        problem: str | Exception | None = _iterators.problem(info, data, mismatch_ok, directory)
    except JaxckptError as e:  # a damaged description: raised once all processes know
        problem = e
    found = refusing(
        f"the check of the data iterator against step {info.step}",
        None if problem is None else str(problem),
    )
    if problem is None and found:
        problem = (
            f"process(es) {found} refused their data iterator for step {info.step} (their "
            "errors say why); nothing was read"
        )
    if isinstance(problem, Exception):
        raise problem
    if problem is not None:
        raise DataStateError(problem)


def items(
    info: _layout.StepInfo, wanted: Wanted
) -> list[tuple[str, Any, jax.sharding.Sharding | None, bool]]:
    """The items a restore reads: (item, target, home sharding, partial) each."""
    found: list[tuple[str, Any, jax.sharding.Sharding | None, bool]] = [
        (_layout.STATE, wanted.state, None, wanted.partial)
    ]
    if info.rng:
        found.append((_layout.RNG, wanted.rng, replicated_sharding(wanted.state), False))
    return found


def plan_item(
    info: _layout.StepInfo,
    item: str,
    target: Any,
    default_sharding: jax.sharding.Sharding | None,
    partial: bool,
) -> tuple[dict[str, ReadRequest], Callable[[Mapping[str, Any]], Any]]:
    """What to read of an item, and how to rebuild its tree from what was read."""
    specs = info.leaves(item)
    if target is None:
        empty = (info.empty or {}).get(item, ())
        return uniform_requests(specs, default_sharding), lambda arrays: nest(specs, arrays, empty)
    return plan_restore(
        target, specs, item=item, step=info.step, partial=partial, home=default_sharding
    )


def read_trees(store: Store, info: _layout.StepInfo, wanted: Wanted, budget: int) -> Restored:
    """The step's trees read from `store` (either tier's) onto the target, at most `budget`
    bytes at a time (`_spread.read_arrays`), no data iterator moved."""
    step, rng = info.step, wanted.rng
    kinds = info.rng_node_types
    if rng is None and info.rng and kinds:  # before any array is read
        raise TreeMismatchError(
            f"the PRNG keys of step {step} were saved from a tree of {', '.join(kinds)}, "
            "which a restore without an rng= target cannot rebuild: it would return "
            "nested dicts that e.g. nnx.update takes silently and dropout later fails on. "
            "Pass rng= an object of the same kind, built like the saved one (for "
            "nnx.Rngs: rng=nnx.state(rngs) of a fresh nnx.Rngs(...) with the same "
            "streams, then nnx.update(rngs, restored.rng))."
        )
    if not info.rng and rng is not None:
        raise TreeMismatchError(f"step {step} holds no PRNG keys (it was saved without rng=)")
    if info.data is not None and wanted.data is None:
        log.warning(
            "restore: step %d holds each process's data-iterator state, which is not "
            "restored without data=: pass data= an iterator built like the saved one to "
            "go on with the data where the run stopped",
            step,
        )
    trees = {}
    with returning_freed():  # each slice's staging back to the system once on its device
        for item, target, home, partial in items(info, wanted):
            requests, rebuild = plan_item(info, item, target, home, partial)
            trees[item] = rebuild(_spread.read_arrays(store, info, item, requests, budget=budget))
    return Restored(
        step=step, state=trees[_layout.STATE], rng=trees.get(_layout.RNG), meta=info.meta, data=None
    )

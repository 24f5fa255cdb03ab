"""The states `incremental.py` saves, made alike in every process, so that a restoring
process compares what it read with what was saved without reading it back."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

BASE = 18  # leaves of 25 MiB: 450 MiB
BASE_SHAPE = (2560, 2560)
TRAINED = 17  # adapters, and each of their two Adam moments: 17 leaves of 1 MiB each
TRAINED_SHAPE = (512, 512)
STATE_BYTES = (BASE * BASE_SHAPE[0] * BASE_SHAPE[1] + 3 * TRAINED * TRAINED_SHAPE[0] ** 2) * 4
CHANGED_BYTES = 3 * TRAINED * TRAINED_SHAPE[0] * TRAINED_SHAPE[1] * 4
SCENARIOS = ("frozen base, same arrays", "frozen base, new arrays", "pretraining")


@functools.cache
def _sharding() -> NamedSharding:
    auto = (jax.sharding.AxisType.Auto,) * 2
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=auto)
    return NamedSharding(mesh, P("data", "model"))


def _make(seed: int, shape: tuple[int, int]) -> jax.Array:
    make = jax.jit(lambda k: jax.random.normal(k, shape, jnp.float32), out_shardings=_sharding())
    return make(jax.random.key(seed))


def state(step: int, scenario: str, base: dict | None = None) -> dict:
    """The state saved at `step`: the trained part new at each step; the base new at each
    step in pretraining, else `base` itself (the same arrays) or new arrays of its bytes."""
    if scenario == "pretraining" or base is None:
        tag = step if scenario == "pretraining" else 0
        base = {f"layer{i:02d}": _make(10_000 * tag + i, BASE_SHAPE) for i in range(BASE)}
    elif scenario == "frozen base, new arrays":
        base = jax.tree.map(lambda x: x * 1.0, base)  # what a zero update makes: its bytes
    trained = {
        kind: {
            f"adapter{i:02d}": _make(1_000_000 + 1000 * step + 100 * k + i, TRAINED_SHAPE)
            for i in range(TRAINED)
        }
        for k, kind in enumerate(("params", "mu", "nu"))
    }
    return {"base": base, "trained": trained}

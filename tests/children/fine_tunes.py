"""Three fine-tunes with a frozen base, as their libraries' users write them, saved with
`incremental=True` at every step (tests/test_incremental_users.py):

- `nnx`: a Flax NNX model with `nnx.LoRA` adapters on its frozen `nnx.Linear` layers,
  trained by `nnx.Optimizer(..., wrt=nnx.LoRAParam)`;
- `linen`: a Flax Linen model whose base layers `optax.multi_transform` freezes
  (`optax.set_to_zero()`): every step makes new arrays of the base's bytes;
- `equinox`: an Equinox MLP whose first layers `eqx.partition` keeps out of the trained
  half, which the optimizer never sees.

`python -m children.fine_tunes KIND DIR STOP OUT`: restores the latest step in DIR (none:
a fresh start), trains and saves each step up to STOP, and writes OUT.npz (every leaf of
the final state) and OUT.json (each saved step's own bytes; the bytes of the state, of its trained part and of its
leaves of at most 1 MiB, which every save writes; the step it started from)."""

import json
import sys
from pathlib import Path

import jax

jax.config.update("jax_num_cpu_devices", 8)

import equinox as eqx  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import linen as nn  # noqa: E402
from flax import nnx  # noqa: E402

import jaxckpt  # noqa: E402
from jaxckpt._packed import MAX_LEAF_BYTES  # noqa: E402

WIDTH = 1024  # each frozen layer: WIDTH x WIDTH float32, 4 MiB


def batch(step):
    x = jax.random.normal(jax.random.key(step), (32, WIDTH))
    return x, jnp.sin(x[:, :8])


# --- Flax NNX: LoRA ------------------------------------------------------------------


class LoRAModel(nnx.Module):
    def __init__(self, rngs):
        self.layers = nnx.List(
            nnx.LoRA(WIDTH, 4, WIDTH, base_module=nnx.Linear(WIDTH, WIDTH, rngs=rngs), rngs=rngs)
            for _ in range(3)
        )
        self.head = nnx.LoRA(WIDTH, 4, 8, base_module=nnx.Linear(WIDTH, 8, rngs=rngs), rngs=rngs)

    def __call__(self, x):
        for layer in self.layers:
            x = nnx.relu(layer(x))
        return self.head(x)


@nnx.jit
def nnx_step(model, optimizer, x, y):
    def loss_fn(model):
        return jnp.mean((model(x) - y) ** 2)

    grads = nnx.grad(loss_fn, argnums=nnx.DiffState(0, nnx.LoRAParam))(model)
    optimizer.update(model, grads)


def nnx_run(mngr, stop):
    model = LoRAModel(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.LoRAParam)

    def state():
        return {"model": nnx.state(model), "opt": nnx.state(optimizer)}

    start = 0
    if mngr.latest_step() is not None:
        restored = mngr.restore(state=state())
        nnx.update(model, restored.state["model"])
        nnx.update(optimizer, restored.state["opt"])
        start = restored.step
    trained = nnx.state(model, nnx.LoRAParam)
    for step in range(start + 1, stop + 1):
        nnx_step(model, optimizer, *batch(step))
        mngr.save(step, state=state())
        mngr.wait()
    return state(), [trained, nnx.state(optimizer)], start


# --- Flax Linen: optax.multi_transform ----------------------------------------------


class LinenModel(nn.Module):
    @nn.compact
    def __call__(self, x):
        for i in range(3):
            x = nn.relu(nn.Dense(WIDTH, name=f"base{i}")(x))
        return nn.Dense(8, name="head")(x)


LINEN_TX = optax.multi_transform(
    {"trained": optax.adam(1e-3), "frozen": optax.set_to_zero()},
    lambda params: {k: "frozen" if k.startswith("base") else "trained" for k in params},
)


@jax.jit
def linen_step(params, opt, x, y):
    def loss_fn(params):
        return jnp.mean((LinenModel().apply({"params": params}, x) - y) ** 2)

    grads = jax.grad(loss_fn)(params)
    updates, opt = LINEN_TX.update(grads, opt, params)
    return optax.apply_updates(params, updates), opt


def linen_run(mngr, stop):
    params = LinenModel().init(jax.random.key(0), jnp.zeros((1, WIDTH)))["params"]
    state = {"params": params, "opt": LINEN_TX.init(params)}
    start = 0
    if mngr.latest_step() is not None:
        restored = mngr.restore(state=state)
        state, start = restored.state, restored.step
    for step in range(start + 1, stop + 1):
        params, opt = linen_step(state["params"], state["opt"], *batch(step))
        state = {"params": params, "opt": opt}
        mngr.save(step, state=state)
        mngr.wait()
    return state, [state["params"]["head"], state["opt"]], start


# --- Equinox: eqx.partition ----------------------------------------------------------

EQX_TX = optax.adam(1e-3)


def eqx_model():
    model = eqx.nn.MLP(WIDTH, 8, WIDTH, depth=3, key=jax.random.key(0))
    # the last layer is trained, the others frozen
    trained = jax.tree.map(lambda _: False, model)
    trained = eqx.tree_at(
        lambda m: (m.layers[-1].weight, m.layers[-1].bias), trained, replace=(True, True)
    )
    return model, trained


@eqx.filter_jit
def eqx_step(diff, static, opt, x, y):
    def loss_fn(diff):
        return jnp.mean((jax.vmap(eqx.combine(diff, static))(x) - y) ** 2)

    grads = eqx.filter_grad(loss_fn)(diff)
    updates, opt = EQX_TX.update(grads, opt, diff)
    return eqx.apply_updates(diff, updates), opt


def eqx_run(mngr, stop):
    model, trained = eqx_model()
    diff, frozen = eqx.partition(model, trained)
    opt = EQX_TX.init(eqx.filter(diff, eqx.is_array))

    def state():
        return {"model": eqx.filter(eqx.combine(diff, frozen), eqx.is_array), "opt": opt}

    start = 0
    if mngr.latest_step() is not None:
        restored = mngr.restore(state=state())
        model = eqx.combine(restored.state["model"], eqx.partition(model, eqx.is_array)[1])
        diff, frozen = eqx.partition(model, trained)
        opt, start = restored.state["opt"], restored.step
    for step in range(start + 1, stop + 1):
        diff, opt = eqx_step(diff, frozen, opt, *batch(step))  # the frozen half: as it is
        mngr.save(step, state=state())
        mngr.wait()
    return state(), [eqx.filter(diff, eqx.is_array), opt], start


def nbytes(tree, at_most=None):
    """The bytes of the tree's arrays (of those of at most `at_most` bytes)."""
    sizes = [x.nbytes for x in jax.tree.leaves(tree) if hasattr(x, "nbytes")]
    return sum(n for n in sizes if at_most is None or n <= at_most)


if __name__ == "__main__":
    kind, directory, stop, out = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    run = {"nnx": nnx_run, "linen": linen_run, "equinox": eqx_run}[kind]
    with jaxckpt.CheckpointManager(directory, incremental=True) as mngr:
        final, trained, start = run(mngr, stop)
    leaves = jax.tree_util.tree_leaves_with_path(final)
    np.savez(f"{out}.npz", **{jax.tree_util.keystr(p): np.asarray(v) for p, v in leaves})
    own = {
        step.name: sum(f.stat().st_size for f in (step / "packed").glob("*.bin"))
        for step in directory.iterdir()
        if step.name.isdigit()
    }
    report = {
        "start": start,  # the step restored (0: none)
        "own_bytes": own,
        "state_bytes": nbytes(final),
        "trained_bytes": nbytes(trained),
        # a save writes every leaf of at most MAX_LEAF_BYTES; the trained ones are among them
        "small_bytes": nbytes(final, MAX_LEAF_BYTES),
        "trained_small_bytes": nbytes(trained, MAX_LEAF_BYTES),
    }
    Path(f"{out}.json").write_text(json.dumps(report))

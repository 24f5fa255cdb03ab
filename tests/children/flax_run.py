"""A Linen training run that checkpoints the way Flax's imagenet, wmt and lm1b examples do
(`flax.training.checkpoints.save_checkpoint`), or the same loop switched to jaxckpt and
resuming from whatever the work directory holds, for tests/test_from_flax.py:

    python tests/children/flax_run.py --workdir W --steps 20 --stop-at 10 --with flax
    python tests/children/flax_run.py --workdir W --steps 20 --with jaxckpt

Each step's loss is printed as float32 bits (`LOSS <step> <bits>`), and the final state's
leaves as `FINAL <crc32 of every leaf's bytes>`.
"""

import argparse
import zlib

import jax

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import linen as nn  # noqa: E402
from flax.training import checkpoints, train_state  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxckpt  # noqa: E402


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(32)(x))
        return nn.Dense(4)(x)


def batch(step):
    key = jax.random.fold_in(jax.random.key(1), step)
    x = jax.random.normal(key, (16, 8))
    return x, jnp.sin(x[:, :4])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--stop-at", type=int)
    parser.add_argument("--with", dest="using", choices=["flax", "jaxckpt"], required=True)
    args = parser.parse_args()

    auto = (jax.sharding.AxisType.Auto,) * 2
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=auto)
    model = MLP()

    def create():
        params = model.init(jax.random.key(0), jnp.zeros((1, 8)))
        return train_state.TrainState.create(
            apply_fn=model.apply, params=params, tx=optax.adam(1e-2)
        )

    abstract = jax.eval_shape(create)
    shardings = jax.tree.map(lambda _: NamedSharding(mesh, P()), abstract)
    state = jax.jit(create, out_shardings=shardings)()

    @jax.jit
    def train_step(state, x, y):
        def loss_fn(params):
            return jnp.mean((state.apply_fn(params, x) - y) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    start = 0
    mngr = None
    if args.using == "flax":
        state = checkpoints.restore_checkpoint(args.workdir, target=state)
        start = int(state.step)
    else:  # the Quickstart's resume, on a directory Flax wrote
        mngr = jaxckpt.CheckpointManager(args.workdir, policy=jaxckpt.SavePolicy(every_steps=5))
        if mngr.latest_step() is not None:
            target = jax.tree.map(
                lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings
            )
            state = mngr.restore(state=target).state
            start = int(state.step)
            print(f"resumed from step {start}", flush=True)
    for step in range(start + 1, args.steps + 1):
        state, loss = train_step(state, *batch(step))
        print(f"LOSS {step} {np.float32(loss).view(np.uint32)}", flush=True)
        if args.using == "flax" and step % 5 == 0:
            checkpoints.save_checkpoint(args.workdir, state, step=step, keep=10)
        elif mngr is not None and mngr.should_save(step):
            mngr.save(step, state=state)
        if step == args.stop_at:
            break
    if mngr is not None:
        mngr.close()
    crc = 0
    for leaf in jax.tree.leaves(state):
        crc = zlib.crc32(np.asarray(leaf).tobytes(), crc)
    print(f"FINAL {crc}", flush=True)


if __name__ == "__main__":
    main()

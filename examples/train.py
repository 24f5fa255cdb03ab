"""Train a small Flax NNX language model on 8 CPU devices, checkpointing with jaxckpt.

The loop a user copies: an NNX model with dropout, optax AdamW with a warmup-cosine
schedule, a shuffled grain pipeline, a (data, model) mesh; jaxckpt saves the model and
optimizer state, the loop's PRNG key, the grain iterator position and run metadata
asynchronously, and a restarted process resumes from the latest committed step exactly.

    python examples/train.py --config configs/demo.yaml --steps 40 --ckpt-dir /tmp/run
    python examples/train.py --steps 40 --ckpt-dir /tmp/run --stop-at 20   # stop after 20
    python examples/train.py --steps 40 --ckpt-dir /tmp/run                # resumes at 20

Each step's loss is appended to `--log` (JSON lines, with the float32 bits so runs can be
compared bitwise); `--final` writes the final model and optimizer state to an .npz file.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import time
import zlib
from pathlib import Path

import jax

if __name__ == "__main__":  # before any device is touched
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", 8)

import grain
import jax.numpy as jnp
import numpy as np
import optax
import yaml
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script, too
from examples.gpt2 import GPT2, RULES, GPT2Config


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = 64
    seq_len: int = 16
    d_model: int = 64
    layers: int = 2
    heads: int = 4
    dropout: float = 0.1
    batch: int = 16
    peak_lr: float = 3e-3
    warmup: int = 5
    total_steps: int = 40
    seed: int = 0
    mesh_shape: tuple[int, int] = (4, 2)
    # logical axis (examples/gpt2.py's annotations) -> mesh axis or None
    rules: tuple[tuple[str, str | None], ...] = RULES

    def model(self) -> GPT2Config:
        return GPT2Config(
            vocab_size=self.vocab,
            n_positions=self.seq_len,
            n_embd=self.d_model,
            n_layer=self.layers,
            n_head=self.heads,
            dropout=self.dropout,
        )


def make_mesh(shape: tuple[int, int]) -> jax.sharding.Mesh:
    return jax.make_mesh(shape, ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


def make_optimizer_tx(cfg: Config) -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(0.0, cfg.peak_lr, cfg.warmup, cfg.total_steps)
    return optax.adamw(schedule, weight_decay=0.01)


def build(cfg: Config) -> tuple[GPT2, nnx.Optimizer]:
    model = GPT2(cfg.model(), nnx.Rngs(params=cfg.seed, dropout=cfg.seed + 1))
    return model, nnx.Optimizer(model, make_optimizer_tx(cfg), wrt=nnx.Param)


def abstract_state(cfg: Config) -> nnx.State:
    """The train state (as `state_of` saves it) as shapes, dtypes and logical annotations,
    holding no memory: `jaxckpt.target_from_flax(abstract_state(cfg), mesh, cfg.rules)`
    places it on any mesh, as a restore target or to shard a new state."""
    return nnx.State(state_of(*nnx.eval_shape(lambda: build(cfg))))


def create_train_state(cfg: Config, mesh: jax.sharding.Mesh):
    """Builds the model and optimizer with every array placed per its annotation.

    Returns the model, the optimizer and the state's shardings. The train step pins its
    outputs to the same shardings: then a restored state (which lands on these shardings)
    runs the very same compiled program as the uninterrupted run, so results are bitwise
    equal. Left to XLA's propagation, unannotated leaves (biases) change sharding after the
    first step, and a resumed run would differ in the last bits.
    """
    # Each array's sharding from its logical axes and the config's rules.
    placed = jaxckpt.target_from_flax(abstract_state(cfg), mesh, cfg.rules)
    shardings = jax.tree.map(lambda x: x.sharding, placed)

    @nnx.jit
    def create():
        model, optimizer = build(cfg)
        pin(model, optimizer, shardings)
        return model, optimizer

    with jax.set_mesh(mesh):
        model, optimizer = create()
    return model, optimizer, shardings


def pin(model: GPT2, optimizer: nnx.Optimizer, shardings: nnx.State) -> None:
    """Inside jit: constrains the state to `shardings`, in place."""
    state = jax.lax.with_sharding_constraint(nnx.State(state_of(model, optimizer)), shardings)
    nnx.update(model, state["model"])
    nnx.update(optimizer, state["opt"])


def make_data(cfg: Config) -> grain.DatasetIterator:
    """Synthetic token sequences with structure to learn, shuffled and batched by grain."""
    rng = np.random.default_rng(1234)
    n = 1024
    start = rng.integers(0, cfg.vocab, size=(n, 1))
    stride = rng.integers(1, 4, size=(n, 1))
    tokens = ((start + stride * np.arange(cfg.seq_len + 1)) % cfg.vocab).astype(np.int32)
    ds = (
        grain.MapDataset.source(tokens)
        .shuffle(seed=cfg.seed)
        .repeat()
        .batch(cfg.batch, drop_remainder=True)
    )
    return iter(ds.to_iter_dataset())


def make_train_step(shardings):
    """The jitted step; its outputs are pinned to `shardings` (see create_train_state)."""

    @nnx.jit
    def train_step(model: GPT2, optimizer: nnx.Optimizer, tokens: jax.Array, key: jax.Array):
        # Blank 10% of the inputs: uses the loop's own PRNG key, which jaxckpt saves.
        inputs = jnp.where(jax.random.bernoulli(key, 0.1, tokens[:, :-1].shape), 0, tokens[:, :-1])

        def loss_fn(model):
            logits = model(inputs)
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        pin(model, optimizer, shardings)
        return loss

    return train_step


def state_of(model: GPT2, optimizer: nnx.Optimizer) -> dict:
    return {"model": nnx.state(model), "opt": nnx.state(optimizer)}


def to_host(tree) -> dict[str, np.ndarray]:
    """Flat {path: host array}; PRNG keys as their key data, for bitwise comparison."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        out[jax.tree_util.keystr(path)] = np.asarray(leaf)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, help="YAML file of Config fields (configs/*.yaml)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument(
        "--ckpt-dir", help="checkpoint directory, local, gs:// or s3:// (omit: no checkpoints)"
    )
    parser.add_argument("--save-every", type=int, default=10, help="save every N steps")
    parser.add_argument(
        "--save-every-seconds", type=float, help="also save when this long has passed"
    )
    parser.add_argument("--stop-at", type=int, help="stop the process after this step")
    parser.add_argument(
        "--kill", action="store_true", help="with --stop-at: SIGKILL ourselves, no clean shutdown"
    )
    parser.add_argument("--mesh", help="data x model mesh shape, e.g. 4x2 (overrides the config)")
    parser.add_argument("--log", type=Path, help="append per-step losses here (JSON lines)")
    parser.add_argument("--print-every", type=int, default=0, help="print the loss every N steps")
    parser.add_argument("--final", type=Path, help="write the final state here (.npz)")
    args = parser.parse_args(argv)

    fields = yaml.safe_load(args.config.read_text()) if args.config else {}
    fields["total_steps"] = args.steps
    if args.mesh:
        fields["mesh_shape"] = args.mesh.split("x")
    fields["mesh_shape"] = tuple(int(n) for n in fields.get("mesh_shape", Config.mesh_shape))
    fields["rules"] = tuple(tuple(rule) for rule in fields.get("rules", Config.rules))
    cfg = Config(**fields)
    mesh = make_mesh(cfg.mesh_shape)
    model, optimizer, shardings = create_train_state(cfg, mesh)
    train_step = make_train_step(shardings)
    data = make_data(cfg)
    key = jax.random.key(cfg.seed + 2)
    batch_sharding = NamedSharding(mesh, P("data"))

    mngr, start = None, 0
    if args.ckpt_dir is not None:
        mngr = jaxckpt.CheckpointManager(
            args.ckpt_dir,
            policy=jaxckpt.SavePolicy(
                every_steps=args.save_every, every_seconds=args.save_every_seconds
            ),
        )
        if mngr.latest_step() is not None:
            # The fresh state is the target: its shardings say where every restored array lands.
            restored = mngr.restore(state=state_of(model, optimizer), data=data)
            nnx.update(model, restored.state["model"])
            nnx.update(optimizer, restored.state["opt"])
            key, start = restored.rng, restored.step
            print(f"resumed from step {start} (mesh {cfg.mesh_shape})", flush=True)

    log = args.log.open("a") if args.log else None
    for step in range(start + 1, cfg.total_steps + 1):
        batch = next(data)
        tokens = jax.device_put(batch, batch_sharding)
        key, step_key = jax.random.split(key)
        loss = np.float32(train_step(model, optimizer, tokens, step_key))
        if log:
            record = {
                "step": step,
                "loss": float(loss),
                "bits": int(loss.view(np.uint32)),  # for bitwise comparison
                "batch_crc": zlib.crc32(batch.tobytes()),  # the data order
            }
            log.write(json.dumps(record) + "\n")
            log.flush()
        if mngr is not None and mngr.should_save(step):  # call it every step (preemption)
            t0 = time.perf_counter()
            mngr.save(
                step,
                state=state_of(model, optimizer),
                rng=key,
                data=data,
                meta={"loss": float(loss), "config": dataclasses.asdict(cfg)},
            )
            print(
                f"step {step}: loss {loss:.4f}, checkpoint started ({time.perf_counter() - t0:.3f}s blocking)",
                flush=True,
            )
        elif args.print_every and step % args.print_every == 0:
            print(f"step {step}: loss {loss:.4f}", flush=True)
        if mngr is not None and mngr.preempted:  # SIGTERM: the step was just saved
            mngr.close()
            print(f"preempted: saved step {step}, exiting", flush=True)
            return 0
        if step == args.stop_at:
            if args.kill:
                os.kill(os.getpid(), signal.SIGKILL)  # a crash: nothing gets to clean up
            if mngr is not None:
                mngr.close()
            print(f"stopped after step {step}", flush=True)
            return 0
    if mngr is not None:
        mngr.close()
    if args.final:
        np.savez(args.final, **to_host(state_of(model, optimizer)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The Flax NNX MNIST tutorial's training code, checkpointed by the Quickstart's loop.

The model, optimizer, metrics and train step are written the way the tutorial
(google/flax `docs_nnx/mnist_tutorial.md`) writes them: a small CNN with dropout that holds
its own `nnx.Rngs` stream, `nnx.Optimizer(model, optax.adamw(...), wrt=nnx.Param)`,
`nnx.MultiMetric(accuracy=..., loss=...)`, and an `nnx.jit` train step that updates all three
in place. No mesh and no sharding: arrays live where the tutorial leaves them. The data is
synthetic MNIST-shaped images through a shuffled grain pipeline (no download). The
checkpointing is the Quickstart's loop: save on schedule or at a preemption notice
(SIGTERM), resume from the latest committed step with the live state as the target.

    python examples/nnx_mnist.py --ckpt-dir /tmp/mnist --steps 30 --log losses.jsonl
    python examples/nnx_mnist.py --ckpt-dir /tmp/mnist --steps 30 --sigterm-at 12  # preempted
    python examples/nnx_mnist.py --ckpt-dir /tmp/mnist --steps 30                  # resumes

Each step's loss and the metrics are appended to `--log` as JSON lines (with the float32
bits), so that a preempted-and-resumed run can be compared bitwise with a straight one.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from functools import partial

import jax

if __name__ == "__main__":
    jax.config.update("jax_platforms", "cpu")

import grain
import numpy as np
import optax
from flax import nnx

import jaxckpt

BATCH = 32


class CNN(nnx.Module):
    """The tutorial's CNN, with its dropout (which keeps an RngStream of its own)."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, 32, kernel_size=(3, 3), rngs=rngs)
        self.conv2 = nnx.Conv(32, 64, kernel_size=(3, 3), rngs=rngs)
        self.avg_pool = partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
        self.dropout = nnx.Dropout(rate=0.1, rngs=rngs)
        self.linear1 = nnx.Linear(3136, 256, rngs=rngs)
        self.linear2 = nnx.Linear(256, 10, rngs=rngs)

    def __call__(self, x):
        x = self.avg_pool(nnx.relu(self.conv1(x)))
        x = self.avg_pool(nnx.relu(self.conv2(x)))
        x = x.reshape(x.shape[0], -1)
        x = self.dropout(nnx.relu(self.linear1(x)))
        return self.linear2(x)


def loss_fn(model: CNN, batch):
    logits = model(batch["image"])
    loss = optax.softmax_cross_entropy_with_integer_labels(
        logits=logits, labels=batch["label"]
    ).mean()
    return loss, logits


@nnx.jit
def train_step(model: CNN, optimizer: nnx.Optimizer, metrics: nnx.MultiMetric, batch):
    grad_fn = nnx.value_and_grad(loss_fn, has_aux=True)
    (loss, logits), grads = grad_fn(model, batch)
    metrics.update(loss=loss, logits=logits, labels=batch["label"])
    optimizer.update(model, grads)
    return loss


def dataset(seed: int = 0) -> grain.MapDataset:
    """MNIST-shaped records (28x28x1 images, labels 0-9), shuffled and batched by grain."""
    rng = np.random.default_rng(seed)
    images = rng.random((1024, 28, 28, 1), dtype=np.float32)
    labels = rng.integers(0, 10, 1024).astype(np.int32)
    records = grain.MapDataset.source(list(zip(images, labels, strict=True)))
    records = records.shuffle(seed=seed).map(lambda r: {"image": r[0], "label": r[1]})
    return records.repeat().batch(BATCH, drop_remainder=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt-dir", required=True)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--every", type=int, default=5, help="save every N steps")
    parser.add_argument("--log", help="append each step's loss and metrics (JSON lines)")
    parser.add_argument("--sigterm-at", type=int, help="send this process SIGTERM after step N")
    args = parser.parse_args(argv)

    model = CNN(rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adamw(0.005, 0.9), wrt=nnx.Param)
    metrics = nnx.MultiMetric(
        accuracy=nnx.metrics.Accuracy(),
        loss=nnx.metrics.Average("loss"),
    )

    # ---- the Quickstart's loop (with the tutorial's metrics kept too)
    mngr = jaxckpt.CheckpointManager(
        args.ckpt_dir,
        policy=jaxckpt.SavePolicy(every_steps=args.every),
        retention=jaxckpt.RetentionPolicy(keep_last=3),
    )
    data, key, start = iter(dataset().to_iter_dataset()), jax.random.key(0), 0
    train_state = lambda: {  # noqa: E731
        "model": nnx.state(model),
        "opt": nnx.state(optimizer),
        "metrics": nnx.state(metrics),
    }

    if mngr.latest_step() is not None:  # resume: the live state is the target
        restored = mngr.restore(state=train_state(), data=data)
        nnx.update(model, restored.state["model"])
        nnx.update(optimizer, restored.state["opt"])
        nnx.update(metrics, restored.state["metrics"])
        key, start = restored.rng, restored.step
        print(f"resumed from step {start}", flush=True)

    log = open(args.log, "a") if args.log else None  # noqa: SIM115
    for step in range(start + 1, args.steps + 1):
        key, _ = jax.random.split(key)  # the Quickstart's loop key, saved with each step
        loss = train_step(model, optimizer, metrics, next(data))
        if log is not None:
            values = {k: float(v) for k, v in metrics.compute().items()}
            bits = int(np.asarray(loss, np.float32).view(np.uint32))
            log.write(json.dumps({"step": step, "loss": float(loss), "bits": bits, **values}))
            log.write("\n")
            log.flush()
        if args.sigterm_at == step:
            os.kill(os.getpid(), signal.SIGTERM)  # a preemption notice arrives
        if mngr.should_save(step):  # on schedule, or at a preemption notice (SIGTERM)
            mngr.save(step, state=train_state(), rng=key, data=data, meta={"loss": float(loss)})
        if mngr.preempted:  # the step was just saved: exit, the next job resumes from it
            print(f"preempted: saved step {step}", flush=True)
            break
    mngr.close()  # waits for the last save; raises if it failed


if __name__ == "__main__":
    main()

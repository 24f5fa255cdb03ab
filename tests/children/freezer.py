"""Saves step 1, then step 2, and stops itself (SIGSTOP) once step 2's arrays are written,
before its commit: the parent (tests/test_atomicity.py) kills it there.

    python -m children.freezer DIRECTORY N
"""

import sys

import jax
import jax.numpy as jnp

import jaxckpt
from jaxckpt import _internals
from reliability import faults


def main() -> None:
    jax.config.update("jax_num_cpu_devices", 8)
    directory, n = sys.argv[1], int(sys.argv[2])
    m = jaxckpt.CheckpointManager(directory)
    m.save(1, state={"x": jnp.arange(n, dtype=jnp.float32) + 1}, meta={"step": 1})
    m.wait()

    def freeze():  # step 2's arrays are written, its commit not yet made
        faults.stop_here()  # the parent kills us now

    with _internals.on_writes_done(freeze):
        m.save(2, state={"x": jnp.arange(n, dtype=jnp.float32) + 2}, meta={"step": 2})
        m.wait()


if __name__ == "__main__":
    main()

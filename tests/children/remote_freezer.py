"""Saves step 1 to object storage, starts a 64 MiB step 2 and stops itself (SIGSTOP) once
its first objects are written: the parent (tests/test_object_storage.py) kills it mid-save.

    python -m children.remote_freezer GS_OR_S3_DIRECTORY
"""

import os
import signal
import sys

import jax
import jax.numpy as jnp
from etils import epath

import jaxckpt


def main() -> None:
    jax.config.update("jax_platforms", "cpu")
    directory = sys.argv[1]
    m = jaxckpt.CheckpointManager(directory, writer_lease_s=2)
    m.save(1, state={"x": jnp.arange(1 << 20, dtype=jnp.float32) + 1})
    m.wait()
    m.save(2, state={"x": jnp.arange(1 << 24, dtype=jnp.float32) + 2})  # 64 MiB: takes a while
    while not (epath.Path(directory) / "2").exists():  # until its first objects are written
        pass
    os.kill(os.getpid(), signal.SIGSTOP)  # frozen mid-save: the parent kills us now


if __name__ == "__main__":
    main()

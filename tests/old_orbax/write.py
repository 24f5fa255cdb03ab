"""Writes checkpoints with orbax-checkpoint 0.2.3, the oldest release that runs here, as
its documentation of the time shows (run by tests/test_from_orbax.py with the Python of
.venv-orbax-0.2.3, which `make test` installs from tests/old_orbax/requirements.txt):

    python write.py OUT    # OUT/manager (steps 0 and 1, one item), OUT/items (steps 0
                           # and 1, a pytree and a JSON item), OUT/bare (no steps)

The tree is tests/children/orbax_written.py's MaxText-style state, with optax's Adam state
written out (optax is not installed beside this old jax): the kernel is sharded on a
(4, 2) data x model mesh of 8 CPU devices.
"""

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.sharding import Mesh, NamedSharding, PartitionSpec

STEP = 7
KERNEL = np.arange(8 * 16, dtype=np.float32).reshape(8, 16)


def state():
    mesh = Mesh(np.asarray(jax.devices()).reshape(4, 2), ("data", "model"))
    kernel = jax.device_put(KERNEL, NamedSharding(mesh, PartitionSpec("data", "model")))
    params = {"params": {"dense": {"kernel": kernel, "bias": jnp.arange(16, dtype=jnp.float32)}}}
    zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
    adam = {"count": jnp.asarray(0, jnp.int32), "mu": zeros, "nu": zeros}
    return {"params": params, "opt_state": [adam], "step": jnp.asarray(STEP, jnp.int32)}


def main(out: epath.Path) -> None:
    assert len(jax.devices()) == 8, jax.devices()
    tree = state()
    manager = ocp.CheckpointManager(
        out / "manager", ocp.Checkpointer(ocp.PyTreeCheckpointHandler())
    )
    for step in (0, STEP):
        assert manager.save(step, tree)
    manager.wait_until_finished()
    items = ocp.CheckpointManager(
        out / "items",
        {
            "state": ocp.Checkpointer(ocp.PyTreeCheckpointHandler()),
            "extra": ocp.Checkpointer(ocp.JsonCheckpointHandler()),
        },
    )
    for step in (0, STEP):
        assert items.save(step, {"state": tree, "extra": {"epoch": step}})
    items.wait_until_finished()
    ocp.PyTreeCheckpointer().save(out / "bare", tree)
    print("orbax-checkpoint", ocp.__version__ if hasattr(ocp, "__version__") else "?")


if __name__ == "__main__":
    main(epath.Path(sys.argv[1]))

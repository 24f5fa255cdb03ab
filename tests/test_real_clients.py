"""jaxckpt used the way training code uses it, with the real objects: optax optimizers,
flax.nnx modules, optimizers, metrics and Rngs, grain pipelines and DataLoaders.

Each test is a bug a user met (issue 15): it failed before the fix.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from click.testing import CliRunner
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from jaxckpt import errors
from jaxckpt.cli import main


def cli(*args):
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert "Traceback" not in result.output, result.output
    return result


class MLP(nnx.Module):
    def __init__(self, hidden: int, rngs: nnx.Rngs):
        self.linear1 = nnx.Linear(4, hidden, rngs=rngs)
        self.linear2 = nnx.Linear(hidden, 2, rngs=rngs)

    def __call__(self, x):
        return self.linear2(nnx.relu(self.linear1(x)))


# ------------------------------------------------------------------ one spelling of a leaf


def test_errors_name_leaves_as_inspect_lists_and_filters_them(ckpt_dir):
    with jaxckpt.CheckpointManager(ckpt_dir) as m:
        m.save(1, state={"model": nnx.state(MLP(8, nnx.Rngs(0)))})
        with pytest.raises(errors.LeafMismatchError) as info:
            m.restore(state={"model": nnx.state(MLP(16, nnx.Rngs(0)))})
    message = str(info.value)
    assert "leaf model.linear1.bias.value: shape (16,) dtype float32 in the target" in message
    assert "['model']" not in message and "].value" not in message

    listed = cli("inspect", ckpt_dir, "--filter", "model.linear1.bias.value")
    assert listed.exit_code == 0, listed.output
    assert re.search(r"^model\.linear1\.bias\.value\s+\(8,\)", listed.output, re.M)
    assert "1 leaves" in listed.output

"""The job of tests/test_hf.py (run by children.job in every process): a sharded live state
written to safetensors by each process, without gathering, under `job.args["out"]`."""

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from children.job import Job


def save_sharded(job: Job) -> dict:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((8, 6), dtype=np.float32)
    s = rng.standard_normal((3, 4, 6), dtype=np.float32)
    h = rng.standard_normal((2, 8, 3), dtype=np.float32)
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)

    def put(x, spec):
        return jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec), lambda i: x[i])

    state = {
        "w": put(w, P("data", "model")),
        "col": put(w, P(None, "model")),
        "rep": put(w, P()),
        "stack": put(s, P(None, "model", None)),
        "n": np.arange(3),
        # Each process holds half of axis 1: its block cuts inside the merged axes (0, 1).
        "heads": put(h, P(None, "data")),
    }
    names = {
        "rules": [
            {"match": "^stack$", "name": "layers.{i}.w", "split": 0, "transpose": [1, 0]},
            {"match": "^heads$", "name": "heads", "reshape": [[0, 1], 2], "transpose": [1, 0]},
            {"match": "^(w|col|rep|n)$", "name": r"\1"},
        ]
    }
    result = jaxckpt.save_safetensors(state, job.args["out"], names=names, max_shard_size="300B")
    return {"files": list(result.files)}

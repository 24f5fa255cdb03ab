"""The job of tests/test_real_clients.py (run by children.job in every process): each of two
processes reads its shard of a grain pipeline (`ds[process::2]`), saves, then restores with
its own pipeline, and with process 1's batch size changed."""

import grain
import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from children.job import Job


def save_then_restore_with_one_pipeline_changed(job: Job) -> dict:
    def data(batch_size):
        ds = grain.MapDataset.range(64)[job.process_id :: job.num_processes].batch(batch_size)
        return iter(ds.to_iter_dataset())

    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    x = jax.make_array_from_callback((8,), NamedSharding(mesh, P("data")), lambda i: np.ones(8)[i])
    it = data(4)
    next(it)
    with jaxckpt.CheckpointManager(job.args["dir"]) as m:
        m.save(1, state={"x": x}, data=it)
    report = {}
    with jaxckpt.CheckpointManager(job.args["dir"], read_only=True) as m:
        report["resumed"] = next(m.restore(state={"x": x}, data=data(4)).data).tolist()
        try:  # process 1 changed its batch size
            m.restore(state={"x": x}, data=data(8 if job.process_id == 1 else 4))
            report["error"] = None
        except jaxckpt.errors.DataStateError as e:
            report["error"] = str(e)
    return report

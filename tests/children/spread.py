"""The jobs of tests/test_spread.py (run by children.job in every process): a state saved
and restored by every process of the job, its bytes read from storage counted."""

import shutil
from pathlib import Path

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from children.job import Job
from jaxckpt import _internals
from reliability import faults


def io_counts() -> dict[str, int]:
    """This process's counters in /proc/self/io: bytes through read(2) and write(2), page
    cache or not (rchar, wchar; the job's collectives receive with recv(2), which rchar does
    not count) and the calls (syscr, syscw). benchmarks/scale.py counts with it too."""
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return {k: int(fields[k]) for k in ("rchar", "wchar", "syscr", "syscw")}


def layout(processes: int, name: str) -> tuple[Mesh, P]:
    """The mesh of all the job's devices and the spec of a layout: "replicated" on every
    device, "mixed" data x model (replicated over the processes, sharded within each), or
    "fsdp" (fully sharded)."""
    devices = np.array(jax.devices())
    if name == "mixed":
        return Mesh(devices.reshape(processes, -1), ("data", "model")), P(None, "model")
    return Mesh(devices, ("data",)), P() if name == "replicated" else P("data")


def values(step: int) -> dict[str, np.ndarray]:
    """2 MiB in an Orbax array, 1 MiB in 16 packed leaves, and a NumPy leaf: the same on
    every process, other at each step."""
    rng = np.random.default_rng(step)
    out = {"w": rng.standard_normal((512, 1024)).astype(np.float32)}
    out |= {f"s{i:02d}": rng.standard_normal((64, 256)).astype(np.float32) for i in range(16)}
    return out


def restore_counted(job: Job) -> dict:
    """Steps 1 and 2 saved (counting what this process wrote and read of step 2), then
    step 2 restored in a new manager onto the same layout, counting what this process read.
    Then, for each of `damaged` (state/ or packed/), in a copy of the directory made before
    that restore: process 0 flips a byte of step 2's largest file there, and the job
    restores the latest step that verifies (`report["damaged"][where]`). `incremental`: the
    manager's (None: its default)."""
    mesh, spec = layout(job.num_processes, job.args["layout"])
    sharding = NamedSharding(mesh, spec)

    def on_mesh(hosts):
        return {
            k: jax.make_array_from_callback(v.shape, sharding, v.__getitem__)
            for k, v in hosts.items()
        }

    directory = Path(job.args["dir"])
    report = {}
    with jaxckpt.CheckpointManager(directory, incremental=job.args.get("incremental")) as m:
        for step in (1, 2):
            state = on_mesh(values(step)) | {"n": np.int64(step)}
            before = io_counts()
            m.save(step, state=state)
            m.wait()
            after = io_counts()
            report["wrote"] = after["wchar"] - before["wchar"]
            report["read_saving"] = after["rchar"] - before["rchar"]
    damaged = {
        where: directory.with_name(f"{directory.name}-{where}")
        for where in job.args.get("damaged", [])
    }
    if job.process_id == 0:
        for copy in damaged.values():
            shutil.copytree(directory, copy)
    multihost_utils.sync_global_devices("copied")
    target = {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding) for k, v in values(0).items()
    } | {"n": np.int64(0)}
    opened = []  # the packed files the restore opens

    def opening(real, folder, name, **kw):
        opened.append(name)
        return real(folder, name, **kw)

    with faults.manager(directory, store=faults.store(open_file=opening)) as m:
        m.restore(1, state=target)  # uncounted: what a first restore imports and compiles
        before = io_counts()["rchar"]
        opened.clear()
        with _internals.count_collectives() as collectives:
            restored = m.restore(state=target)
        report["read"] = io_counts()["rchar"] - before
        report["collectives"] = dict(collectives)
        report["packed_opened"] = sorted(set(opened))
    report |= {"step": restored.step, "bitwise": _bitwise(restored)}
    report["state_bytes"] = sum(v.nbytes for v in values(0).values())
    report["damaged"] = {
        where: _damaged(job, copy, where, target) for where, copy in damaged.items()
    }
    return report


def _damaged(job: Job, directory: Path, where: str, target: dict) -> dict:
    """Process 0 flips a byte of step 2's largest file of `where`; then step 2 restored (the
    error it raises) and the latest that verifies (`fallback`)."""
    report = {}
    if job.process_id == 0:
        victim = faults.largest_data_file(directory / "2", within=(where,))
        faults.flip_middle_byte(victim)
        report["victim"] = str(victim.relative_to(directory / "2"))
    multihost_utils.sync_global_devices(f"damaged {where}")
    with jaxckpt.CheckpointManager(directory) as m:
        try:
            m.restore(2, state=target)
            report["error"] = None
        except jaxckpt.errors.CorruptCheckpointError as e:
            report["error"] = str(e)
        restored = m.restore(state=target, fallback=True)
    return report | {"step": restored.step, "bitwise": _bitwise(restored)}


def _bitwise(restored) -> bool:
    """Whether every shard this process holds is the saved step's, bit for bit."""
    expected = values(restored.step)
    return (
        all(
            np.array_equal(np.asarray(shard.data), expected[k][shard.index])
            for k in expected
            for shard in restored.state[k].addressable_shards
        )
        and int(restored.state["n"]) == restored.step
    )

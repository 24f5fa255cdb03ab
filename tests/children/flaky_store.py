"""The jobs of tests/test_flaky_store.py: saves, restores and verifies against a store
behind reliability.proxy's fault proxy (the environment points the clients at it), each
process reporting what every call did."""

import time

import jax
import numpy as np

import jaxckpt
from children.agreements import mesh_of_all, state_at
from children.job import Job


def _target(step: int, mesh) -> dict:
    return jax.tree.map(
        lambda x: (
            jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
            if isinstance(x, jax.Array)
            else x
        ),
        state_at(step, mesh),
    )


def _same(restored: dict, want: dict) -> bool:
    for name in ("changing", "frozen"):
        for got, expected in zip(
            restored[name].addressable_shards, want[name].addressable_shards, strict=True
        ):
            if not np.array_equal(np.asarray(got.data), np.asarray(expected.data)):
                return False
    return restored["step"] == want["step"]


def saves_through_faults(job: Job) -> dict:
    """`saves` steps saved and each waited for (`keep_last`), then every kept step
    restored (verified) by a reader and compared bitwise, and the directory verified;
    every error met is reported, not raised."""
    a = job.args
    mesh = mesh_of_all()
    errors: list[str] = []
    retention = jaxckpt.RetentionPolicy(keep_last=a.get("keep_last"))
    with jaxckpt.CheckpointManager(
        a["dir"], retention=retention, timeout_s=a.get("timeout_s", 120)
    ) as mngr:
        for step in range(1, a["saves"] + 1):
            try:
                mngr.save(step, state=state_at(step, mesh))
                mngr.wait()
            except jaxckpt.errors.JaxckptError as e:
                errors.append(f"save {step}: {type(e).__name__}: {e}")
    wrong, corrupt = [], []
    with jaxckpt.CheckpointManager(a["dir"], read_only=True, timeout_s=120) as reader:
        kept = reader.all_steps()
        for step in kept:
            try:
                restored = reader.restore(step, state=_target(step, mesh)).state
                if not _same(restored, state_at(step, mesh)):
                    wrong.append(step)
            except jaxckpt.errors.CorruptCheckpointError as e:
                corrupt.append(f"{step}: {e}")
            except jaxckpt.errors.JaxckptError as e:
                errors.append(f"restore {step}: {type(e).__name__}: {e}")
    reports = jaxckpt.verify(a["dir"])
    return {
        "kept": kept,
        "errors": errors,
        "wrong": wrong,
        "corrupt": corrupt,
        "unverified": [f"{r.step}: {r.problems}" for r in reports if not r.ok],
    }


def slow_save(job: Job) -> dict:
    """One save of a state whose writes take longer than `timeout_s` at the store's
    speed, waited for; the time it took."""
    a = job.args
    mesh = mesh_of_all()
    began = time.monotonic()
    with jaxckpt.CheckpointManager(a["dir"], timeout_s=a["timeout_s"]) as mngr:
        mngr.save(1, state=state_at(1, mesh))
        mngr.wait()
        took = time.monotonic() - began
        restored = mngr.restore(1, state=_target(1, mesh)).state
    return {"took_s": took, "same": _same(restored, state_at(1, mesh)), "steps": mngr.all_steps()}

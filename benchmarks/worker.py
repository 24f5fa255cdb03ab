"""One benchmark state in one fresh process; `compare.py` starts it and reads its JSON.

    python -m benchmarks.worker SPEC_JSON WORK_DIR

Every contender saves and restores the same state, taking turns (`in_turn`), one warm-up
round (its numbers are kept apart as the first save), then `runs` timed rounds.
"""

from __future__ import annotations

import cProfile
import ctypes
import gc
import json
import logging
import os
import pstats
import shutil
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import jax
import numpy as np
import orbax.checkpoint as ocp
import safetensors.numpy
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt

logging.getLogger("absl").setLevel(logging.ERROR)  # Orbax's per-save chatter
SPEC = json.loads(sys.argv[1])
WORK = sys.argv[2]
if SPEC["platform"] == "cpu":  # before the first use of a device
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", 8)


# ----------------------------------------------------------------------------- measuring


_LIBC = ctypes.CDLL("libc.so.6")


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


class PeakRSS:
    """Peak resident memory above the level at entry: the kernel's high-water mark, reset
    through /proc/self/clear_refs where the kernel allows it, else sampled every 2 ms."""

    def __enter__(self):
        gc.collect()
        _LIBC.malloc_trim(0)  # hand freed memory back first, so the level is what is live
        self.base = _status("VmRSS")
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.exact = _status("VmHWM") <= self.base + 2**20
        except OSError:
            self.exact = False
        if not self.exact:
            self.samples = [self.base]
            self.stop = threading.Event()
            self.thread = threading.Thread(target=self._sample, daemon=True)
            self.thread.start()
        return self

    def _sample(self):
        while not self.stop.wait(0.002):
            self.samples.append(_status("VmRSS"))

    def __exit__(self, *exc):
        if self.exact:
            self.peak = _status("VmHWM") - self.base
        else:
            self.stop.set()
            self.thread.join()
            self.peak = max(self.samples) - self.base


def du(path: str) -> tuple[int, int]:
    files = [os.path.join(r, f) for r, _, fs in os.walk(path) for f in fs]
    return sum(os.path.getsize(f) for f in files), len(files)


# ----------------------------------------------------------------------------- the state

devices = np.array(jax.devices())
if SPEC["platform"] == "cpu":
    mesh = jax.sharding.Mesh(devices.reshape(4, 2), ("data", "model"))
else:  # the accelerators of this host, one axis
    mesh = jax.sharding.Mesh(devices.reshape(-1, 1), ("data", "model"))
sharding = NamedSharding(mesh, P("data", "model"))
make = jax.jit(
    lambda k, shape: jax.random.normal(k, shape), static_argnums=1, out_shardings=sharding
)
state = {f"p{i}": make(jax.random.key(i), tuple(s)) for i, s in enumerate(SPEC["shapes"])}
jax.block_until_ready(state)
state_bytes = sum(x.nbytes for x in state.values())
_trained = jax.jit(lambda s: jax.tree.map(lambda x: x + 1.0, s))


def train() -> None:
    """New bytes in every shard before each save, as a training step makes them: a save of
    the same state again costs an incremental save (jaxckpt's default) nothing at all."""
    global state
    state = _trained(state)
    jax.block_until_ready(state)


targets = {"same mesh": jaxckpt.target_like(state)}
if SPEC["reshard"] and len(devices) >= 8:
    other = jax.sharding.Mesh(devices[:8].reshape(2, 4), ("data", "model"))
    targets["onto (2, 4)"] = jaxckpt.target_on_mesh(state, other, P("data", "model"))
    targets["onto 1 device"] = jaxckpt.target_on_mesh(
        state, jax.sharding.Mesh(devices[:1].reshape(1, 1), ("data", "model")), P()
    )


# ----------------------------------------------------------------------------- contenders


class Jaxckpt:
    def __init__(self, name, **options):
        self.dir = os.path.join(WORK, name)
        self.m = jaxckpt.CheckpointManager(
            self.dir, retention=jaxckpt.RetentionPolicy(keep_last=1), **options
        )

    def save(self, step):
        self.m.save(step, state=state)

    def wait(self):
        self.m.wait()

    def restore(self, step, target):
        return self.m.restore(step, state=target).state


class Orbax:
    """Plain Orbax with its defaults (async, OCDBT, zstd)."""

    def __init__(self, name):
        self.dir = os.path.join(WORK, name)
        self.m = ocp.CheckpointManager(
            self.dir, options=ocp.CheckpointManagerOptions(max_to_keep=1)
        )

    def save(self, step):
        self.m.save(step, args=ocp.args.StandardSave(state))

    def wait(self):
        self.m.wait_until_finished()

    def restore(self, step, target):
        return self.m.restore(step, args=ocp.args.StandardRestore(target))


class Raw:
    """The same shard bytes, one file per shard, 8 writer threads, each file fsynced."""

    def __init__(self, name):
        self.dir = os.path.join(WORK, name)
        self.pool = ThreadPoolExecutor(8)

    @staticmethod
    def _write(path, shard):
        with open(path, "wb") as f:
            f.write(np.asarray(shard.data))
            f.flush()
            os.fsync(f.fileno())

    def save(self, step):
        shutil.rmtree(self.dir, ignore_errors=True)
        d = os.path.join(self.dir, str(step))
        os.makedirs(d)
        jobs = [
            self.pool.submit(self._write, os.path.join(d, f"{name}.{k}"), shard)
            for name, x in state.items()
            for k, shard in enumerate(x.addressable_shards)
            if shard.replica_id == 0
        ]
        for job in jobs:
            job.result()

    def wait(self):
        pass

    def restore(self, step, target):
        d = os.path.join(self.dir, str(step))

        def read(name):
            x, t = state[name], target[name]
            host = np.empty(x.shape, x.dtype)
            for k, shard in enumerate(x.addressable_shards):
                if shard.replica_id == 0:
                    path = os.path.join(d, f"{name}.{k}")
                    host[shard.index] = np.fromfile(path, x.dtype).reshape(shard.data.shape)
            return jax.device_put(host, t.sharding)

        return dict(zip(state, self.pool.map(read, state), strict=True))


contenders = {"jaxckpt": Jaxckpt("jaxckpt"), "orbax": Orbax("orbax"), "raw": Raw("raw")}
if SPEC["zstd"]:
    contenders["jaxckpt zstd"] = Jaxckpt("jaxckpt-zstd", compression="zstd")

if SPEC.get("first_save_only"):
    # A fresh process's first save: what a training job's first checkpoint costs, with every
    # process-wide warm-up (compiles, transfer buffers, thread pools) counted.
    c = contenders[SPEC["first_save_only"]]
    profile = cProfile.Profile() if SPEC.get("profile") else None
    t0 = time.perf_counter()
    if profile:
        profile.enable()
    c.save(1)
    t1 = time.perf_counter()
    if profile:
        profile.disable()
        pstats.Stats(profile, stream=sys.stderr).sort_stats("cumulative").print_stats(20)
    c.wait()
    t2 = time.perf_counter()
    print("RESULT " + json.dumps({"blocking": t1 - t0, "total": t2 - t0}))
    sys.exit(0)


def check(restored, target_name):
    for name in list(state)[:2]:
        got = restored[name]
        assert got.sharding.is_equivalent_to(targets[target_name].get(name).sharding, got.ndim)
        assert np.array_equal(np.asarray(got), np.asarray(state[name])), (target_name, name)


# ----------------------------------------------------------------------------- rounds

results: dict = {c: {"first_blocking": None} for c in contenders}


def record(contender, metric, value):
    results[contender].setdefault(metric, []).append(value)


def in_turn(names: list, round_: int) -> list:
    """The order of `names` in a round: the rows of a Williams design, so that over n rounds
    (2n for an odd n) each contender follows every other one equally often (one that always
    followed the same one would carry its after-effects: the kernel still flushing or
    freeing its memory, its threads still winding down)."""
    n = len(names)
    base, low, high = [0], 1, n - 1
    while len(base) < n:
        base.append(low)
        low += 1
        if len(base) < n:
            base.append(high)
            high -= 1
    row = [(i + round_) % n for i in base]
    if n % 2 and round_ % (2 * n) >= n:
        row.reverse()
    return [names[i] for i in row]


step = 0
names = list(contenders)
for round_ in range(SPEC["runs"] + 1):  # round 0 warms up (and is the first save)
    print(f"  round {round_}/{SPEC['runs']}", file=sys.stderr, flush=True)
    for name in in_turn(names, round_):
        c = contenders[name]
        step += 1
        train()
        os.sync()  # each save starts with no one else's writes still being flushed
        with PeakRSS() as rss:
            t0 = time.perf_counter()
            c.save(step)
            t1 = time.perf_counter()
            c.wait()
            t2 = time.perf_counter()
        if round_ == 0:
            results[name]["first_blocking"] = t1 - t0
            results[name]["bytes"], results[name]["files"] = du(os.path.join(c.dir, str(step)))
            continue
        record(name, "blocking", t1 - t0)
        record(name, "total", t2 - t0)
        record(name, "save_rss", rss.peak / state_bytes)
        for target_name, target in targets.items():
            with PeakRSS() as rss:
                t0 = time.perf_counter()
                restored = c.restore(step, target)
                jax.block_until_ready(restored)
                t1 = time.perf_counter()
            check(restored, target_name)
            del restored
            record(name, f"restore {target_name}", t1 - t0)
            record(name, f"restore {target_name} rss", rss.peak / state_bytes)


# ------------------------------------------------------- training-step slowdown during a save

x = jax.device_put(np.ones((2048, 2048), np.float32), sharding)
matmul = jax.jit(lambda a: (a @ a.T) * (1 / 2048), out_shardings=sharding)
jax.block_until_ready(matmul(x))


def step_times(until: threading.Event | None, count: int = 0) -> list[float]:
    times = []
    while (until is not None and not until.is_set()) or len(times) < count:
        t0 = time.perf_counter()
        jax.block_until_ready(matmul(x))
        times.append(time.perf_counter() - t0)
    return times


# Rounds alternate between the contenders, each save's steps against the steps just before
# it (the machine's speed drifts over minutes). Per save: the slowdown (median step during
# the save over the median alone) and the training time it cost (the steps' time above
# what they take alone): a save three times shorter at a higher slowdown may cost less.
slowdown: dict[str, list[dict]] = {
    name: [] for name, c in contenders.items() if not isinstance(c, Raw)
}  # Raw saves synchronously: no background to measure
for round_ in range(SPEC["slowdown_runs"]):
    for name in in_turn(list(slowdown), round_):
        c = contenders[name]
        alone = statistics.median(step_times(None, count=8))
        step += 1
        train()
        os.sync()
        done, ended = threading.Event(), []

        def wait(c=c, done=done, ended=ended):
            c.wait()
            ended.append(time.perf_counter())
            done.set()

        t0 = time.perf_counter()
        c.save(step)  # the blocking part is measured above; this is the background part
        waiter = threading.Thread(target=wait)
        waiter.start()
        during = step_times(done)
        waiter.join()
        slowdown[name].append(
            {
                "slowdown": statistics.median(during) / alone,
                "cost": sum(during) - len(during) * alone,
                "alone": alone,
                "steps": len(during),
                "save": ended[0] - t0,
            }
        )

# ----------------------------------------------------------------------------- export


class Export:
    """safetensors' save_file of the state's arrays already in host memory (+ fsync) vs
    jaxckpt writing the same files from the live sharded state (save_safetensors) and from
    the committed step (export_safetensors, which also reads and verifies it, against
    Orbax's restore + save_file); importing both back onto the mesh."""

    def __init__(self):
        self.ckpt = contenders["jaxckpt"].dir
        self.out = os.path.join(WORK, "hf")
        self.host = {k: np.asarray(v) for k, v in state.items()}

    def jaxckpt_live(self):
        jaxckpt.save_safetensors(state, self.out + "-live", overwrite=True)

    def jaxckpt_export(self):
        jaxckpt.export_safetensors(self.ckpt, self.out + "-jaxckpt", overwrite=True)

    def save_file(self, host=None):
        path = self.out + "-st.safetensors"
        safetensors.numpy.save_file(self.host if host is None else host, path)
        with open(path, "rb+") as f:
            os.fsync(f.fileno())

    @staticmethod
    def fresh_copies():
        """New device buffers (outside the timing): jax caches an array's host copy after the
        first `np.asarray`, which would make every later gather free."""
        return jax.block_until_ready({k: v.copy() for k, v in state.items()})

    def gather_save_file(self, arrays):
        self.save_file({k: np.asarray(v) for k, v in arrays.items()})

    def orbax_restore_save_file(self):
        """What a user of plain Orbax does to export a checkpoint: restore it onto the mesh,
        gather, save_file (no checksums to verify)."""
        orbax = contenders["orbax"].m
        restored = orbax.restore(orbax.latest_step(), args=ocp.args.StandardRestore(state))
        self.save_file({k: np.asarray(v) for k, v in restored.items()})

    def jaxckpt_import(self):
        return jaxckpt.load_safetensors(self.out + "-jaxckpt", targets["same mesh"])

    def load_file(self):
        loaded = safetensors.numpy.load_file(self.out + "-st.safetensors")
        return {k: jax.device_put(v, state[k].sharding) for k, v in loaded.items()}


export = {}
if SPEC["export"]:
    e = Export()
    ops = {
        "jaxckpt save_safetensors (live state)": e.jaxckpt_live,
        "jaxckpt export_safetensors (from the checkpoint)": e.jaxckpt_export,
        "safetensors save_file (host arrays)": e.save_file,
        "np.asarray (gather) + safetensors save_file": e.gather_save_file,
        "Orbax restore + np.asarray + safetensors save_file": e.orbax_restore_save_file,
        "jaxckpt load_safetensors": e.jaxckpt_import,
        "safetensors load_file + device_put": e.load_file,
    }
    export = {k: {"time": [], "rss": []} for k in ops}
    # What the imports read, written once untimed: in turn, they may come first in a round.
    e.save_file()
    e.jaxckpt_export()
    for round_ in range(SPEC["runs"] + 1):
        for name in in_turn(list(ops), round_):
            op = ops[name]
            args = (e.fresh_copies(),) if op == e.gather_save_file else ()
            os.sync()
            with PeakRSS() as rss:
                t0 = time.perf_counter()
                out = op(*args)
                jax.block_until_ready(out)
                t1 = time.perf_counter()
            del out, args
            if round_:
                export[name]["time"].append(t1 - t0)
                export[name]["rss"].append(rss.peak / state_bytes)

print(
    "RESULT "
    + json.dumps(
        {
            "contenders": results,
            "slowdown": slowdown,
            "export": export,
            "state_bytes": state_bytes,
            "devices": f"{len(devices)} x {devices.flat[0].device_kind}",
            "versions": {"jax": jax.__version__, "orbax": ocp.__version__},
        }
    )
)

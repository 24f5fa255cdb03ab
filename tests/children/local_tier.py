"""The jobs of tests/test_local_multihost.py and tests/test_local_*.py (run by children.job in
every process): a small training run with a local tier (each process its own directory) and
a persistent one, killed or not, resumed or not, reporting what each process holds at the end.

`train`'s `job.args`: persistent (the shared directory), local (a folder with `{process}` in
it, or a list of one folder a process: each process's own directory), start (0: from
scratch; "latest": restore the latest step first), stop (the last step to train),
kill_after (the saves before it waited for, every process SIGKILLs itself right after
`wait()` of this step returned: no barrier, as a job that is preempted then), copy_first (with kill_after: process 1
saves that step only once process 0's copy of it reached process 1, so that process 1's
copy is the last one sent), kill_in_local_write (the saves before it waited for, process 1
SIGKILLs itself inside its local write of this step, before the rename; the others stop
after writing theirs), data (restore the iterator too), replicas (LocalTier's, 1 by
default), copy_timeout_s (LocalTier's, if given), restore_step (the step to restore, None:
the latest).

`freeze`: a peer stopped (SIGSTOP) while copies go to it. `unreadable`: one process whose
local directory it cannot read. `frozen`: copies of a state whose largest leaf never changes.
"""

import logging
import os
import re
import signal
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import xxhash
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from children.job import Job
from jaxckpt import _local
from reliability import faults


class Iterator:
    """Each process reads its own shard of the data: its own position."""

    def __init__(self, process: int):
        self.process, self.position = process, 0

    def advance(self) -> None:
        self.position += self.process + 1

    def get_state(self):
        return {"process": self.process, "position": self.position}

    def set_state(self, state):
        assert state["process"] == self.process, state
        self.position = state["position"]


def mesh():
    auto = (jax.sharding.AxisType.Auto,) * 2
    n = jax.device_count()
    return jax.make_mesh((n // 2, 2), ("data", "model"), axis_types=auto)


def initial(m):
    w = np.arange(64 * 32, dtype=np.float32).reshape(64, 32) / 7
    big = np.linspace(-1, 1, 512 * 1024, dtype=np.float32).reshape(512, 1024)  # 2 MiB
    put = jax.make_array_from_callback
    sharded = NamedSharding(m, P("data", "model"))
    return {
        "w": put(w.shape, sharded, lambda i: w[i]),
        "big": put(big.shape, sharded, lambda i: big[i]),
        "b": put((4,), NamedSharding(m, P()), lambda i: np.zeros(4, np.float32)[i]),
    }


def target(m):
    return jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), initial(m)
    )


@jax.jit
def update(state, key):
    ka, kb = jax.random.split(key)
    w = state["w"] * 0.5 + jax.random.normal(ka, state["w"].shape)
    big = state["big"] * 0.25 + jax.random.uniform(kb, state["big"].shape)
    return {"w": w, "big": big, "b": state["b"] + jnp.mean(w)}  # a reduction over processes


def digest(state) -> dict:
    out = {}
    for name, array in sorted(state.items()):
        h = xxhash.xxh3_64()
        for shard in sorted(array.addressable_shards, key=lambda s: s.device.id):
            h.update(np.asarray(shard.data).tobytes())
        out[name] = h.hexdigest()
    return out


def manager(job: Job) -> jaxckpt.CheckpointManager:
    local = job.args["local"]
    local = (
        local[job.process_id] if isinstance(local, list) else local.format(process=job.process_id)
    )
    options = {"replicas": job.args.get("replicas", 1)}
    if "copy_timeout_s" in job.args:
        options["copy_timeout_s"] = job.args["copy_timeout_s"]
    kill_in = job.args.get("kill_in_local_write")
    return faults.manager(
        job.args["persistent"],
        policy=jaxckpt.SavePolicy(every_steps=10),
        local=jaxckpt.LocalTier(local, every_steps=2, keep_last=2, **options),
        local_store=_local.LocalStore if kill_in is None else killed_in_local_write(job, kill_in),
    )


def local_dir(job: Job, process: int) -> Path:
    local = job.args["local"]
    return Path(local[process] if isinstance(local, list) else local.format(process=process))


def wait_for(path: Path, timeout: float = 60) -> None:
    """Until `path` exists (another process's doing), at most `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear in {timeout:.0f} s")
        time.sleep(0.01)


def killed_in_local_write(job: Job, step: int) -> type:
    """Process 1 dies inside its local write of `step`: its files written, not renamed; once
    process 0 renamed its own part of it into place (the test's machine: both directories
    are on it), since process 0 aborts as soon as JAX's coordinator sees process 1 gone."""
    other = Path(job.args["local"].format(process=0)) / str(step)

    def dying(write_part, tmp, info, *args):
        write_part(tmp, info, *args)
        if job.process_id == 1 and info.step == step:
            deadline = time.monotonic() + 60
            while not other.exists() and time.monotonic() < deadline:
                time.sleep(0.02)
            os.kill(os.getpid(), signal.SIGKILL)

    return faults.local_store(write_part=dying)


def train(job: Job) -> dict:
    m_ = mesh()
    data = Iterator(job.process_id)
    report = {}
    kill_in = job.args.get("kill_in_local_write")
    with manager(job) as mngr:
        if job.args["start"] == "latest":
            restored = mngr.restore(
                job.args.get("restore_step"),
                state=target(m_),
                rng=jax.random.key(0),
                data=data if job.args["data"] else None,
            )
            state, key, step = restored.state, restored.rng, restored.step
            report.update(restored=step, tier=restored.tier)
            if job.args.get("kill_after") == step:  # right after the restore
                os.kill(os.getpid(), signal.SIGKILL)
        else:
            state, key, step = initial(m_), jax.random.key(1234), 0
        while step < job.args["stop"]:
            step += 1
            state = update(state, jax.random.fold_in(key, step))
            data.advance()
            if mngr.should_save(step):
                if step in (kill_in, job.args.get("kill_after")):
                    mngr.wait()  # nothing else in flight (a commit) when a process dies
                copy_first = job.args.get("copy_first") and job.process_id == 1
                if step == job.args.get("kill_after") and copy_first:
                    wait_for(local_dir(job, 1) / "replicas" / "0" / str(step))
                mngr.save(step, state=state, rng=key, data=data)
            if step == kill_in:
                mngr.wait()
                os.kill(os.getpid(), signal.SIGKILL)
            if step == job.args.get("kill_after"):
                mngr.wait()  # its part written, its copies sent, its peers' received
                os.kill(os.getpid(), signal.SIGKILL)
        mngr.wait()
        report.update(
            step=step,
            position=data.position,
            digest=digest(state),
            latest=mngr.latest_step(),
            persistent=mngr.all_steps(),
        )
    return report


class _Warnings(logging.Handler):
    """The jaxckpt warnings logged, in order."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _run_state(pid: int) -> str:
    """A process's state letter from /proc (T: stopped)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2]


def freeze(job: Job) -> dict:
    """Both processes save up to step 12 (local and persistent), then process 0 stops
    process 1 (SIGSTOP) and saves steps 14 and 16 to its local tier, whose copies go to
    process 1, and waits; it reports whether process 1 was still stopped when each call
    returned, and what was logged before; then it resumes process 1. Process 1 saves 14 and
    16 too (no collective between the two barriers: a stopped process could time one out)."""
    m_ = mesh()
    data = Iterator(job.process_id)
    pids = [int(p) for p in multihost_utils.process_allgather(np.int64(os.getpid()))]
    report = {}
    with manager(job) as mngr:
        state, key = initial(m_), jax.random.key(1234)
        for step in range(1, 13):
            state = update(state, jax.random.fold_in(key, step))
            data.advance()
            if mngr.should_save(step):
                mngr.save(step, state=state, rng=key, data=data)
        mngr.wait()
        multihost_utils.sync_global_devices("frozen")
        warnings = _Warnings()
        logging.getLogger("jaxckpt").addHandler(warnings)
        if job.process_id == 0:
            os.kill(pids[1], signal.SIGSTOP)
        mngr.save(14, state=state, rng=key, data=data)
        mngr.save(16, state=state, rng=key, data=data)
        if job.process_id == 0:
            report["stopped_after_save"] = _run_state(pids[1]) == "T"
            report["warned_before_save_returned"] = list(warnings.messages)
        mngr.wait()
        if job.process_id == 0:
            report["stopped_after_wait"] = _run_state(pids[1]) == "T"
            report["warned_by_wait"] = list(warnings.messages)
            os.kill(pids[1], signal.SIGCONT)
        multihost_utils.sync_global_devices("done")
        report["latest"] = mngr.latest_step()
    return report


def unreadable(job: Job) -> dict:
    """One process (unprivileged: it drops root first, for which no mode is unreadable)
    saves steps 1 to 12, makes its local directory unreadable (mode 000), and reports what
    a restarted job's latest_step, restore and save + wait give: [result] or [error type,
    message] each."""
    if os.geteuid() == 0:
        os.setgid(job.args["uid"])
        os.setuid(job.args["uid"])
    m_ = mesh()
    with manager(job) as mngr:
        state = initial(m_)
        for step in range(1, 13):
            if mngr.should_save(step):
                mngr.save(step, state=state)
    local = local_dir(job, 0)
    local.chmod(0)
    report = {}
    with manager(job) as mngr:

        def attempt(name, call):
            try:
                report[name] = [call()]
            except Exception as e:
                report[name] = [type(e).__name__, str(e)]

        attempt("latest", mngr.latest_step)
        attempt("restore", lambda: (r := mngr.restore(state=target(m_))) and [r.step, r.tier])

        def save_and_wait():
            mngr.save(14, state=state)
            mngr.wait()

        attempt("save", save_and_wait)
        try:
            mngr.close()
        except Exception as e:
            report["close"] = [type(e).__name__, str(e)]
    local.chmod(0o755)
    return report


class _Copies(logging.Handler):
    """The copies this process took (the debug log of jaxckpt._peers): step, bytes received,
    bytes in all."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.taken: list[tuple[int, int, int]] = []

    def emit(self, record):
        text = record.getMessage()
        if "bytes received" in text:
            step, received, total = (int(n) for n in re.findall(r"\d+", text)[1:4])
            self.taken.append((step, received, total))


def frozen(job: Job) -> dict:
    """Local saves of steps 2, 4 and 6 of a state whose 2 MiB `big` leaf stays as it was
    (a frozen base) while the rest trains: what each process received of its peer's parts."""
    m_ = mesh()
    copies = _Copies()
    logger = logging.getLogger("jaxckpt")
    logger.addHandler(copies)
    logger.setLevel(logging.DEBUG)
    with manager(job) as mngr:
        state, key = initial(m_), jax.random.key(1234)
        for step in range(1, 7):
            trained = update(state, jax.random.fold_in(key, step))
            state = {**trained, "big": state["big"]}
            if mngr.should_save(step):
                mngr.save(step, state=state, rng=key)
                mngr.wait()  # (its copies settled: each holder answered)
        return {"taken": copies.taken, "latest": mngr.latest_step()}

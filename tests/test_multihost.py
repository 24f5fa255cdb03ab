"""Multi-host checkpoints with JAX's multi-controller runtime: real processes, gloo, 127.0.0.1.

Saved from 2 processes x 4 devices, restored in 1 process with 8 and with 2 devices and on 2
processes with another mesh; saved from 1 process, restored on 2. Every process checks the
shards it holds against the global array.
"""

import pytest
from multihost import run_job

from conftest import WRITES_DONE_EVENT

COMMON = """
from jax.sharding import NamedSharding, PartitionSpec as P

W = np.arange(64 * 16, dtype=np.float32).reshape(64, 16)
B = np.arange(16, dtype=np.float32)
KEY = np.asarray(jax.random.key_data(jax.random.key(42)))


def mesh_of(shape, names):
    auto = (jax.sharding.AxisType.Auto,) * len(shape)
    return jax.make_mesh(shape, names, axis_types=auto, devices=jax.devices()[: int(np.prod(shape))])


def make_state(mesh):
    def put(x, spec):
        return jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec), lambda i: x[i])
    return {"w": put(W, P("data", "model")), "b": put(B, P("model")), "step": 7}


class Iterator:
    def __init__(self, position=None):
        self.position = position
    def get_state(self):
        return {"process": PROCESS_ID, "position": self.position}
    def set_state(self, state):
        self.position = state["position"]
        assert state["process"] == PROCESS_ID, state


def check_shards(array, full):
    # Only the shards this process holds: each process reads what its devices need.
    for shard in array.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), full[shard.index])


def save(mesh):
    with jaxckpt.CheckpointManager(ARGS["dir"]) as m:
        # jax.random.key made on every host is host-local: jaxckpt converts it.
        m.save(5, state=make_state(mesh), rng=jax.random.key(42), data=Iterator(100 + PROCESS_ID),
               meta={"hosts": NUM_PROCESSES})
    return m


def restore(mesh, specs, with_data):
    abstract = {"w": jax.ShapeDtypeStruct(W.shape, W.dtype), "b": jax.ShapeDtypeStruct(B.shape, B.dtype), "step": 0}
    target = jaxckpt.target_on_mesh(abstract, mesh, specs)
    it = Iterator()
    with jaxckpt.CheckpointManager(ARGS["dir"]) as m:
        restored = m.restore(state=target, data=it if with_data else None)
    check_shards(restored.state["w"], W)
    check_shards(restored.state["b"], B)
    assert restored.state["w"].sharding == target["w"].sharding
    assert restored.state["step"] == 7
    np.testing.assert_array_equal(np.asarray(jax.random.key_data(restored.rng)), KEY)
    assert restored.rng.sharding.is_fully_replicated
    return {"step": restored.step, "meta": restored.meta, "position": it.position}
"""


@pytest.fixture
def saved_on_two_hosts(tmp_path):
    body = (
        COMMON
        + """
m = save(mesh_of((4, 2), ("data", "model")))
print("RESULT " + json.dumps({"steps": m.all_steps()}))
"""
    )
    results = run_job(body, processes=2, devices=4, args={"dir": str(tmp_path)})
    assert [r.report() for r in results] == [{"steps": [5]}] * 2
    assert sorted(p.name for p in (tmp_path / "5" / "data").glob("process_*")) == [
        "process_0-of-2.json",
        "process_1-of-2.json",
    ]
    return tmp_path


@pytest.mark.parametrize(
    "devices, shape, specs",
    [
        (8, (2, 4), {"w": "P('model', 'data')", "b": "P('data')"}),
        (2, (2, 1), {"w": "P('data')", "b": "P()"}),
    ],
    ids=["8-devices", "2-devices"],
)
def test_two_host_save_restores_in_one_process(saved_on_two_hosts, devices, shape, specs):
    body = (
        COMMON
        + f"""
mesh = mesh_of({shape}, ("data", "model"))
specs = {{"w": {specs["w"]}, "b": {specs["b"]}, "step": None}}
report = restore(mesh, specs, with_data=False)
try:
    restore(mesh, specs, with_data=True)
    report["data_error"] = None
except jaxckpt.errors.DataStateError as e:
    report["data_error"] = str(e)
print("RESULT " + json.dumps(report))
"""
    )
    (result,) = run_job(body, processes=1, devices=devices, args={"dir": str(saved_on_two_hosts)})
    report = result.report()
    assert report["step"] == 5 and report["meta"] == {"hosts": 2} and report["position"] is None
    # Per-process data state saved by 2 processes cannot go to 1: a clear error, not a guess.
    assert "process_0-of-1.json" in report["data_error"]
    assert "process_0-of-2.json" in report["data_error"]


def test_two_host_save_restores_on_two_hosts_with_another_mesh(saved_on_two_hosts):
    body = (
        COMMON
        + """
mesh = mesh_of((2, 4), ("data", "model"))
specs = {"w": P("model", "data"), "b": P("data"), "step": None}
abstract = {"w": jax.ShapeDtypeStruct(W.shape, W.dtype), "b": jax.ShapeDtypeStruct(B.shape, B.dtype), "step": 0}
with jaxckpt.CheckpointManager(ARGS["dir"]) as m:
    plan = m.plan(state=jaxckpt.target_on_mesh(abstract, mesh, specs))
report = restore(mesh, specs, with_data=True)
report["plan_reads"] = [p.read_bytes for p in plan.processes]
print("RESULT " + json.dumps(report))
"""
    )
    results = run_job(body, processes=2, devices=4, args={"dir": str(saved_on_two_hosts)})
    reports = [r.report() for r in results]
    assert [r["position"] for r in reports] == [100, 101]
    # Each process reads its half of w and b (and the scalar step, 8 bytes, in full).
    half = (64 * 16 * 4 + 16 * 4) // 2 + 8
    assert all(r["plan_reads"] == [half, half] for r in reports)


def test_one_host_save_restores_on_two_hosts(tmp_path):
    body = (
        COMMON
        + """
save(mesh_of((4, 2), ("data", "model")))
"""
    )
    run_job(body, processes=1, devices=8, args={"dir": str(tmp_path)})
    body = (
        COMMON
        + """
report = restore(mesh_of((2, 4), ("data", "model")), {"w": P("data", "model"), "b": P("model"), "step": None}, with_data=False)
print("RESULT " + json.dumps(report))
"""
    )
    results = run_job(body, processes=2, devices=4, args={"dir": str(tmp_path)})
    assert [r.report()["step"] for r in results] == [5, 5]


# A process that dies during a save of step 2: the survivor's wait() raises SaveError, then
# a fresh process lists the steps and restores the latest. The kill moment is set by a hook
# armed before that save (ARM_THE_KILL), never by timing: a kill right after save() returned
# could come before or after the dead process's part was written, which commit differently.
DIES_DURING_STEP_2 = (
    COMMON
    + """
import signal, time
from pathlib import Path
SCRATCH = Path(ARGS["scratch"])
(SCRATCH / f"pid{PROCESS_ID}").write_text(str(os.getpid()))


def wait_until_process_0_saved():
    # Killing process 1 before process 0's save() returned would fail that save instead.
    deadline = time.monotonic() + 60
    while not (SCRATCH / "saved0").exists() and time.monotonic() < deadline:
        time.sleep(0.01)


mesh = mesh_of((4, 2), ("data", "model"))
m = jaxckpt.CheckpointManager(ARGS["dir"], timeout_s=5)
m.save(1, state=make_state(mesh))
m.wait()
ARM_THE_KILL
m.save(2, state=make_state(mesh))
(SCRATCH / f"saved{PROCESS_ID}").touch()
t0 = time.monotonic()
try:
    m.wait()
    report = {"error": None}
except jaxckpt.errors.SaveError as e:
    report = {"error": str(e), "missing": e.missing_processes, "committed": e.committed}
report["seconds"] = time.monotonic() - t0
print("RESULT " + json.dumps(report), flush=True)
"""
)

LIST_AND_RESTORE = (
    COMMON
    + """
with jaxckpt.CheckpointManager(ARGS["dir"]) as m:
    report = {"steps": m.all_steps()}
    restored = m.restore(state={"w": np.zeros_like(W), "b": np.zeros_like(B), "step": 0})
    report["restored"] = restored.step
    report["intact"] = bool(np.array_equal(restored.state["w"], W))
print("RESULT " + json.dumps(report))
"""
)


def _kill_during_step_2(tmp_path, hook):
    """Runs DIES_DURING_STEP_2 with `hook` as its ARM_THE_KILL on 2 processes: the survivor's
    report, then what a fresh process finds in the directory."""
    args = {
        "dir": str(tmp_path / "ckpt"),
        "scratch": str(tmp_path),
        "heartbeat_s": 10,
        "writes_done": WRITES_DONE_EVENT,
    }
    body = DIES_DURING_STEP_2.replace("ARM_THE_KILL", hook.strip())
    # JAX's coordination service aborts the survivor at exit (its peer is gone): rc is not 0.
    survivor, dead = run_job(body, processes=2, devices=4, args=args, check=False)
    assert dead.returncode == -9, dead.stderr[-2000:]
    report = survivor.report()
    assert report["missing"] == [1], report
    assert report["seconds"] < 60  # bounded by timeout_s per barrier, not a hang
    (after,) = run_job(LIST_AND_RESTORE, processes=1, devices=8, args=args)
    return report, after.report()


def test_a_process_dying_before_it_confirms_its_part_fails_the_others_and_never_commits(
    tmp_path,
):
    # Process 1 dies once its shards are written, before the barrier where every process
    # confirms its part.
    hook = """
def kill(event, duration, **kwargs):
    if PROCESS_ID == 1 and event == ARGS["writes_done"]:
        wait_until_process_0_saved()
        os.kill(os.getpid(), signal.SIGKILL)
jax.monitoring.register_event_duration_secs_listener(kill)
"""
    report, after = _kill_during_step_2(tmp_path, hook)
    assert not report["committed"]
    assert "saving step 2 failed in the background: " in report["error"]
    assert "Process(es) 1 never reached the commit barrier" in report["error"]
    assert "Step 2 was not committed; committed steps are intact: 1." in report["error"]
    assert after == {"steps": [1], "restored": 1, "intact": True}  # no partial step 2


def test_a_process_dying_after_the_write_barrier_leaves_a_whole_step_and_says_so(tmp_path):
    # Every part is written and confirmed; process 0 kills process 1 while it commits. The
    # step is whole, and the survivor's error must not claim that it was not committed.
    hook = """
write_manifest = jaxckpt._integrity.write_manifest
def kill_then_commit(step_dir):
    if step_dir.name.startswith("2"):
        wait_until_process_0_saved()
        os.kill(int((SCRATCH / "pid1").read_text()), signal.SIGKILL)
    write_manifest(step_dir)
jaxckpt._integrity.write_manifest = kill_then_commit
"""
    report, after = _kill_during_step_2(tmp_path, hook)
    assert report["committed"]
    assert "saving step 2 failed in the background: " in report["error"]
    assert "Process(es) 1 never confirmed the commit" in report["error"]
    assert "it resumes from step 2" in report["error"]
    assert "Step 2 committed all the same and is whole; committed steps: 1, 2." in report["error"]
    assert after == {"steps": [1, 2], "restored": 2, "intact": True}


def test_two_processes_agree_that_a_corrupt_step_is_corrupt(saved_on_two_hosts):
    # Each process checks a share of the files: both must refuse, whichever found the damage.
    files = [p for p in (saved_on_two_hosts / "5" / "state").rglob("*") if p.is_file()]
    victim = max(files, key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    body = (
        COMMON
        + """
try:
    restore(mesh_of((2, 4), ("data", "model")), {"w": P("data", "model"), "b": P(), "step": None}, with_data=False)
    report = {"error": None}
except jaxckpt.errors.CorruptCheckpointError as e:
    report = {"error": str(e)}
print("RESULT " + json.dumps(report))
"""
    )
    results = run_job(body, processes=2, devices=4, args={"dir": str(saved_on_two_hosts)})
    errors = [r.report()["error"] for r in results]
    assert all(e and "step 5" in e and "is corrupt" in e for e in errors), errors
    assert any("contents changed" in e for e in errors), errors

"""The `jaxckpt` command line on real checkpoints: ls, inspect, diff, plan, verify, export."""

import json
import shutil

import jax
import numpy as np
import pytest
import safetensors.numpy
from click.testing import CliRunner
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from conftest import run_python
from jaxckpt._plan import RESTORE_FIXED_BYTES
from jaxckpt.cli import main


def put(x, mesh, spec):
    return jax.device_put(np.asarray(x), NamedSharding(mesh, spec))


def state_at(mesh, step):
    return {
        "w": put(
            np.arange(64 * 16, dtype=np.float32).reshape(64, 16) * step, mesh, P("data", "model")
        ),
        "b": put(np.full(16, step, np.float32), mesh, P("model")),
        "count": put(np.int32(step), mesh, P()),
        "host": np.arange(3),
    }


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory):
    directory = tmp_path_factory.mktemp("cli") / "ckpt"
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    with jaxckpt.CheckpointManager(directory) as m:
        for step in (10, 20):
            m.save(step, state=state_at(mesh, step), rng=jax.random.key(step), meta={"s": step})
    return directory


def cli(*args):
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert "Traceback" not in result.output, result.output
    return result


def test_ls_lists_steps_with_sizes_and_marks_the_latest(two_steps, tmp_path):
    result = cli("ls", two_steps)
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].split() == ["step", "saved", "at", "(UTC)", "size", "files", "leaves", "status"]
    assert lines[1].split()[0] == "10" and lines[1].endswith("committed")
    assert lines[2].split()[:2] == ["*", "20"]

    # A damaged folder and an unfinished save are shown as such; --verify checks checksums.
    directory = tmp_path / "ckpt"
    shutil.copytree(two_steps, directory)
    (directory / "30").mkdir()
    (directory / "40.orbax-checkpoint-tmp").mkdir()
    doc = json.loads(cli("ls", directory, "--verify", "--json").output)
    status = {s["step"]: s["status"] for s in doc["steps"]}
    assert status[10] == status[20] == "verified"
    assert status[30].startswith("damaged: empty step directory")
    assert status[40].startswith("uncommitted")
    assert [s["step"] for s in doc["steps"] if s["latest"]] == [20]
    step20 = next(s for s in doc["steps"] if s["step"] == 20)
    on_disk = sum(f.stat().st_size for f in (directory / "20").rglob("*") if f.is_file())
    assert step20["bytes"] == on_disk and step20["leaves"] == 4

    from reliability.faults import largest_data_file

    flipped = largest_data_file(directory / "20")
    data = bytearray(flipped.read_bytes())
    data[len(data) // 2] ^= 1
    flipped.write_bytes(bytes(data))
    doc = json.loads(cli("ls", directory, "--verify", "--json").output)
    assert {s["step"]: s["status"] for s in doc["steps"]}[20] == "CORRUPT"


def test_inspect_shows_leaves_with_their_saved_sharding(two_steps):
    result = cli("inspect", two_steps)
    assert result.exit_code == 0, result.output
    rows = {line.split()[0]: line for line in result.output.splitlines()}
    assert "(64, 16)" in rows["w"] and "float32" in rows["w"]
    assert "P('data', 'model') on data=4,model=2" in rows["w"] and rows["w"].endswith("4,096")
    assert "P('model',) on data=4,model=2" in rows["b"]
    assert "host" in rows["host"]
    assert "4 leaves, 4,188 bytes" in result.output  # 4096 + 64 + 4 + 3 x 8 (int64)
    assert 'meta: {"s": 20}' in result.output

    doc = json.loads(cli("inspect", two_steps, "--step", 10, "--filter", "^[wb]$", "--json").output)
    assert doc["step"] == 10 and [leaf["name"] for leaf in doc["leaves"]] == ["b", "w"]
    assert doc["leaves"][1]["sharding"] == {
        "mesh": {"data": 4, "model": 2},
        "spec": ["data", "model"],
    }
    rng = json.loads(cli("inspect", two_steps, "--item", "rng", "--json").output)
    assert rng["leaves"][0]["dtype"] == "key<fry>" and rng["bytes"] == 8


def test_diff_two_steps_and_two_directories(two_steps, tmp_path):
    result = cli("diff", two_steps, 10, 20, "--values")
    assert result.exit_code == 1, result.output  # diff(1)'s convention: 1 = different
    assert "w  max |a - b| = 10230" in result.output  # 1023 * (20 - 10)
    assert "b  max |a - b| = 10" in result.output
    assert "0 added, 0 removed, 0 changed in shape/dtype, 3 of 4 differ in value" in result.output

    other = tmp_path / "other"
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    with jaxckpt.CheckpointManager(other) as m:
        state = state_at(mesh, 20)
        state["b"] = put(np.zeros(8, np.float32), mesh, P())  # changed shape
        del state["host"]  # removed
        state["new"] = np.ones(2)  # added
        m.save(5, state=state)
    result = cli("diff", two_steps, other, "--values", "--json")
    assert result.exit_code == 1
    doc = json.loads(result.output)
    assert (doc["a"]["step"], doc["b"]["step"]) == (20, 5)
    assert doc["added"] == ["new"] and doc["removed"] == ["host"]
    assert doc["changed"] == {"b": ["(16,) float32", "(8,) float32"]}
    assert doc["max_abs_diff"] == {"count": 0.0, "w": 0.0} and not doc["identical"]
    result = cli("diff", two_steps, two_steps, "--values", "--json")
    assert result.exit_code == 0 and json.loads(result.output)["identical"]


def test_plan_onto_another_mesh_and_hosts(two_steps):
    doc = json.loads(cli("plan", two_steps, "--mesh", "2x4", "--hosts", "2", "--json").output)
    assert doc["mesh"] == {"data": 2, "model": 4} and doc["planned_replicated"] == []
    w, b, count, host = 64 * 16 * 4, 16 * 4, 4, 3 * 8
    # w is split over data: each host reads half; b, count and the host leaf whole.
    for p in doc["processes"]:
        assert p["read_bytes"] == w // 2 + b + count + host
        assert p["device_bytes"] == w // 2 + 4 * (b // 4) + 4 * count
        # Device memory is not host memory here: 1.25x the one batch read and the fixed
        # cost (jaxckpt._plan.peak_host_bytes).
        read = p["read_bytes"]
        assert p["peak_host_bytes"] == read * 5 // 4 + RESTORE_FIXED_BYTES
    # A mesh without "data": w keeps its spec only where it fits, else replicated, named.
    onto = json.loads(cli("plan", two_steps, "--mesh", "3", "--axes", "x", "--json").output)
    assert sorted(onto["planned_replicated"]) == ["b", "w"]


def test_plan_in_a_fresh_process_makes_its_own_devices(two_steps):
    proc = run_python("-m", "jaxckpt", "plan", str(two_steps), "--mesh", "4x4", "--hosts", "4")
    assert "onto mesh data=4 x model=4, 4 host(s)" in proc.stdout
    assert proc.stdout.count("\n") >= 6  # one row per host


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["ls", "/no/such/dir"], "/no/such/dir: no such checkpoint directory"),
        (["inspect", "{ckpt}", "--step", "7"], "step 7 is not a committed checkpoint"),
        (["inspect", "{ckpt}", "--step", "x"], "'x' is not a valid integer"),
        (["inspect", "{ckpt}", "--filter", "("], "'(' is not a regular expression"),
        (["inspect", "{ckpt}", "--item", "data"], "no item 'data'"),
        (["diff", "{ckpt}", "10", "x"], "STEP_A and STEP_B are step numbers"),
        (["plan", "{ckpt}", "--mesh", "2by4"], "--mesh must look like 2x4"),
        (["plan", "{ckpt}", "--mesh", "8"], "--mesh 8 has 1 axis, the saved mesh 2 (data,model)"),
        (["plan", "{ckpt}", "--mesh", "2x4", "--hosts", "3"], "--hosts 3 does not divide"),
        (["verify", "/no/such/dir"], "no such checkpoint directory"),
        (["export", "{ckpt}", "{ckpt}"], "is not empty"),
        (["frobnicate"], "No such command 'frobnicate'"),
    ],
)
def test_bad_input_is_one_line_and_a_nonzero_exit(two_steps, args, message):
    result = cli(*(a.format(ckpt=two_steps) for a in args))
    assert result.exit_code != 0
    (line,) = result.output.strip().splitlines()
    assert line.startswith("jaxckpt: error: ") and message in line, line


def test_no_progress_bars_in_logs(two_steps, tmp_path):
    """Not a terminal: stderr holds no progress bar (the CLI stays quiet in logs)."""
    proc = run_python("-m", "jaxckpt", "export", str(two_steps), str(tmp_path / "hf"))
    assert proc.stderr == "" and "exported step 20: 4 tensors" in proc.stdout
    exported = safetensors.numpy.load_file(tmp_path / "hf" / "model.safetensors")
    assert exported["count"].shape == () and exported["count"] == 20  # a 0-d tensor stays 0-d
    proc = run_python("-m", "jaxckpt", "--quiet", "verify", str(two_steps))
    assert proc.stderr == "" and proc.stdout.splitlines()[0].startswith("step 10: ok (")


def test_export_json_reports_the_result(two_steps, tmp_path):
    result = cli("export", str(two_steps), str(tmp_path / "hf"), "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc == {
        "out_dir": str(tmp_path / "hf"),
        "step": 20,
        "files": ["model.safetensors"],
        "tensors": 4,
        "total_size": doc["total_size"],
        "skipped": [],
    }
    assert doc["total_size"] == sum(
        v.nbytes
        for v in safetensors.numpy.load_file(tmp_path / "hf" / "model.safetensors").values()
    )

"""What the `jaxckpt` command line says and how it exits, on real checkpoints: exit statuses,
--json errors, --quiet anywhere, messages in the CLI's own terms, sizes that agree, rm;
and Orbax's log noise kept out of what a user reads."""

import json
import re
import shutil
import subprocess

import jax
import numpy as np
import pytest
from click.testing import CliRunner
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from conftest import Iterator, run_python
from jaxckpt.cli import main


def state_at(mesh, step):
    return {
        "w": jax.device_put(
            np.arange(64 * 16, dtype=np.float32).reshape(64, 16) * step,
            NamedSharding(mesh, P("data", "model")),
        ),
        "host": np.arange(3),
    }


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, mesh):
    """Steps 10 and 20, each with a data-iterator state; 20 is the latest."""
    directory = tmp_path_factory.mktemp("cli-messages") / "ckpt"
    data = Iterator(100)
    with jaxckpt.CheckpointManager(directory) as m:
        for step in (10, 20):
            for _ in range(step):
                next(data)
            m.save(step, state=state_at(mesh, step), rng=jax.random.key(step), data=data)
    return directory


def cli(*args):
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert "Traceback" not in result.output, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result


# A Python argument spelled out in a message (`overwrite=True`, `step=None`).
PYTHON_ARGUMENT = re.compile(r"\b[a-z_]+=(True|False|None)\b")


# ------------------------------------------------------------------------- plan --axes


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--mesh", "2x4", "--axes", "data"],
            "--axes data gives 1 name for the 2 axes of --mesh 2x4",
        ),
        (
            ["--mesh", "2x4", "--axes", "a,b,c"],
            "--axes a,b,c gives 3 names for the 2 axes of --mesh 2x4",
        ),
        (["--mesh", "8"], "--mesh 8 has 1 axis, the saved mesh 2 (data,model)"),
        (["--mesh", "2x4", "--axes", "data,data"], "--axes data,data must name each axis once"),
    ],
)
def test_plan_says_how_many_axis_names_were_given(ckpt, args, message):
    result = cli("plan", ckpt, *args)
    assert result.exit_code == 2
    (line,) = result.output.splitlines()
    assert message in line, line


# ------------------------------------------------------------------------- exit statuses


@pytest.mark.parametrize(
    ("args", "code"),
    [
        (["ls", "{ckpt}"], 0),
        (["frobnicate"], 2),  # usage: unknown command, option, bad option value
        (["ls", "{ckpt}", "--frobnicate"], 2),
        (["inspect", "{ckpt}", "--step", "x"], 2),
        (["inspect", "{ckpt}", "--item", "nope"], 2),
        (["plan", "{ckpt}", "--mesh", "2by4"], 2),
        (["ls", "/no/such/dir"], 1),  # errors: what was asked for is not there or failed
        (["inspect", "{ckpt}", "--step", "7"], 1),
        (["plan", "{ckpt}", "--step", "7", "--mesh", "8", "--axes", "x"], 1),
        (["verify", "{ckpt}", "--step", "7"], 1),
        (["export", "{ckpt}", "{ckpt}"], 1),
    ],
)
def test_usage_errors_exit_2_and_errors_exit_1(ckpt, args, code):
    result = cli(*(a.format(ckpt=ckpt) for a in args))
    assert result.exit_code == code, result.output
    if code:
        (line,) = result.output.splitlines()
        assert line.startswith("jaxckpt: error: ")


def test_diff_exits_like_diff(ckpt, tmp_path, mesh):
    """0 the same, 1 different, 2 trouble; without --values only the trees are compared."""
    assert cli("diff", ckpt, 10, 10, "--values").exit_code == 0
    assert cli("diff", ckpt, 10, 20).exit_code == 0  # same leaves, shapes and dtypes
    assert cli("diff", ckpt, 10, 20, "--values").exit_code == 1  # values differ

    other = tmp_path / "other"
    with jaxckpt.CheckpointManager(other) as m:
        m.save(1, state={**state_at(mesh, 20), "extra": np.zeros(2)})
    result = cli("diff", ckpt, other, "--json")
    assert result.exit_code == 1 and json.loads(result.output)["different"]
    assert "added    extra" in cli("diff", ckpt, other).output

    for args in ([ckpt, 10, 30], [ckpt, "/no/such/dir"], [ckpt, 10, "x"]):
        result = cli("diff", *args)
        assert result.exit_code == 2, result.output
        assert result.output.startswith("jaxckpt: error: ")


# ---------------------------------------------------------------------------- --json errors


@pytest.mark.parametrize(
    ("args", "kind", "code"),
    [
        (["inspect", "{ckpt}", "--step", "7"], "StepNotFoundError", 1),
        (["ls", "/no/such/dir"], "NoCheckpointError", 1),
        (["export", "{ckpt}", "{ckpt}"], "OutputExistsError", 1),
        (["verify", "{ckpt}", "--step", "7"], "StepNotFoundError", 1),
        (["diff", "{ckpt}", "10", "30"], "StepNotFoundError", 2),
        (["inspect", "{ckpt}", "--step", "x"], "BadParameter", 2),
        (["plan", "{ckpt}", "--mesh", "2x4", "--axes", "data"], "BadParameter", 2),
    ],
)
def test_json_errors_are_one_json_object_on_stdout(ckpt, args, kind, code):
    args = [a.format(ckpt=ckpt) for a in args]
    result = cli(*args, "--json")
    assert result.exit_code == code and result.stderr == ""
    doc = json.loads(result.stdout)
    assert doc["type"] == kind and set(doc) == {"error", "type"}
    assert not PYTHON_ARGUMENT.search(doc["error"]), doc["error"]
    plain = cli(*args)  # the same error, as text on stderr
    assert plain.exit_code == code and plain.stderr == f"jaxckpt: error: {doc['error']}\n"


# -------------------------------------------------------------------------------- --quiet


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    """A step whose state holds a PRNG key, which export skips with a warning."""
    directory = tmp_path_factory.mktemp("cli-keyed") / "ckpt"
    with jaxckpt.CheckpointManager(directory) as m:
        m.save(1, state={"w": np.ones(3, np.float32), "key": jax.random.key(0)})
    return directory


@pytest.mark.parametrize("where", ["none", "before", "after"])
def test_quiet_before_or_after_the_command(keyed, tmp_path, where):
    args = ["export", str(keyed), str(tmp_path / "hf")]
    args = {"none": args, "before": ["-q", *args], "after": [*args, "--quiet"]}[where]
    proc = run_python("-m", "jaxckpt", *args)
    assert proc.stdout.startswith("exported step 1: 1 tensors")
    if where == "none":  # the note, as one plain line (no logging prefix)
        assert proc.stderr == "export: skipping key (a PRNG key; safetensors cannot hold it)\n"
    else:
        assert proc.stderr == ""


# ----------------------------------------------------------------- messages in CLI terms


@pytest.fixture(scope="module")
def corrupt(ckpt, tmp_path_factory):
    """A copy of `ckpt` whose step 20 has a flipped byte in its array data."""
    from reliability.faults import largest_data_file

    directory = tmp_path_factory.mktemp("cli-corrupt") / "ckpt"
    shutil.copytree(ckpt, directory)
    flipped = largest_data_file(directory / "20")
    data = bytearray(flipped.read_bytes())
    data[len(data) // 2] ^= 1
    flipped.write_bytes(bytes(data))
    return directory


def test_messages_name_cli_flags_not_python_arguments(ckpt, corrupt, keyed, tmp_path):
    """Each library hint that names a Python argument reads as the CLI's flag or action."""
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "x").write_text("taken")
    cases = {
        ("export", ckpt, tmp_path / "out"): "choose another OUT or pass --overwrite",
        ("inspect", ckpt, "--step", 7): (
            "available steps: 10, 20. Pass one of them (commands without --step use the latest)."
        ),
        ("export", corrupt, tmp_path / "hf"): (
            "Use another step (--step N); `jaxckpt ls DIR --verify` shows which steps verify."
        ),
        ("export", keyed, tmp_path / "hf", "--no-skip-unsupported"): (
            "leave them out with --exclude, drop them in the name map, or omit "
            "--no-skip-unsupported"
        ),
    }
    for args, hint in cases.items():
        result = cli(*args)
        assert result.exit_code == 1, result.output
        assert hint in result.stderr and not PYTHON_ARGUMENT.search(result.stderr), result.stderr


def test_the_library_keeps_its_python_hints(ckpt, corrupt, tmp_path):
    """The same errors raised in Python name Python arguments. CLI_WORDS rewrites these
    exact sentences, so a library message reworded without the CLI's table fails here."""
    from jaxckpt.cli._common import CLI_WORDS

    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "x").write_text("taken")
    reader = jaxckpt.CheckpointManager(ckpt, read_only=True)
    calls = [
        lambda: jaxckpt.export_safetensors(ckpt, tmp_path / "out"),
        lambda: reader.restore(7),
        lambda: jaxckpt.CheckpointManager(corrupt, read_only=True).restore(),
        lambda: jaxckpt.save_safetensors(
            {"key": jax.random.key(0)}, tmp_path / "hf", skip_unsupported=False
        ),
    ]
    messages = []
    with jaxckpt.CheckpointManager(tmp_path / "locked"):
        calls.append(lambda: jaxckpt.CheckpointManager(tmp_path / "locked"))
        for call in calls:
            with pytest.raises(jaxckpt.errors.JaxckptError) as e:
                call()
            messages.append(str(e.value))
    for python, _ in CLI_WORDS:
        assert any(python in m for m in messages), python


# ------------------------------------------------------------------- ls and verify agree


def test_ls_and_verify_count_a_step_the_same(ckpt):
    """Both count every file in the step folder, the manifest and Orbax's commit files too."""
    listed = {s["step"]: s for s in json.loads(cli("ls", ckpt, "--json").output)["steps"]}
    verified = json.loads(cli("verify", ckpt, "--json").output)["steps"]
    text = cli("verify", ckpt).output.splitlines()
    for report, line in zip(verified, text, strict=True):
        step = report["step"]
        files = [f for f in (ckpt / str(step)).rglob("*") if f.is_file()]
        on_disk = (len(files), sum(f.stat().st_size for f in files))
        assert (listed[step]["files"], listed[step]["bytes"]) == on_disk
        assert (report["files"], report["bytes"]) == on_disk
        assert line == f"step {step}: ok ({on_disk[0]} files, {on_disk[1]:,} bytes)"
        ls_row = next(r for r in cli("ls", ckpt).output.splitlines() if f" {step} " in r)
        assert f"  {on_disk[0]}  " in ls_row


# ------------------------------------------------------------------- inspect --data


def test_inspect_data_shows_each_process_iterator_state(ckpt, tmp_path):
    result = cli("inspect", ckpt, "--data")
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[1:] == ['process 0 of 1: {"position": 130}']
    doc = json.loads(cli("inspect", ckpt, "--step", 10, "--data", "--json").output)
    assert doc["data_states"] == [{"process": 0, "processes": 1, "state": {"position": 110}}]
    assert "show it with --data" in cli("inspect", ckpt).output

    # grain's DataLoaderIterator saves its state as JSON bytes; a step without data= has none.
    import grain

    loader = grain.DataLoader(
        data_source=list(range(10)),
        sampler=grain.samplers.IndexSampler(10, shuffle=False, num_epochs=1),
        worker_count=0,
    )
    data = iter(loader)
    next(data)
    with jaxckpt.CheckpointManager(tmp_path / "grain") as m:
        m.save(1, state={"w": np.ones(2)}, data=data)
        m.save(2, state={"w": np.ones(2)})
    (state,) = json.loads(
        cli("inspect", tmp_path / "grain", "--step", 1, "--data", "--json").output
    )["data_states"]
    assert state["state"] == json.loads(data.get_state())
    result = cli("inspect", tmp_path / "grain", "--data")
    assert "no data-iterator state: the step was saved without a data iterator" in result.output


# ---------------------------------------------------------------------------------- rm


def test_rm_deletes_a_step_as_the_writer(ckpt, tmp_path, mesh):
    directory = tmp_path / "ckpt"
    shutil.copytree(ckpt, directory)

    result = cli("rm", directory, 20)  # the latest: refused without --force
    assert result.exit_code == 2 and "would go back to step 10. Pass --force" in result.output
    assert cli("rm", directory, 7).exit_code == 1
    with jaxckpt.CheckpointManager(directory):  # a live writer holds the lock
        result = cli("rm", directory, 10)
        assert result.exit_code == 1 and "is being written by host" in result.stderr
        assert "Stop that job first" in result.stderr
        assert not PYTHON_ARGUMENT.search(result.stderr), result.stderr
    assert jaxckpt.CheckpointManager(directory, read_only=True).all_steps() == [10, 20]

    result = cli("rm", directory, 10)
    assert result.exit_code == 0, result.output
    assert result.output == f"deleted step 10 from {directory}; committed steps: 20\n"
    assert sorted(p.name for p in directory.iterdir()) == [".jaxckpt-writer.lock", "20"]
    doc = json.loads(cli("rm", directory, 20, "--force", "--json").output)
    assert doc["deleted"] == 20 and doc["steps"] == []
    with jaxckpt.CheckpointManager(directory) as m:  # the lock was released
        m.save(30, state=state_at(mesh, 30))
    assert jaxckpt.CheckpointManager(directory, read_only=True).all_steps() == [30]


# ------------------------------------------------------------------- Orbax's log noise


@pytest.mark.parametrize("log", ["default", "debug"])
def test_orbax_warnings_and_thread_tracebacks_go_to_the_debug_log(tmp_path, log):
    """A read-only manager and a save failing in the background print jaxckpt's one
    message: absl's warnings and Orbax's per-thread tracebacks only in the debug log. A
    user's own plain Orbax save failing beside it is logged as without jaxckpt."""
    directory = tmp_path / "ckpt"
    try:
        proc = run_python("-m", "children.orbax_noise", str(directory), log)
    finally:
        if (directory / "2.orbax-checkpoint-tmp").exists():
            subprocess.run(["chattr", "-i", str(directory / "2.orbax-checkpoint-tmp")], timeout=30)
        for left in tmp_path.glob("ckpt-plain/1.orbax-checkpoint-tmp*"):
            subprocess.run(["chattr", "-i", str(left)], timeout=30)
    everything = proc.stderr.splitlines()
    plain = f"directory: {directory}-plain/1"
    start = next(i for i, line in enumerate(everything) if plain in line)
    lines, beside = everything[:start], everything[start:]
    caught = [line for line in lines if line.startswith("caught: saving step 2 failed")]
    assert len(caught) == 1 and "Step 2 was not committed" in caught[0], proc.stderr
    if log == "default":
        assert lines == caught, proc.stderr
    else:  # the details are still there, at DEBUG level
        assert "DEBUG:absl:[process=0] Failed to run" in proc.stderr
        assert "Traceback" in proc.stderr
        assert not [line for line in lines if line.startswith(("WARNING:absl", "ERROR:absl"))]
    assert beside[0].startswith("ERROR:absl:[process=0] Failed to run"), beside[:3]
    assert "Traceback (most recent call last):" in beside and beside[-1].startswith("plain: ")

"""Every file a reader loads whole is checked against the size it may have before one byte
of it is read (`_storage.read_small`, `_sizes.oversized`): a 1.5 GiB sparse file (4 KiB of
disk) in place of any small file of a step costs no reader more than a few MB, and ends in
a named error or in nothing at all (a file no reader loads). On object storage, a swollen
object is never fetched: the server's own request log says so."""

import ast
import json
import os
from pathlib import Path

import jax
import numpy as np
import pytest
from click.testing import CliRunner

import jaxckpt
from conftest import REPO, run_python
from jaxckpt import errors
from jaxckpt.cli import main as cli_main

KINDS = ("jaxckpt", "local", "orbax", "orbax-0.2.3")
ENTRIES = (
    "restore",
    "open.read",
    "ls",
    "inspect",
    "inspect --data",
    "verify",
    "diff --values",
    "plan",
    "export",
    "export --format orbax",
)
# The files each kind's readers load whole: swollen, restore must refuse them by name.
WHOLE = {
    "jaxckpt": [
        "jaxckpt/jaxckpt.json",
        "jaxckpt/manifest.json",
        "packed/0-of-1.json",
        "data/process_0-of-1.json",
        "data/iterator_0-of-1.json",
        "state/_METADATA",
        "state/_sharding",
        "state/manifest.ocdbt",
        "state/ocdbt.process_0/manifest.ocdbt",
        "state/array_metadatas/process_0",
    ],
    "orbax": [
        "_CHECKPOINT_METADATA",
        "default/_METADATA",
        "default/_sharding",
        "default/manifest.ocdbt",
        "default/ocdbt.process_0/manifest.ocdbt",
        "default/array_metadatas/process_0",
    ],
    "orbax-0.2.3": [
        "default/checkpoint",
        "default/params.params.dense.kernel/.zarray",
        "default/params.params.dense.kernel/0.0",  # a chunk: tensorstore reads it whole
    ],
}
MB = 100  # the most a reader's peak RSS may grow by, with 1.5 GiB claimed by a file


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """One child process swells each small file of each kind in turn and runs every reader
    on it (tests/children/swollen.py): {(kind, file, entry): (MB, outcome)}."""
    out = tmp_path_factory.mktemp("swollen") / "cases.jsonl"
    old = REPO / ".venv-orbax-0.2.3" / "bin" / "python"
    assert old.exists(), f"{old} is missing: `make test` installs it"
    run_python("-m", "tests.children.swollen", str(out), str(old), timeout=900)
    found = {}
    for line in out.read_text().splitlines():
        case = json.loads(line)
        found[case["kind"], case["file"], case["entry"]] = (case["mb"], case["outcome"])
    return found


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("kind", KINDS)
def test_no_reader_grows_by_what_a_swollen_file_claims(cases, kind, entry):
    ran = {f: v for (k, f, e), v in cases.items() if (k, e) == (kind, entry)}
    if kind == "local" and entry != "restore":  # (only a restore reads the local tier)
        assert not ran
        return
    assert len(ran) >= 5, f"{kind}: too few files swollen: {sorted(ran)}"
    grew = {f: round(mb) for f, (mb, _) in ran.items() if mb > MB}
    assert not grew, f"{kind}, {entry}: peak RSS grew by (MB): {grew}"
    raw = {f: outcome for f, (_, outcome) in ran.items() if outcome.startswith("raw")}
    assert not raw, f"{kind}, {entry}: not a named error: {raw}"


@pytest.mark.parametrize(
    ("kind", "rel"), [(kind, rel) for kind, files in WHOLE.items() for rel in files]
)
def test_a_swollen_file_read_whole_is_refused_by_name(cases, kind, rel):
    _, outcome = cases[kind, rel, "restore"]
    assert outcome.startswith("named: CorruptCheckpointError"), outcome
    assert Path(rel).name in outcome and "1,610,612,736 bytes" in outcome.replace(
        "1610612736 bytes", "1,610,612,736 bytes"
    ), outcome


def test_a_swollen_local_part_is_passed_over_and_the_older_one_restored(cases):
    """A local step whose small file is swollen does not verify: the restore falls back
    (to step 1 of the local tier), never reading the file."""
    ran = {f: v for (k, f, e), v in cases.items() if (k, e) == ("local", "restore")}
    assert {"jaxckpt/part.json", "jaxckpt/manifest.json", "packed/0-of-1.json"} <= set(ran)
    assert all(outcome == "ok" for _, outcome in ran.values()), ran


def test_a_stray_merged_index_in_a_one_process_step_is_never_read(cases):
    """`packed/index.json` is written only by a job of several processes: in a one-process
    step it is never read (the step is refused as holding a file not in its manifest)."""
    for entry in ("restore", "open.read", "export"):
        mb, outcome = cases["jaxckpt", "stray packed/index.json", entry]
        assert mb < MB and "packed/index.json: not in the manifest" in outcome, (entry, outcome)


# A whole-file read outside `_storage.read_whole`: a call that reads all there is (a
# blob's download, unless it asks for a range that ends).
_WHOLE_CALLS = {"read_text", "read_bytes", "readall"}
_DOWNLOADS = {"download_as_bytes", "download_as_text", "download_as_string"}


def _ranged(call: ast.Call) -> bool:
    """A download or `cat_file` that asks for a range with an end."""
    return "end" in {k.arg for k in call.keywords}


def test_every_whole_file_read_goes_through_read_whole():
    """No module of jaxckpt reads a file (or an object) whole but through
    `_storage.read_whole`, which checks its length first: `f.read()` with no size,
    `read_text`, `read_bytes`, `readall`, `json.load(f)`, a blob's `download_as_bytes`
    of no range (a lease's asks for at most `_leases.MAX_LEASE_BYTES` + 1)."""
    found = []
    for path in sorted((REPO / "jaxckpt").rglob("*.py")):
        tree = ast.parse(path.read_text())
        owner = {}  # each call's enclosing function
        for fn in ast.walk(tree):
            if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                for node in ast.walk(fn):
                    owner.setdefault(node, fn.name)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            name, on = node.func.attr, node.func.value
            unsized = not node.keywords and (
                not node.args
                or (isinstance(node.args[0], ast.Constant) and node.args[0].value in (None, -1))
                or isinstance(node.args[0], ast.UnaryOp)  # read(-1)
            )
            module = on.id if isinstance(on, ast.Name) else None
            whole = (
                (name == "read" and unsized)
                or name in _WHOLE_CALLS
                or (name in _DOWNLOADS | {"cat_file", "cat"} and not _ranged(node))
                or (name == "load" and module in ("json", "yaml", "pickle", "np", "numpy"))
                or (
                    name in ("safe_load", "load")
                    and module == "yaml"
                    and not isinstance(node.args[0], ast.Call)  # (a stream, not bytes read)
                )
            )
            allowed = path.name == "_storage.py" and owner.get(node) in ("read", "read_whole")
            if whole and not allowed:
                found.append(f"{path.relative_to(REPO)}:{node.lineno} {ast.unparse(node)}")
    assert not found, found


def test_the_limit_is_settable_and_a_bad_setting_is_named(tmp_path, monkeypatch):
    directory = tmp_path / "ckpt"
    with jaxckpt.CheckpointManager(directory) as m:
        m.save(1, state={"w": np.arange(4, dtype=np.float32)})
    size = (directory / "1" / "jaxckpt" / "jaxckpt.json").stat().st_size
    monkeypatch.setenv("JAXCKPT_MAX_METADATA_BYTES", str(size - 1))
    with pytest.raises(errors.CorruptCheckpointError, match="JAXCKPT_MAX_METADATA_BYTES raises"):
        jaxckpt.open(directory).read(1, state={"w": np.zeros(4, np.float32)})
    assert jaxckpt.open(directory).latest() is None  # (its metadata cannot be read)
    monkeypatch.setenv("JAXCKPT_MAX_METADATA_BYTES", str(2**20))
    got = jaxckpt.open(directory).read(state={"w": np.zeros(4, np.float32)})
    np.testing.assert_array_equal(got.state["w"], np.arange(4, dtype=np.float32))
    monkeypatch.setenv("JAXCKPT_MAX_METADATA_BYTES", "lots")
    with pytest.raises(errors.ConfigError, match="JAXCKPT_MAX_METADATA_BYTES='lots'"):
        jaxckpt.open(directory).read(state={"w": np.zeros(4, np.float32)})


# --------------------------------------------------------------------- object storage


def test_a_swollen_object_is_never_fetched(bucket, bucket_dir, mesh, monkeypatch):
    """On gs:// and s3://: each small object replaced by 8 MiB, over a 1 MiB limit. The
    restore, `jaxckpt inspect` and `verify` name it, and the server's log shows that no
    reader fetched it (its size, from a listing or one metadata request, decided)."""
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    state = {
        "w": jax.device_put(np.ones((512, 1024), np.float32), sharding),
        "b": np.ones(4, np.float32),
    }
    target = {
        "w": jax.ShapeDtypeStruct((512, 1024), np.float32, sharding=sharding),
        "b": np.zeros(4, np.float32),
    }
    with jaxckpt.CheckpointManager(bucket_dir, incremental=False) as m:  # `w`: an Orbax array
        for step in (1, 2):
            m.save(step, state=state)
    monkeypatch.setenv("JAXCKPT_MAX_METADATA_BYTES", str(2**20))
    import fsspec

    fs = fsspec.filesystem(bucket_dir.partition("://")[0])
    step = f"{bucket_dir.partition('://')[2]}/2"
    swollen = bytes(8 * 2**20)

    def fetched(since, rel):
        return [
            o for kind, o in bucket.requests(since) if kind == "read" and o.endswith(f"/2/{rel}")
        ]

    for rel in ("jaxckpt/jaxckpt.json", "jaxckpt/manifest.json", "state/_METADATA"):
        original = fs.cat_file(f"{step}/{rel}")
        fs.pipe_file(f"{step}/{rel}", swollen)
        try:
            since = bucket.mark()
            with pytest.raises(errors.CorruptCheckpointError, match=rel.rpartition("/")[2]):
                jaxckpt.open(bucket_dir).read(2, state=target)
            for command in ("inspect", "verify"):  # (inspect reads jaxckpt.json alone)
                result = CliRunner().invoke(cli_main, [command, "--step", "2", bucket_dir])
                shown = result.output.strip().splitlines()
                if command == "verify" or rel == "jaxckpt/jaxckpt.json":
                    assert result.exit_code == 1, shown
                    assert shown[-1].startswith("jaxckpt: error: "), shown
            assert not fetched(since, rel), f"{rel} was fetched"
        finally:
            fs.pipe_file(f"{step}/{rel}", original)
    since = bucket.mark()
    got = jaxckpt.open(bucket_dir).read(2, state=target)  # whole again: it reads
    assert fetched(since, "jaxckpt/jaxckpt.json")  # (as the log shows a read)
    np.testing.assert_array_equal(np.asarray(got.state["w"]), np.ones((512, 1024), np.float32))


def test_the_readers_bounded_by_their_own_limits_keep_them(tmp_path):
    """The HF index and a name map, read whole by the safetensors import and export, are
    read through read_whole too: a sparse 1.5 GiB index is refused by its size."""
    index = tmp_path / "model.safetensors.index.json"
    with open(index, "wb") as f:
        f.truncate(3 * 2**29)
    with pytest.raises(errors.FormatError, match="too many for an index"):
        jaxckpt.load_safetensors(tmp_path, {"w": np.zeros(3, np.float32)})
    names = tmp_path / "names.yaml"
    with open(names, "wb") as f:
        f.truncate(3 * 2**29)
    with pytest.raises(errors.ConfigError, match=r"cannot read the name map .*over the"):
        jaxckpt.NameMap.load(str(names))
    assert os.path.getsize(names) == 3 * 2**29  # (nothing written)


def test_a_step_no_reader_could_read_is_never_written(tmp_path, monkeypatch):
    """The save refuses a step whose jaxckpt.json would be over the limit a reader holds
    it to: saved, it would be a step latest_step() passes over and no restore reads."""
    directory = tmp_path / "ckpt"
    monkeypatch.setenv("JAXCKPT_MAX_METADATA_BYTES", "4000")
    with jaxckpt.CheckpointManager(directory) as m:
        many = {f"layer_{i}": np.zeros(2, np.float32) for i in range(40)}
        with pytest.raises(errors.ConfigError, match="over the 4,000 a reader reads whole"):
            m.save(1, state=many)
        m.save(1, state={"w": np.ones(2, np.float32)})  # small enough: saved
    assert jaxckpt.open(directory).steps() == [1]

"""Packed indexes that claim more than their files hold: a step's `jaxckpt.json` and
`packed/0-of-1.json` rewritten as an attacker would (the manifest too, where the checksums
must pass), so that a few KiB on disk claim GiBs or TiBs. Every such step is a
`CorruptCheckpointError` before anything of the claimed size is allocated or read, on
restore (which `fallback=True` passes over) and in `jaxckpt diff --values` (which does not
verify).

Allocations are measured, not timed: the restores and diffs that could allocate run in a
child process (this module, run with `-m`) that reports how much its peak RSS grew. Its
address space is limited to HEADROOM above what it had mapped once JAX ran: room for one
claimed GiB, so that a reader allocating it shows in the RSS even where the checksums'
verdict then explains the failure, but not for the 2 GiB or the TiB the claims would cost
in all (a MemoryError there, never the machine's memory)."""

import json
import resource
import shutil
import sys

import numpy as np
import pytest
import xxhash

import jaxckpt
from jaxckpt import _integrity, errors
from reliability import launch

SMALL = 8192  # bytes of the leaf "small" (uint8): the one an attacker inflates
HEADROOM = 1280 * 2**20  # the child's address space beyond what it has mapped at first
MAX_GROWTH = 128 * 2**20  # how much more RSS a refused step may cost than a normal restore


def _state(step):
    return {
        "small": ((np.arange(SMALL) + step) % 251).astype(np.uint8),
        "b": np.full(4, step, np.float32),
    }


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """Steps 1 and 2 of a real checkpoint; copied for each test."""
    directory = tmp_path_factory.mktemp("packed_hostile") / "ckpt"
    with jaxckpt.CheckpointManager(directory, incremental=False) as m:  # format 2
        for step in (1, 2):
            m.save(step, state=_state(step))
    return directory


@pytest.fixture
def ckpt(pristine, tmp_path):
    directory = tmp_path / "ckpt"
    shutil.copytree(pristine, directory)
    return directory


def _inflate(step_dir, shape, pieces, *, size=None, rehash=True):
    """Leaf "small" claimed to be uint8 of `shape` in `jaxckpt.json` and in the index, held
    by `pieces(offset)` (its real offset in the file given); `size`: the file's bytes the
    index claims (None: as written); `rehash`: the manifest rewritten to match."""
    index_path = step_dir / "packed" / "0-of-1.json"
    index = json.loads(index_path.read_text())
    entry = index["leaves"]["state"]["small"]
    ((offset, _, digest),) = entry["pieces"]
    # each piece with a digest (format 2): the claims are refused before any piece is read
    claimed = [p if len(p) == 3 else [*p, digest] for p in pieces(offset)]
    entry.update(shape=list(shape), pieces=claimed)
    if size is not None:
        index["bytes"] = size(offset)
    index_path.write_text(json.dumps(index))
    info_path = step_dir / "jaxckpt" / "jaxckpt.json"
    info = json.loads(info_path.read_text())
    (leaf,) = [s for s in info["items"]["state"] if s["name"] == "small"]
    leaf["shape"] = list(shape)
    info_path.write_text(json.dumps(info))
    if rehash:  # an attacker who can write the step can also rewrite its manifest
        _integrity.write_manifest(step_dir)


def _gib_in_two_pieces(step_dir, *, rehash=True):
    """2**30 bytes claimed in two pieces of an 8 KiB file (the index's size claimed too)."""
    half = 2**29
    _inflate(
        step_dir,
        [2 * half],
        lambda at: [[at, [[0, half]]], [at + half, [[half, 2 * half]]]],
        size=lambda at: at + 2 * half,
        rehash=rehash,
    )


def _run(action, directory):
    proc = launch.run(
        "-m",
        "test_packed_hostile",
        action,
        directory,
        timeout=300,
        capture_output=True,
        text=True,
        env={"JAX_PLATFORMS": "cpu"},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    *_, last = proc.stdout.strip().splitlines()
    return json.loads(last), proc.stdout


def test_a_normal_restore_fits_in_the_childs_limit(ckpt):
    # The control: the measure lets a step through that claims no more than it holds.
    got, _ = _run("restore", ckpt)
    assert got["error"] is None and got["step"] == 2
    assert got["grew"] < MAX_GROWTH


@pytest.mark.parametrize("rehash", [False, True], ids=["checksums-fail", "manifest-rewritten"])
def test_a_gib_claimed_for_8_kib_is_corrupt_before_anything_is_allocated(ckpt, rehash):
    _gib_in_two_pieces(ckpt / "2", rehash=rehash)
    got, _ = _run("restore", ckpt)
    assert got["error"] == "CorruptCheckpointError", got
    assert got["grew"] < MAX_GROWTH
    if rehash:  # the checksums pass: the index's own claim is refused
        assert "0-of-1.bin holds 8208 bytes" in got["message"], got


def test_pieces_sharing_their_bytes_are_corrupt_not_a_leaf_of_repeated_bytes(ckpt):
    # 4,096 pieces all at the leaf's offset in the file: each within the file, together
    # tiling a leaf 4,096 times its size. Once restored "successfully" as 32 MiB of copies.
    _inflate(
        ckpt / "2",
        [4096 * SMALL],
        lambda at: [[at, [[i * SMALL, (i + 1) * SMALL]]] for i in range(4096)],
    )
    m = jaxckpt.CheckpointManager(ckpt, read_only=True)
    with m, pytest.raises(errors.CorruptCheckpointError, match="pieces overlap at byte 16"):
        m.restore()


def test_a_tib_piece_is_corrupt_and_fallback_passes_over_it(ckpt):
    _inflate(ckpt / "2", [2**40], lambda at: [[at, [[0, 2**40]]]], size=lambda at: at + 2**40)
    with jaxckpt.CheckpointManager(ckpt, read_only=True) as m:
        with pytest.raises(
            errors.CorruptCheckpointError,
            match=r"0-of-1\.bin holds 8208 bytes, fewer than the 1099511627792 ",
        ):
            m.restore()
        got = m.restore(fallback=True)
    assert got.step == 1
    np.testing.assert_array_equal(got.state["small"], _state(1)["small"])


HALF = SMALL // 2


@pytest.mark.parametrize(
    "boxes",
    [
        [[[0, 1], [0, HALF]], [[0, 1], [0, HALF]]],  # row 0 twice, row 1 never
        [[[0, 1], [0, HALF]], [[0, 2], [HALF // 2, HALF]]],  # overlapping in row 0, a gap in 1
    ],
    ids=["a-box-twice", "overlap-and-gap"],
)
def test_pieces_of_the_leafs_volume_that_do_not_tile_it_are_corrupt(ckpt, boxes):
    # Each piece in bytes of its own within the file, their volume the leaf's.
    def pieces(at):
        out = []
        for box in boxes:
            out.append([at, box])
            at += (box[0][1] - box[0][0]) * (box[1][1] - box[1][0])
        return out

    _inflate(ckpt / "2", [2, HALF], pieces)
    m = jaxckpt.CheckpointManager(ckpt, read_only=True)
    with m, pytest.raises(errors.CorruptCheckpointError, match="'small' overlap, or are not"):
        m.restore()


def test_a_grid_of_pieces_as_a_multi_process_save_writes_them_restores_bitwise(ckpt):
    # The leaf as 8 shards of a (4, 2) mesh, written in an order of their own, as the
    # processes of a job would write them: the checks must let the real layout through.
    whole = _state(2)["small"].reshape(64, 128)
    blob = (ckpt / "2/packed/0-of-1.bin").read_bytes()
    index = json.loads((ckpt / "2/packed/0-of-1.json").read_text())
    ((at, _, _),) = index["leaves"]["state"]["small"]["pieces"]
    cells = [(r, c) for r in range(4) for c in range(2)][::-1]
    pieces, chunks, offset = [], [], at
    for r, c in cells:
        box = [[16 * r, 16 * (r + 1)], [64 * c, 64 * (c + 1)]]
        chunks.append(whole[16 * r : 16 * (r + 1), 64 * c : 64 * (c + 1)].tobytes())
        pieces.append([offset, box, xxhash.xxh3_64_hexdigest(chunks[-1])])
        offset += len(chunks[-1])
    (ckpt / "2/packed/0-of-1.bin").write_bytes(blob[:at] + b"".join(chunks) + blob[offset:])
    _inflate(ckpt / "2", [64, 128], lambda _: pieces)
    with jaxckpt.CheckpointManager(ckpt, read_only=True) as m:
        got = m.restore()
    assert got.step == 2
    np.testing.assert_array_equal(got.state["small"], whole, strict=True)


@pytest.mark.parametrize("rehash", [True, False], ids=["manifest-rewritten", "checksums-fail"])
def test_diff_values_on_an_inflated_step_is_an_error_not_an_allocation(ckpt, rehash):
    # Both steps inflated alike, so that the leaf is read from both rather than reported
    # changed. With the manifest rewritten the index alone must be refused; without, diff
    # verifies as every read does, and the files' checksums refuse it.
    for step in ("1", "2"):
        _gib_in_two_pieces(ckpt / step, rehash=rehash)
    got, stdout = _run("diff", ckpt)
    assert got["exit"] == 2, stdout
    assert got["grew"] < MAX_GROWTH
    (report,) = [json.loads(line) for line in stdout.splitlines() if '"type"' in line]
    assert report["type"] == "CorruptCheckpointError", report
    why = "0-of-1.bin holds 8208 bytes" if rehash else "expected (truncated or grown)"
    assert why in report["error"]


# --- the child: python -m test_packed_hostile restore|diff DIRECTORY ------------------------


def _mapped() -> int:
    with open("/proc/self/status") as f:
        (line,) = [line for line in f if line.startswith("VmSize:")]
    return int(line.split()[1]) * 1024


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _child(action: str, directory: str) -> None:
    """Restores the latest step of `directory` (or diffs its steps 1 and 2 with the CLI's
    `diff --values --json`) once its address space is limited to HEADROOM above what it
    has mapped, and prints one JSON line: what it raised (or the CLI's exit status), the
    step restored, and how much its peak RSS grew."""
    import jax

    from jaxckpt.cli import main

    jax.devices()  # JAX started before the limit
    m = jaxckpt.CheckpointManager(directory, read_only=True)
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (_mapped() + HEADROOM, hard))
    before = _peak_rss()
    out = {"error": None, "message": None, "step": None, "exit": None}
    try:
        if action == "restore":
            out["step"] = m.restore().step
        else:
            main(["diff", directory, "1", "2", "--values", "--json"])
    except SystemExit as e:
        out["exit"] = e.code
    except (errors.JaxckptError, MemoryError) as e:
        out.update(error=type(e).__name__, message=str(e))
    out["grew"] = _peak_rss() - before
    m.close()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    _child(*sys.argv[1:])

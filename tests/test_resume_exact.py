"""Exact resumption the way a user hits it: separate processes, compared with a straight run.

A GPT-2 in Flax NNX with dropout, AdamW with a warmup-cosine schedule and a shuffled grain
pipeline (examples/train.py) trains 40 steps straight. Another run trains 20, saves, and
its process ends; a new process restores and trains 20 more: on the same (4, 2) mesh every
loss and every final parameter and optimizer value is bitwise equal; on a (2, 4) mesh the
data order is identical and the losses agree to 1e-5 relative. Through s3:// (a real S3
server on 127.0.0.1) the same-mesh resume is bitwise too.
"""

import shutil

import numpy as np
import pytest

from conftest import run_python
from examples.demo import differing_leaves, read_log

STEPS = 40


def train(*args):
    return run_python("examples/train.py", "--config=configs/demo.yaml", f"--steps={STEPS}", *args)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("reference")
    train(f"--log={out / 'ref.jsonl'}", f"--final={out / 'ref.npz'}")
    return out


def stop_at_20(where, ckpt):
    """Trains 20 steps with a save at 20 (the log in `where`), then its process ends."""
    first = train(
        f"--ckpt-dir={ckpt}", "--save-every=20", "--stop-at=20", f"--log={where / 'a.jsonl'}"
    )
    assert "stopped after step 20" in first.stdout


@pytest.fixture(scope="module")
def stopped_at_20(tmp_path_factory):
    """One run stopped at step 20 on local disk; `take(tmp_path)` copies it (its checkpoint
    directory and log) into a test's own directory."""
    where = tmp_path_factory.mktemp("stopped")
    stop_at_20(where, where / "ckpt")

    def take(tmp_path):
        shutil.copytree(where, tmp_path, dirs_exist_ok=True)

    return take


def resume(tmp_path, resume_mesh, ckpt=None):
    """A new process restores step 20 on `resume_mesh` and trains 20 more: each step's
    `field`, from both runs' logs."""
    ckpt = ckpt or tmp_path / "ckpt"
    second = train(
        f"--ckpt-dir={ckpt}",
        "--save-every=20",
        f"--mesh={resume_mesh}",
        f"--log={tmp_path / 'b.jsonl'}",
        f"--final={tmp_path / 'resumed.npz'}",
    )
    assert "resumed from step 20" in second.stdout

    def merged(field):
        before, after = read_log(tmp_path / "a.jsonl", field), read_log(tmp_path / "b.jsonl", field)
        assert sorted(before) == list(range(1, 21)) and sorted(after) == list(range(21, 41))
        return {**before, **after}

    return merged


def test_same_mesh_resume_in_a_new_process_is_bitwise_exact(reference, stopped_at_20, tmp_path):
    stopped_at_20(tmp_path)
    merged = resume(tmp_path, resume_mesh="4x2")
    assert merged("bits") == read_log(reference / "ref.jsonl", "bits")
    n_leaves, differing = differing_leaves(reference / "ref.npz", tmp_path / "resumed.npz")
    assert n_leaves == 97  # GPT-2 params, Adam moments, counts, dropout RNG state
    assert differing == []


def test_same_mesh_resume_through_s3_in_a_new_process_is_bitwise_exact(
    reference, tmp_path, s3_server
):
    ckpt = f"{s3_server.url}/resume-{tmp_path.name}"
    stop_at_20(tmp_path, ckpt)
    merged = resume(tmp_path, resume_mesh="4x2", ckpt=ckpt)
    assert merged("bits") == read_log(reference / "ref.jsonl", "bits")
    assert differing_leaves(reference / "ref.npz", tmp_path / "resumed.npz") == (97, [])


def test_resume_on_another_mesh_keeps_data_order_and_losses_within_1e5(
    reference, stopped_at_20, tmp_path
):
    stopped_at_20(tmp_path)
    merged = resume(tmp_path, resume_mesh="2x4")
    assert merged("batch_crc") == read_log(reference / "ref.jsonl", "batch_crc")
    got, want = merged("loss"), read_log(reference / "ref.jsonl", "loss")
    steps = sorted(want)
    np.testing.assert_allclose([got[s] for s in steps], [want[s] for s in steps], rtol=1e-5)

"""Exact resumption the way a user hits it: separate processes, compared bitwise.

An NNX transformer with dropout, AdamW with a warmup-cosine schedule and a shuffled grain
pipeline (examples/train.py) trains 40 steps straight; a second run trains 20, saves, and
its process ends; a third process restores and trains 20 more. Every one of the 40 losses
and every leaf of the final parameters and optimizer state must be bitwise equal.
"""

from conftest import run_python
from examples.demo import differing_leaves, read_losses


def test_stop_and_resume_in_a_new_process_is_bitwise_exact(tmp_path):
    ckpt = tmp_path / "ckpt"
    run_python(
        "examples/train.py",
        "--config=configs/demo.yaml",
        "--steps=40",
        f"--log={tmp_path / 'ref.jsonl'}",
        f"--final={tmp_path / 'ref.npz'}",
    )
    first = run_python(
        "examples/train.py",
        "--config=configs/demo.yaml",
        "--steps=40",
        f"--ckpt-dir={ckpt}",
        "--save-every=20",
        "--stop-at=20",
        f"--log={tmp_path / 'first.jsonl'}",
    )
    assert "stopped after step 20" in first.stdout
    second = run_python(
        "examples/train.py",
        "--config=configs/demo.yaml",
        "--steps=40",
        f"--ckpt-dir={ckpt}",
        "--save-every=20",
        f"--log={tmp_path / 'second.jsonl'}",
        f"--final={tmp_path / 'resumed.npz'}",
    )
    assert "resumed from step 20" in second.stdout

    reference = read_losses(tmp_path / "ref.jsonl")
    first_half, second_half = (
        read_losses(tmp_path / "first.jsonl"),
        read_losses(tmp_path / "second.jsonl"),
    )
    assert sorted(first_half) == list(range(1, 21))
    assert sorted(second_half) == list(range(21, 41))
    assert {**first_half, **second_half} == reference
    n_leaves, differing = differing_leaves(tmp_path / "ref.npz", tmp_path / "resumed.npz")
    assert n_leaves > 100  # model params, Adam moments, counts, dropout RNG state
    assert differing == []

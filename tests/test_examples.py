"""The examples a user copies run as documented: the demo end to end, the reshard example,
the NNX tutorial. The docs' own samples (the README's Quickstart among them) run in
tests/test_docs.py."""

import json

from conftest import run_python


def test_the_demo_passes_every_check():
    """`make demo`: preempted by SIGTERM, resumed on (2, 4) and on (4, 2), verified, exported
    and loaded in transformers; it exits non-zero if any check fails."""
    proc = run_python("examples/demo.py", timeout=900)
    assert "preempted: saved step" in proc.stdout
    assert "resumed from step" in proc.stdout and "mesh (2, 4)" in proc.stdout
    assert "RESULT: all checks passed" in proc.stdout, proc.stdout[-3000:]


def test_reshard_example_restores_onto_three_layouts(tmp_path):
    proc = run_python("examples/reshard.py", f"--ckpt-dir={tmp_path / 'ckpt'}")
    assert proc.stdout.count("every leaf equal to the saved one: True") == 3
    assert "model.h.0.mlp.c_fc.kernel.value: P(None, 'model'), shards (64, 64)" in proc.stdout
    assert "model.h.0.mlp.c_fc.kernel.value: P(None, None), shards (64, 256)" in proc.stdout


def test_the_flax_nnx_tutorial_resumes_bitwise_after_a_preemption(tmp_path):
    """The Flax NNX MNIST tutorial's model, nnx.Optimizer, nnx.MultiMetric and dropout Rngs,
    checkpointed by the Quickstart's loop and nothing else (no mesh, no pinning): preempted by
    SIGTERM at step 12, resumed in a new process, every loss and metric bitwise equal to a
    straight run's."""
    straight, resumed = tmp_path / "straight.jsonl", tmp_path / "resumed.jsonl"
    run = ["examples/nnx_mnist.py", "--steps=20", "--every=5"]
    run_python(*run, f"--ckpt-dir={tmp_path / 'a'}", f"--log={straight}")
    first = run_python(*run, f"--ckpt-dir={tmp_path / 'b'}", f"--log={resumed}", "--sigterm-at=12")
    assert "preempted: saved step 12" in first.stdout
    second = run_python(*run, f"--ckpt-dir={tmp_path / 'b'}", f"--log={resumed}")
    assert "resumed from step 12" in second.stdout
    a = [json.loads(line) for line in straight.read_text().splitlines()]
    b = [json.loads(line) for line in resumed.read_text().splitlines()]
    assert [r["step"] for r in b] == list(range(1, 21))
    assert a == b

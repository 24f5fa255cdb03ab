"""The examples a user copies run as documented: the demo end to end, the reshard example."""

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

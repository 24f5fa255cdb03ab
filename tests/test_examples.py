"""The examples a user copies run as documented: the demo end to end, the reshard example."""

import json

from conftest import REPO, run_python


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


def test_readme_reshard_snippet_runs(tmp_path):
    """README, "Restoring onto another mesh": the first snippet runs as printed (on 8 CPU
    devices, in a directory of the test's own)."""
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("### Restoring onto another mesh") :]
    snippet = section[section.index("```python\n") + 10 : section.index("```\n")]
    snippet = snippet.replace('"/ckpt/reshard"', repr(str(tmp_path / "ckpt")))
    proc = run_python(
        "-c",
        snippet,
        env={"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=8"},
    )
    assert "restore plan for step 1: 4 leaves" in proc.stdout


def test_readme_name_map_example_places_leaves():
    """README, "Name maps": the YAML example loads and places leaves as its comments say."""
    import yaml

    from jaxckpt.hf._names import NameMap

    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("#### Name maps") :]
    example = section[section.index("```yaml\n") + 8 : section.index("```\n")]
    names = NameMap.load(yaml.safe_load(example))
    assert names.place("model.wte.embedding.value", (10, 4)).names == ("transformer.wte.weight",)
    attn = names.place("model.h.0.attn.kernel.value", (4, 8))
    assert attn.names == ("transformer.h.0.attn.weight",) and attn.transpose == (1, 0)
    mlp = names.place("model.layers.mlp.kernel.value", (2, 4, 8))
    assert mlp.names == ("model.layers.0.mlp.weight", "model.layers.1.mlp.weight")
    assert names.place("model.h.0.rngs.dropout.key", (2,)) is None  # dropped
    assert names.place("opt.mu.w", (4,)) is None  # not included


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


def test_readme_equinox_recipe_resumes_bitwise_in_a_new_process(tmp_path):
    """README, "Equinox and Levanter-style trainers": the script runs as printed; run twice
    (5 steps, then 5 more from the step it saved, each a new process) it gives the losses of
    one run of 10 steps, bit for bit."""
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## Equinox and Levanter-style trainers") :]
    script = section[section.index("```python\n") + 10 : section.index("```\n")]
    env = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}

    def run(directory, steps=5):
        text = script.replace('"/ckpt/equinox"', repr(str(directory)))
        text = text.replace("STEPS = 5 ", f"STEPS = {steps} ")
        return [line for line in run_python("-c", text, env=env).stdout.splitlines()]

    resumed = run(tmp_path / "a") + run(tmp_path / "a")
    straight = run(tmp_path / "b", steps=10)
    assert [line.split()[1] for line in resumed] == [str(s) for s in range(1, 11)]
    assert resumed == straight

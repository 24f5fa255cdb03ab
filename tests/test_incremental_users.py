"""Incremental steps under real fine-tunes (tests/children/fine_tunes.py): an NNX LoRA
fine-tune (`nnx.Optimizer(..., wrt=nnx.LoRAParam)`), a Linen one freezing its base with
`optax.multi_transform`, an Equinox one freezing a part with `eqx.partition`. Each trains
3 steps saving each, its process ends, and a new process restores step 3 and trains 3 more:
its final state is bitwise that of 6 steps run straight, and every save after the first,
the restarted process's first among them, wrote only the trained part's bytes (and the
leaves of at most 1 MiB, which every save writes)."""

import json

import numpy as np
import pytest

from conftest import run_python


def fine_tune(kind, directory, stop, out):
    run_python("-m", "children.fine_tunes", kind, str(directory), str(stop), str(out))
    return json.loads(out.with_suffix(".json").read_text())


@pytest.mark.parametrize("kind", ["nnx", "linen", "equinox"])
def test_a_fine_tune_resumed_in_a_new_process_is_bitwise_and_writes_only_what_it_trains(
    tmp_path, kind
):
    fine_tune(kind, tmp_path / "straight", 6, tmp_path / "straight")
    fine_tune(kind, tmp_path / "resumed", 3, tmp_path / "first")
    report = fine_tune(kind, tmp_path / "resumed", 6, tmp_path / "resumed")
    assert report["start"] == 3

    want, got = np.load(tmp_path / "straight.npz"), np.load(tmp_path / "resumed.npz")
    assert sorted(got.files) == sorted(want.files)
    differing = [k for k in want.files if got[k].tobytes() != want[k].tobytes()]
    assert not differing, differing

    own, state = report["own_bytes"], report["state_bytes"]
    # every trained leaf is of at most 1 MiB, which a save writes each time: what a later
    # save writes is the small leaves, the trained part among them, and nothing else
    assert report["trained_small_bytes"] == report["trained_bytes"]
    rewritten = report["small_bytes"]
    assert own["1"] >= state  # the first save writes every piece
    assert rewritten < state / 10
    for step in "23456":
        assert own[step] <= 1.05 * rewritten, (step, own, rewritten)

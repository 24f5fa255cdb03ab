"""jaxckpt.diff, the library function behind `jaxckpt diff` (tested through the CLI in
test_cli.py): what Python users get."""

import numpy as np
import pytest

import jaxckpt
from jaxckpt import errors


def test_diff_names_leaves_and_values_that_differ(tmp_path):
    with jaxckpt.CheckpointManager(tmp_path / "a") as m:
        m.save(1, state={"w": np.arange(6.0), "b": np.zeros(2, np.int32), "old": np.ones(1)})
        m.save(2, state={"w": np.arange(6.0) + 0.5, "b": np.zeros(3, np.int32), "new": 1.0})
    found = jaxckpt.diff(tmp_path / "a", step_a=1, step_b=2)
    assert found.steps == (1, 2) and found.max_abs_diff is None
    assert (found.added, found.removed, found.changed) == (["new"], ["old"], ["b"])
    assert found.different
    valued = jaxckpt.diff(tmp_path / "a", step_a=1, step_b=2, values=True)
    assert valued.max_abs_diff == {"w": 0.5} and valued.differing == {"w": 0.5}


def test_diff_of_two_directories_latest_steps(tmp_path):
    for name, step in (("a", 3), ("b", 7)):
        with jaxckpt.CheckpointManager(tmp_path / name) as m:
            m.save(1, state={"w": np.zeros(4, np.float32)})
            m.save(step, state={"w": np.arange(4, dtype=np.float32)})
    seen = []
    found = jaxckpt.diff(
        tmp_path / "a", tmp_path / "b", values=True, progress=lambda *a: seen.append(a)
    )
    assert found.steps == (3, 7) and not found.different
    assert found.max_abs_diff == {"w": 0.0} and seen[-1] == (16, 16)
    with pytest.raises(errors.ConfigError, match="item must be one of"):
        jaxckpt.diff(tmp_path / "a", item="params")
    with pytest.raises(errors.StepNotFoundError):
        jaxckpt.diff(tmp_path / "a", step_a=2)

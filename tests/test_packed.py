"""Small leaves packed per process (format 2), and steps of format 1 (an Orbax array per
leaf) restoring as they always did."""

import json
import shutil
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt

FIXTURES = Path(__file__).parent / "fixtures"
sys.path.insert(0, str(FIXTURES))
import write_format1  # noqa: E402


@pytest.fixture
def format1(tmp_path):
    """A copy of the checked-in format-1 step (readers never write, but a test's copy is
    its own)."""
    out = tmp_path / "format1"
    shutil.copytree(FIXTURES / "format1", out)
    return out


def test_the_fixture_is_format_1(format1):
    doc = json.loads((format1 / "3/jaxckpt/jaxckpt.json").read_text())
    assert doc["format"] == 1


@pytest.mark.parametrize("onto", ["same", "other", "one"])
def test_a_format_1_step_restores_bitwise(format1, mesh, onto):
    v = write_format1.values()
    shapes = {"same": ((4, 2), P("data", "model")), "other": ((2, 4), P("model", "data"))}
    if onto == "one":
        sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        replicated = sharding
    else:
        shape, spec = shapes[onto]
        m = jax.make_mesh(shape, ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
        sharding, replicated = NamedSharding(m, spec), NamedSharding(m, P())
    params = v["state"]["params"]

    def target(x, s):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)

    state = {
        "params": {
            "w": target(params["w"], sharding),
            "b": target(params["b"], replicated),
            "emb": target(params["emb"], replicated),
        },
        "step": v["state"]["step"],
        "counts": v["state"]["counts"],
    }
    data = write_format1.Data()
    data.state = None
    with jaxckpt.CheckpointManager(format1, read_only=True) as m:
        r = m.restore(state=state, rng=v["rng"], data=data)
    assert r.step == 3 and r.meta == {"written_by": "format 1"}
    for name in ("w", "b", "emb"):
        got = r.state["params"][name]
        assert got.sharding == state["params"][name].sharding
        np.testing.assert_array_equal(np.asarray(got), params[name], strict=True)
    assert int(r.state["step"]) == 41
    np.testing.assert_array_equal(r.state["counts"], v["state"]["counts"])
    assert jax.random.key_data(r.rng).tolist() == jax.random.key_data(v["rng"]).tolist()
    assert data.state == v["data"]


def test_a_format_1_step_verifies(format1):
    (report,) = jaxckpt.verify(format1)
    assert report.ok and report.checksummed and report.files > 10

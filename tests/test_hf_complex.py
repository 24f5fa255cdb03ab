"""complex64 leaves as safetensors C64, both ways, bit for bit, proven by the reference
readers (the `safetensors` package and torch); complex128, which safetensors has no dtype
for, is skipped with a note like every leaf it cannot hold."""

import json
import struct

import jax
import numpy as np
import pytest
import safetensors
import safetensors.numpy
import safetensors.torch
import torch
from click.testing import CliRunner
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from jaxckpt.cli import main


def hard_complex64(shape, seed=0) -> np.ndarray:
    """Random complex64 values, with the bit patterns a value cast would lose: a NaN with a
    payload, -0.0, infinities, a subnormal."""
    rng = np.random.default_rng(seed)
    bits = rng.integers(0, 2**32, (*shape, 2), dtype=np.uint32)
    special = [0x7FC01234, 0x80000000, 0x7F800000, 0xFF800000, 0x00000001, 0xFFFFFFFF]
    bits.reshape(-1)[: len(special)] = special
    return bits.view(np.float32).view(np.complex64)[..., 0]


def same_bits(got, want) -> None:
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert got.tobytes() == want.tobytes()


def header(path) -> dict:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n])


@pytest.fixture(scope="module")
def complex_checkpoint(tmp_path_factory, mesh):
    host = {"z": hard_complex64((16, 6)), "v": hard_complex64((5,), seed=1)}
    sharded = jax.device_put(host["z"], NamedSharding(mesh, P("data", "model")))
    directory = tmp_path_factory.mktemp("complex") / "ckpt"
    with jaxckpt.CheckpointManager(directory) as m:
        m.save(1, state={"z": sharded, "v": host["v"], "w": np.ones(3, np.float32)})
    return directory, host


def test_complex64_exports_as_c64_that_safetensors_and_torch_read_bitwise(
    complex_checkpoint, tmp_path, mesh
):
    directory, host = complex_checkpoint
    result = jaxckpt.export_safetensors(directory, tmp_path / "hf")
    assert result.skipped == () and result.tensors == 3
    path = tmp_path / "hf" / "model.safetensors"
    assert header(path)["z"]["dtype"] == "C64" and header(path)["v"]["dtype"] == "C64"

    got = safetensors.numpy.load_file(path)
    same_bits(got["z"], host["z"])
    same_bits(got["v"], host["v"])
    in_torch = safetensors.torch.load_file(path)
    assert in_torch["z"].dtype == torch.complex64
    for name in ("z", "v"):  # torch's (real, imaginary) float32 pairs, as bits
        pairs = torch.view_as_real(in_torch[name]).numpy()
        same_bits(
            pairs.view(np.uint32),
            host[name].view(np.float32).reshape(*host[name].shape, 2).view(np.uint32),
        )

    # And back onto a mesh, and onto the host.
    target = {
        "z": jax.ShapeDtypeStruct((16, 6), np.complex64, sharding=NamedSharding(mesh, P("model"))),
        "v": np.zeros(5, np.complex64),
        "w": np.zeros(3, np.float32),
    }
    loaded = jaxckpt.load_safetensors(tmp_path / "hf", target)
    assert loaded["z"].sharding == NamedSharding(mesh, P("model"))
    same_bits(loaded["z"], host["z"])
    same_bits(loaded["v"], host["v"])


def test_cli_export_writes_c64(complex_checkpoint, tmp_path):
    directory, host = complex_checkpoint
    result = CliRunner().invoke(main, ["export", str(directory), str(tmp_path / "hf"), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["skipped"] == []
    path = tmp_path / "hf" / "model.safetensors"
    assert header(path)["z"]["dtype"] == "C64"
    same_bits(safetensors.numpy.load_file(path)["z"], host["z"])


def test_live_export_of_sharded_complex64_is_bitwise(mesh, tmp_path):
    host = {"rows": hard_complex64((8, 12)), "cols": hard_complex64((4, 6), seed=2)}
    specs = {"rows": P("data"), "cols": P(None, "model")}
    state = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in host.items()}
    result = jaxckpt.save_safetensors(state, tmp_path / "live")
    assert result.skipped == ()
    with safetensors.safe_open(tmp_path / "live" / "model.safetensors", "pt") as f:
        assert f.get_tensor("rows").dtype == torch.complex64
    got = safetensors.numpy.load_file(tmp_path / "live" / "model.safetensors")
    for name, value in host.items():
        same_bits(got[name], value)


def test_c64_written_by_the_reference_loads_bitwise(mesh, tmp_path):
    z = hard_complex64((4, 8), seed=3)
    safetensors.numpy.save_file({"z": z}, tmp_path / "model.safetensors")
    target = {"z": jax.ShapeDtypeStruct(z.shape, z.dtype, sharding=NamedSharding(mesh, P("data")))}
    same_bits(jaxckpt.load_safetensors(tmp_path, target)["z"], z)
    same_bits(jaxckpt.load_safetensors(tmp_path, {"z": np.zeros_like(z)})["z"], z)
    with pytest.raises(jaxckpt.errors.LeafMismatchError, match="dtype complex64 in the file"):
        jaxckpt.load_safetensors(tmp_path, {"z": np.zeros(z.shape, np.complex128)})


def test_complex128_is_skipped_with_a_note(tmp_path, caplog):
    """safetensors has no C128 (its own writer refuses complex128): the leaf is left out,
    named, and the rest is exported."""
    with pytest.raises(Exception, match="complex128"):
        safetensors.numpy.save_file({"x": np.zeros(1, np.complex128)}, tmp_path / "ref")
    with jaxckpt.CheckpointManager(tmp_path / "ckpt") as m:
        m.save(1, state={"wide": np.ones(2, np.complex128), "z": hard_complex64((3,))})
    result = jaxckpt.export_safetensors(tmp_path / "ckpt", tmp_path / "hf")
    assert result.skipped == ("wide",) and result.tensors == 1
    assert "export: skipping wide (dtype complex128; safetensors cannot hold it)" in caplog.text
    got = safetensors.numpy.load_file(tmp_path / "hf" / "model.safetensors")
    assert sorted(got) == ["z"]

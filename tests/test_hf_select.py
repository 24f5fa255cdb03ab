"""Which leaves an export writes: leaves safetensors cannot hold (PRNG keys, int4,
complex128) skipped with a note naming each, or refused on request; `include`/`exclude`
regexes (`--include`/`--exclude`) so that "only the params" needs no name map."""

import json

import jax
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
from click.testing import CliRunner
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from conftest import run_python
from jaxckpt import errors
from jaxckpt.cli import main

STATE = {
    "params": {
        "w": np.arange(6, dtype=np.float32).reshape(2, 3),
        "b": np.full(3, 2.0, np.float32),
        "q": np.array([1, -2, 7, -8], ml_dtypes.int4),  # no safetensors dtype
    },
    "opt": {"mu": np.ones(6, np.float32), "count": np.int32(4)},
    "wide": np.ones(2, np.complex128),  # no safetensors dtype either
    "key": jax.random.key(0),
}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    directory = tmp_path_factory.mktemp("select") / "ckpt"
    with jaxckpt.CheckpointManager(directory) as m:
        m.save(1, state=STATE)
    return directory


def exported(out) -> dict[str, np.ndarray]:
    return safetensors.numpy.load_file(out / "model.safetensors")


def cli(*args):
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert "Traceback" not in result.output, result.output
    return result


def test_unsupported_leaves_are_skipped_and_each_named(ckpt, tmp_path, caplog):
    result = jaxckpt.export_safetensors(ckpt, tmp_path / "hf")
    assert sorted(result.skipped) == ["key", "params.q", "wide"]
    assert sorted(exported(tmp_path / "hf")) == ["opt.count", "opt.mu", "params.b", "params.w"]
    notes = sorted(r.getMessage() for r in caplog.records if "skipping" in r.getMessage())
    assert notes == [
        "export: skipping key (a PRNG key; safetensors cannot hold it)",
        "export: skipping params.q (dtype int4; safetensors cannot hold it)",
        "export: skipping wide (dtype complex128; safetensors cannot hold it)",
    ]


def test_unsupported_leaves_refused_on_request_name_each_and_the_fix(ckpt, tmp_path):
    with pytest.raises(
        errors.UnsupportedValueError,
        match=r"cannot be safetensors: .*'params\.q' \(dtype int4\).*'wide' \(dtype complex128\)"
        r".*; leave them out with exclude=",
    ):
        jaxckpt.export_safetensors(ckpt, tmp_path / "hf", skip_unsupported=False)
    assert not (tmp_path / "hf").exists()
    result = cli("export", ckpt, tmp_path / "hf", "--no-skip-unsupported")
    assert result.exit_code == 1
    (line,) = result.output.splitlines()
    assert line.startswith("jaxckpt: error: these leaves cannot be safetensors: ")
    assert "leave them out with --exclude" in line and "=True" not in line
    # Leaving them out is then enough.
    result = cli(
        "export", ckpt, tmp_path / "hf", "--no-skip-unsupported", "--exclude", r"\.q$",
        "--exclude", "^(wide|key)$",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert sorted(exported(tmp_path / "hf")) == ["opt.count", "opt.mu", "params.b", "params.w"]


def test_include_and_exclude_pick_leaves_by_name(ckpt, tmp_path):
    only = jaxckpt.export_safetensors(ckpt, tmp_path / "params", include=r"^params\.")
    assert sorted(exported(tmp_path / "params")) == ["params.b", "params.w"]
    assert only.skipped == ("params.q",)  # included, but not storable
    np.testing.assert_array_equal(exported(tmp_path / "params")["params.w"], STATE["params"]["w"])

    both = jaxckpt.export_safetensors(
        ckpt, tmp_path / "two", include=[r"^params\.w$", r"^opt\.mu$"]
    )
    assert sorted(exported(tmp_path / "two")) == ["opt.mu", "params.w"] and both.skipped == ()

    jaxckpt.export_safetensors(ckpt, tmp_path / "minus", include="^params", exclude=r"\.b$")
    assert sorted(exported(tmp_path / "minus")) == ["params.w"]


def test_include_spares_the_name_map_a_catch_all(ckpt, tmp_path):
    names = {
        "rules": [
            {"match": r"^params\.w$", "name": "linear.weight", "transpose": [1, 0]},
            {"match": r"^params\.b$", "name": "linear.bias"},
        ]
    }
    with pytest.raises(errors.NameMapError, match="no name-map rule places these leaves"):
        jaxckpt.export_safetensors(ckpt, tmp_path / "hf", names=names)
    jaxckpt.export_safetensors(ckpt, tmp_path / "hf", names=names, include=r"^params\.[wb]$")
    got = exported(tmp_path / "hf")
    assert sorted(got) == ["linear.bias", "linear.weight"]
    np.testing.assert_array_equal(got["linear.weight"], STATE["params"]["w"].T)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"include": r"^parms\."}, r"the include pattern '\^parms\\\\\.' matches no leaf"),
        ({"include": ["^params", "^nope$"]}, r"the include pattern '\^nope\$' matches no leaf"),
        ({"exclude": "^opt_state"}, r"the exclude pattern '\^opt_state' matches no leaf"),
        ({"include": "^opt", "exclude": "^opt"}, "the include and exclude patterns leave no leaf"),
        ({"include": "("}, r"the include pattern '\(' is not a regular expression"),
    ],
)
def test_a_pattern_that_matches_nothing_is_an_error_naming_it(ckpt, tmp_path, options, message):
    with pytest.raises(errors.ConfigError, match=message):
        jaxckpt.export_safetensors(ckpt, tmp_path / "hf", **options)
    assert not (tmp_path / "hf").exists()


def test_cli_include_exclude(ckpt, tmp_path):
    result = cli(
        "export", ckpt, tmp_path / "hf", "--include", "^params", "--include", "^opt",
        "--exclude", "count", "--json",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["skipped"] == ["params.q"]
    assert sorted(exported(tmp_path / "hf")) == ["opt.mu", "params.b", "params.w"]
    # inspect --filter, repeated the same way, previews which leaves those are.
    doc = json.loads(
        cli("inspect", ckpt, "--filter", "^params", "--filter", "^opt", "--json").output
    )
    assert [leaf["name"] for leaf in doc["leaves"]] == [
        "opt.count", "opt.mu", "params.b", "params.q", "params.w"
    ]  # fmt: skip

    result = cli("export", ckpt, tmp_path / "no", "--include", "^parms")
    assert result.exit_code == 1
    assert result.output == (
        "jaxckpt: error: the include pattern '^parms' matches no leaf; leaf names look like "
        "'key', 'opt.count', 'opt.mu' (`jaxckpt inspect DIR` lists them)\n"
    )
    result = cli("export", ckpt, tmp_path / "no", "--exclude", "(")
    assert result.exit_code == 2 and "'(' is not a regular expression" in result.output
    result = cli("export", ckpt, tmp_path / "no", "--format", "orbax", "--include", "^params")
    assert result.exit_code == 2 and "--include: only with --format safetensors" in result.output
    assert not (tmp_path / "no").exists()


def test_the_cli_note_lists_each_skipped_leaf(ckpt, tmp_path):
    proc = run_python("-m", "jaxckpt", "export", str(ckpt), str(tmp_path / "hf"))
    assert proc.stdout.startswith("exported step 1: 4 tensors")
    assert sorted(proc.stderr.splitlines()) == [
        "export: skipping key (a PRNG key; safetensors cannot hold it)",
        "export: skipping params.q (dtype int4; safetensors cannot hold it)",
        "export: skipping wide (dtype complex128; safetensors cannot hold it)",
    ]


def test_live_export_skips_and_selects_too(mesh, tmp_path, caplog):
    live = dict(STATE, params=dict(STATE["params"]))
    live["params"]["w"] = jax.device_put(STATE["params"]["w"], NamedSharding(mesh, P("model")))
    result = jaxckpt.save_safetensors(live, tmp_path / "live", exclude="^opt")
    assert sorted(result.skipped) == ["key", "params.q", "wide"]
    assert sorted(exported(tmp_path / "live")) == ["params.b", "params.w"]
    np.testing.assert_array_equal(exported(tmp_path / "live")["params.w"], STATE["params"]["w"])
    assert "export: skipping params.q (dtype int4" in caplog.text
    with pytest.raises(errors.ConfigError, match="the include pattern 'x' matches no leaf"):
        jaxckpt.save_safetensors(live, tmp_path / "none", include="x")

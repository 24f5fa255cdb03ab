"""Hugging Face safetensors: export proven by transformers, import onto a mesh, the map, errors."""

import json
import os
import struct

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
import torch
import transformers
from etils import epath
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from multihost import one_job_at_a_time

import jaxckpt
from conftest import run_python
from examples.gpt2 import GPT2, GPT2Config, hf_config_json
from jaxckpt import errors
from jaxckpt.hf._names import place

os.environ["HF_HUB_OFFLINE"] = "1"  # everything is local; never reach for a hub
GPT2_MAP = "configs/hf/gpt2.yaml"
CFG = GPT2Config()
TOKENS = np.random.default_rng(0).integers(0, CFG.vocab_size, (2, 16))


def hf_logits(model):
    with torch.no_grad():
        return model(torch.tensor(TOKENS)).logits.numpy()


@pytest.fixture(scope="module")
def gpt2_checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("gpt2") / "ckpt"
    model = GPT2(CFG, nnx.Rngs(0))
    with jaxckpt.CheckpointManager(directory) as m:
        m.save(1, state=nnx.state(model))
    return directory, np.asarray(model(TOKENS))


def test_export_loads_in_transformers_with_the_same_logits(gpt2_checkpoint, tmp_path):
    directory, logits = gpt2_checkpoint
    out = tmp_path / "hf"
    result = jaxckpt.export_safetensors(directory, out, names=GPT2_MAP, max_shard_size="60KB")
    (out / "config.json").write_text(json.dumps(hf_config_json(CFG)))

    assert len(result.files) > 1 and result.tensors == 4 + 12 * CFG.n_layer
    assert result.skipped == ()  # the map drops the dropout RNG state itself
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == sorted(result.files)
    assert result.files[0] == f"model-00001-of-{len(result.files):05d}.safetensors"
    tensors = {}
    for f in result.files:
        in_file = safetensors.numpy.load_file(out / f)
        data = sum(t.nbytes for t in in_file.values())
        assert data <= 60_000 or len(in_file) == 1  # decimal units; a bigger tensor alone
        tensors |= in_file
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in tensors.values())
    assert tensors["transformer.h.0.attn.c_attn.weight"].shape == (64, 192)  # Conv1D (in, out)

    hf = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
    np.testing.assert_allclose(hf_logits(hf), logits, atol=1e-4, rtol=0)


def test_export_casts_and_writes_one_file_when_it_fits(gpt2_checkpoint, tmp_path):
    directory, _ = gpt2_checkpoint
    out = tmp_path / "hf"
    result = jaxckpt.export_safetensors(directory, out, names=GPT2_MAP, dtype="bfloat16")
    assert result.files == ("model.safetensors",)
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
    with safetensors.safe_open(out / "model.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert f.get_tensor("transformer.wte.weight").dtype == torch.bfloat16


def test_cli_export(gpt2_checkpoint, tmp_path):
    directory, _ = gpt2_checkpoint
    out = tmp_path / "hf"
    proc = run_python(
        "-m",
        "jaxckpt",
        "export",
        str(directory),
        str(out),
        "--names",
        GPT2_MAP,
        "--max-shard-size",
        "100KB",
    )
    assert "exported step 1: 28 tensors" in proc.stdout
    assert (out / "model.safetensors.index.json").exists()
    again = run_python("-m", "jaxckpt", "export", str(directory), str(out), check=False)
    assert again.returncode == 1
    assert again.stderr.strip().splitlines() == [
        f"jaxckpt: error: {out} exists and is not empty; choose another OUT or pass --overwrite"
    ]


def test_transformers_checkpoint_loads_onto_a_mesh(mesh, tmp_path):
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(**hf_config_json(CFG))).eval()
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1

    params = nnx.state(nnx.eval_shape(lambda: GPT2(CFG, nnx.Rngs(0))), nnx.Param)

    def spec(x):  # shard the big matrices on "model", replicate the rest
        return P(None, "model") if len(x.shape) == 2 and x.shape[1] % 2 == 0 else P()

    target = jaxckpt.target_on_mesh(params, mesh, jax.tree.map(spec, params))
    loaded = jaxckpt.load_safetensors(tmp_path, target, names=GPT2_MAP)
    kernel = loaded["h"][0]["attn"]["c_attn"]["kernel"].value
    assert kernel.sharding == NamedSharding(mesh, P(None, "model"))
    model = GPT2(CFG, nnx.Rngs(1))
    nnx.update(model, loaded)
    np.testing.assert_allclose(np.asarray(model(TOKENS)), hf_logits(hf), atol=1e-4, rtol=0)


STACKED_MAP = {
    "include": r"^params\.",
    "rules": [
        {
            "match": r"^params\.layers\.up\.kernel$",
            "name": "model.layers.{i}.mlp.up_proj.weight",
            "split": 0,
            "transpose": [1, 0],
        },
        {"match": r"^params\.layers\.norm$", "name": "model.layers.{i}.norm.weight", "split": 0},
        {"match": r"^params\.embed$", "name": "model.embed_tokens.weight"},
        {"match": r"^params\.skip$", "drop": True},
    ],
}


def test_split_stacked_layers_and_transpose_round_trip(mesh, tmp_path):
    rng = np.random.default_rng(1)
    state = {
        "params": {
            "layers": {
                "up": {"kernel": rng.standard_normal((3, 8, 16), np.float32)},
                "norm": np.ones((3, 8), np.float32),
            },
            "embed": rng.standard_normal((32, 8), np.float32),
            "skip": np.zeros(4, np.float32),
        },
        "opt_state": {"mu": np.ones(5, np.float32)},
    }
    with jaxckpt.CheckpointManager(tmp_path / "ckpt") as m:
        m.save(1, state=state)
    result = jaxckpt.export_safetensors(tmp_path / "ckpt", tmp_path / "hf", names=STACKED_MAP)
    tensors = safetensors.numpy.load_file(tmp_path / "hf" / "model.safetensors")
    assert sorted(tensors) == sorted(
        [f"model.layers.{i}.mlp.up_proj.weight" for i in range(3)]
        + [f"model.layers.{i}.norm.weight" for i in range(3)]
        + ["model.embed_tokens.weight"]
    )
    np.testing.assert_array_equal(
        tensors["model.layers.1.mlp.up_proj.weight"], state["params"]["layers"]["up"]["kernel"][1].T
    )
    assert result.tensors == 7

    target = {
        "params": {
            "layers": {
                "up": {
                    "kernel": jax.ShapeDtypeStruct(
                        (3, 8, 16),
                        np.float32,
                        sharding=NamedSharding(mesh, P(None, "data", "model")),
                    )
                },
                "norm": np.zeros((3, 8), np.float32),
            },
            "embed": jax.ShapeDtypeStruct(
                (32, 8), np.float32, sharding=NamedSharding(mesh, P("data"))
            ),
        }
    }
    loaded = jaxckpt.load_safetensors(tmp_path / "hf", target, names=STACKED_MAP)
    np.testing.assert_array_equal(
        np.asarray(loaded["params"]["layers"]["up"]["kernel"]),
        state["params"]["layers"]["up"]["kernel"],
    )
    np.testing.assert_array_equal(
        loaded["params"]["layers"]["norm"], state["params"]["layers"]["norm"]
    )
    np.testing.assert_array_equal(np.asarray(loaded["params"]["embed"]), state["params"]["embed"])


# ---------------------------------------------------------------------------------- bad input


@pytest.fixture
def small_checkpoint(tmp_path):
    state = {
        "a": {"w": np.ones((2, 3), np.float32)},
        "b": {"w": np.zeros(3, np.float32)},
        "key": jax.random.key(0),
    }
    with jaxckpt.CheckpointManager(tmp_path / "ckpt") as m:
        m.save(1, state=state)
    return tmp_path / "ckpt"


def test_two_leaves_on_one_name(small_checkpoint, tmp_path):
    names = {"rules": [{"match": r"\.w$", "name": "weight"}, {"match": "^key", "drop": True}]}
    with pytest.raises(
        errors.NameMapError, match=r"leaves 'a\.w' and 'b\.w' both map to the tensor 'weight'"
    ):
        jaxckpt.export_safetensors(small_checkpoint, tmp_path / "out", names=names)
    assert not (tmp_path / "out").exists()


def test_names_the_map_cannot_place(small_checkpoint, tmp_path):
    names = {"rules": [{"match": r"^a\.w$", "name": "x"}]}
    with pytest.raises(
        errors.NameMapError, match=r"no name-map rule places these leaves: 'b\.w', 'key'"
    ):
        jaxckpt.export_safetensors(small_checkpoint, tmp_path / "out", names=names)


def test_a_transpose_that_does_not_fit_is_refused_by_both_exports(mesh, tmp_path):
    state = {"w": np.ones((4, 6), np.float32)}
    with jaxckpt.CheckpointManager(tmp_path / "ckpt") as m:
        m.save(1, state=state)
    names = {"rules": [{"match": "^w$", "name": "weight", "transpose": [2, 0, 1]}]}
    message = r"transpose \(2, 0, 1\) does not fit leaf 'w' \(tensor shape \(4, 6\)\)"
    with pytest.raises(errors.ConfigError, match=message):
        jaxckpt.export_safetensors(tmp_path / "ckpt", tmp_path / "out", names=names)
    live = {"w": jax.device_put(state["w"], NamedSharding(mesh, P("data", "model")))}
    with pytest.raises(errors.ConfigError, match=message):
        jaxckpt.save_safetensors(live, tmp_path / "live", names=names)
    assert not (tmp_path / "out").exists() and not (tmp_path / "live").exists()


def test_keys_are_skipped_with_a_note_or_refused(small_checkpoint, tmp_path, caplog):
    result = jaxckpt.export_safetensors(small_checkpoint, tmp_path / "out")
    assert result.skipped == ("key",) and result.tensors == 2
    assert "skipping key (a PRNG key" in caplog.text
    with pytest.raises(
        errors.UnsupportedValueError, match=r"cannot be safetensors: 'key' \(a PRNG key\);"
    ):
        jaxckpt.export_safetensors(small_checkpoint, tmp_path / "out2", skip_unsupported=False)


def test_non_string_metadata(small_checkpoint, tmp_path):
    with pytest.raises(
        errors.UnsupportedValueError, match=r"__metadata__ maps strings to strings.*'epoch': 3"
    ):
        jaxckpt.export_safetensors(small_checkpoint, tmp_path / "out", metadata={"epoch": 3})
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.tmp-*"))


def test_existing_output_is_refused_and_untouched_unless_overwrite(small_checkpoint, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(errors.OutputExistsError, match="exists and is not empty"):
        jaxckpt.export_safetensors(small_checkpoint, out)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    jaxckpt.export_safetensors(small_checkpoint, out, overwrite=True)
    assert [p.name for p in out.iterdir()] == ["model.safetensors"]


def test_corrupt_or_truncated_files_on_import(small_checkpoint, tmp_path):
    jaxckpt.export_safetensors(small_checkpoint, tmp_path / "out")
    good = (tmp_path / "out" / "model.safetensors").read_bytes()
    target = {"a": {"w": np.zeros((2, 3), np.float32)}, "b": {"w": np.zeros(3, np.float32)}}
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(good[:-4])
    with pytest.raises(errors.FormatError, match="truncated or corrupt"):
        jaxckpt.load_safetensors(bad, target)
    bad.write_bytes(struct.pack("<Q", 40) + b"{not json" + b" " * 31 + good[48:])
    with pytest.raises(errors.FormatError, match="not valid JSON"):
        jaxckpt.load_safetensors(bad, target)
    bad.write_bytes(struct.pack("<Q", 10**12) + good[8:])
    with pytest.raises(errors.FormatError, match="does not fit the file"):
        jaxckpt.load_safetensors(bad, target)


def test_missing_extra_and_mismatched_tensors_on_import(small_checkpoint, tmp_path):
    jaxckpt.export_safetensors(small_checkpoint, tmp_path / "out")
    path = tmp_path / "out"
    with pytest.raises(
        errors.TreeMismatchError, match=r"missing in the files: c\.w.*\n.*not in the target: b\.w"
    ):
        jaxckpt.load_safetensors(
            path, {"a": {"w": np.zeros((2, 3), np.float32)}, "c": {"w": np.zeros(3, np.float32)}}
        )
    loaded = jaxckpt.load_safetensors(
        path, {"a": {"w": np.zeros((2, 3), np.float32)}}, ignore=r"^b\."
    )
    np.testing.assert_array_equal(loaded["a"]["w"], np.ones((2, 3)))
    with pytest.raises(
        errors.LeafMismatchError, match=r"a\.w: shape \(2, 3\) in the file, \(3, 2\) expected"
    ):
        jaxckpt.load_safetensors(
            path, {"a": {"w": np.zeros((3, 2), np.float32)}, "b": {"w": np.zeros(3, np.float32)}}
        )
    with pytest.raises(
        errors.LeafMismatchError, match=r"a\.w: dtype float32 in the file, int32 in the target"
    ):
        jaxckpt.load_safetensors(
            path, {"a": {"w": np.zeros((2, 3), np.int32)}, "b": {"w": np.zeros(3, np.float32)}}
        )
    with pytest.raises(errors.MissingShardingError, match=r"target leaf a\.w has no sharding"):
        jaxckpt.load_safetensors(
            path,
            {
                "a": {"w": jax.ShapeDtypeStruct((2, 3), np.float32)},
                "b": {"w": np.zeros(3, np.float32)},
            },
        )


def test_llama_map_round_trips_through_a_stacked_tree(mesh, tmp_path):
    # transformers' Llama -> load onto a scanned (stacked-layer) JAX tree with the shipped map
    # -> save with jaxckpt -> export with the same map -> transformers: the same logits.
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).eval()
    hf.save_pretrained(tmp_path / "hf", max_shard_size="20KB")

    L, d, f, v, kv = 3, 32, 64, 128, 2 * 8

    def leaf(*shape, spec=None):
        sharding = NamedSharding(mesh, spec or P())
        return jax.ShapeDtypeStruct(shape, np.float32, sharding=sharding)

    def value(x):
        return {"value": x}

    target = {
        "embed": {"embedding": value(leaf(v, d, spec=P("model")))},
        "layers": {
            "attn": {
                "q_proj": {"kernel": value(leaf(L, d, d, spec=P(None, None, "model")))},
                "k_proj": {"kernel": value(leaf(L, d, kv))},
                "v_proj": {"kernel": value(leaf(L, d, kv))},
                "o_proj": {"kernel": value(leaf(L, d, d, spec=P(None, "model")))},
            },
            "mlp": {
                "gate_proj": {"kernel": value(leaf(L, d, f, spec=P(None, "data", "model")))},
                "up_proj": {"kernel": value(leaf(L, d, f))},
                "down_proj": {"kernel": value(leaf(L, f, d))},
            },
            "input_norm": {"scale": value(leaf(L, d))},
            "post_attention_norm": {"scale": value(leaf(L, d))},
        },
        "norm": {"scale": value(leaf(d))},
        "lm_head": {"kernel": value(leaf(d, v, spec=P(None, "model")))},
    }
    llama_map = "configs/hf/llama.yaml"
    state = jaxckpt.load_safetensors(tmp_path / "hf", target, names=llama_map)
    up = hf.model.layers[2].mlp.up_proj.weight.detach().numpy()
    np.testing.assert_array_equal(
        np.asarray(state["layers"]["mlp"]["up_proj"]["kernel"]["value"][2]), up.T
    )

    with jaxckpt.CheckpointManager(tmp_path / "ckpt") as m:
        m.save(7, state=state)
    jaxckpt.export_safetensors(
        tmp_path / "ckpt", tmp_path / "out", names=llama_map, max_shard_size="30KB"
    )
    (tmp_path / "out" / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
    again = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out").eval()
    np.testing.assert_array_equal(hf_logits(again), hf_logits(hf))


# --------------------------------------------------------------------------- MaxText Llama 2

MAXTEXT_MAP = "configs/hf/maxtext-llama.yaml"
# Llama 2's head_dim (the map's scale is its square root), in a tiny model; GQA (2 heads, 1
# kv head) as in Llama-2-70b.
MAXTEXT_CFG = dict(
    vocab_size=128,
    hidden_size=256,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=128,
    max_position_embeddings=32,
    tie_word_embeddings=False,
)


def maxtext_from_hf(hf: dict[str, np.ndarray], config) -> dict:
    """HF Llama weights in MaxText's layout, as MaxText converts them:
    AI-Hypercomputer/maxtext (e591f30) src/maxtext/checkpoint_conversion/standalone_scripts/
    llama_or_mistral_ckpt.py, `_convert_huggingface_to_jax_weights` for a llama2 model: HF
    names renamed at 281-300 (up_proj is its "w2", down_proj its "w3"), no RoPE permutation
    (764-766: llama3.1 only). One difference: it casts to bfloat16 (CAST_DTYPE, 197); here
    float32 stays, so the comparison can be exact."""
    L, H, K = config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads
    D = config.head_dim
    E = H * D  # the script's `base_num_query_heads * head_dim`

    def layers(name, f):  # stacked (L, ...), as the script fills `stack_shape + w.shape`
        return np.stack([f(hf[f"model.layers.{i}.{name}.weight"]) for i in range(L)])

    attention = {  # 756-805: (out, in).T reshaped, layers moved to axis 1
        "query": layers("self_attn.q_proj", lambda w: w.T.reshape(E, H, D)),
        "key": layers("self_attn.k_proj", lambda w: w.T.reshape(E, K, D)),
        "value": layers("self_attn.v_proj", lambda w: w.T.reshape(E, K, D)),
    }
    attention = {k: {"kernel": v.transpose(1, 0, 2, 3)} for k, v in attention.items()}
    out = layers("self_attn.o_proj", lambda w: w.reshape(E, H, D))  # 768-770: not transposed
    attention["out"] = {"kernel": out.transpose(2, 0, 3, 1)}  # 803-805: (H, L, D, E)
    query = attention["query"]["kernel"]  # 807-810: the query scaled by 1/sqrt(head_dim)
    attention["query"]["kernel"] = query / np.sqrt(D).astype(query.dtype)
    mlp = {  # 877-905, 1036-1038
        "wi_0": layers("mlp.gate_proj", np.transpose),
        "wi_1": layers("mlp.up_proj", np.transpose),
        "wo": layers("mlp.down_proj", np.transpose),
    }
    return {
        "decoder": {
            "layers": {
                "self_attention": attention,
                "mlp": {k: {"kernel": v.transpose(1, 0, 2)} for k, v in mlp.items()},
                # 829-856: (L, d) -> (d, L)
                "pre_self_attention_layer_norm": {"scale": layers("input_layernorm", np.copy).T},
                "post_self_attention_layer_norm": {
                    "scale": layers("post_attention_layernorm", np.copy).T
                },
            },
            "decoder_norm": {"scale": hf["model.norm.weight"]},  # 715
            "logits_dense": {"kernel": hf["lm_head.weight"].T},  # 723-725
        },
        "token_embedder": {"embedding": hf["model.embed_tokens.weight"]},  # 737-739
    }


# Sharded as a MaxText run might be, and so that shards cut inside merged axes (head_dim under
# heads): the reads and live writes of those tensors are made of several blocks.
MAXTEXT_SPECS = {
    "query": P("data", None, None, "model"),
    "key": P(None, None, None, "model"),
    "value": P("data", None, None, None),
    "out": P(None, None, "model", "data"),
}


def maxtext_spec(path, x):
    name = jax.tree_util.keystr(path)
    for key, spec in MAXTEXT_SPECS.items():
        if f"'{key}'" in name:
            return spec
    return P("data") if x.shape[0] % 4 == 0 else P()


@pytest.fixture(scope="module")
def tiny_llama():
    """A random tiny Llama: (model, its weights as NumPy, its config)."""
    config = transformers.LlamaConfig(**MAXTEXT_CFG)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).eval()
    return hf, {k: v.detach().numpy() for k, v in hf.state_dict().items()}, config


def test_maxtext_checkpoint_exports_to_llama_with_the_same_logits(tiny_llama, mesh, tmp_path):
    # HF weights -> MaxText's layout (as its conversion script does) on the mesh -> saved by
    # plain Orbax as MaxText saves -> exported with the shipped map -> LlamaForCausalLM.
    import optax
    import orbax.checkpoint as ocp

    hf, weights, config = tiny_llama
    params = jax.tree_util.tree_map_with_path(
        lambda p, x: jax.device_put(x, NamedSharding(mesh, maxtext_spec(p, x))),
        maxtext_from_hf(weights, config),
    )
    state = {
        "params": {"params": params},
        "opt_state": optax.adam(1e-3).init({"params": params}),
        "step": 0,
    }
    with ocp.CheckpointManager(tmp_path / "ckpt", item_names=("items",)) as m:
        m.save(0, args=ocp.args.Composite(items=ocp.args.PyTreeSave(state)))

    out = tmp_path / "out"
    result = jaxckpt.export_safetensors(
        tmp_path / "ckpt", out, names=MAXTEXT_MAP, max_shard_size="600KB"
    )
    assert len(result.files) > 1 and result.tensors == len(weights)  # no opt_state, no step
    tensors = {}
    for f in result.files:
        tensors |= safetensors.numpy.load_file(out / f)
    assert sorted(tensors) == sorted(weights)
    for name, value in weights.items():
        if ".q_proj." in name:
            # The conversion divided by sqrt(128) in float32, the export multiplies by it in
            # float64: each rounding is exact to half an ulp, the two together to one ulp.
            np.testing.assert_array_max_ulp(tensors[name], value, maxulp=1)
        else:
            np.testing.assert_array_equal(tensors[name], value, err_msg=name)
    (out / "config.json").write_text(config.to_json_string())
    again = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    # Not bitwise only through the query weights' last bits (above); every other weight is.
    np.testing.assert_allclose(hf_logits(again), hf_logits(hf), rtol=0, atol=2e-6)

    # The live export of the same sharded tree writes the same tensors, block by block.
    live = jaxckpt.save_safetensors(state, tmp_path / "live", names=MAXTEXT_MAP)
    got = safetensors.numpy.load_file(tmp_path / "live" / "model.safetensors")
    assert live.tensors == len(weights) and sorted(got) == sorted(tensors)
    for name, value in tensors.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)


def test_llama_loads_onto_a_maxtext_tree_on_a_mesh(tiny_llama, mesh, tmp_path):
    hf, weights, config = tiny_llama
    hf.save_pretrained(tmp_path / "hf", max_shard_size="300KB")
    expected = {"params": {"params": maxtext_from_hf(weights, config)}}
    target = jax.tree_util.tree_map_with_path(
        lambda p, x: jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=NamedSharding(mesh, maxtext_spec(p, x))
        ),
        expected,
    )
    loaded = jaxckpt.load_safetensors(tmp_path / "hf", target, names=MAXTEXT_MAP)
    query = loaded["params"]["params"]["decoder"]["layers"]["self_attention"]["query"]["kernel"]
    assert query.sharding == NamedSharding(mesh, MAXTEXT_SPECS["query"])

    def check(path, got, want):
        got = np.asarray(got)
        if "'query'" in jax.tree_util.keystr(path):  # divided in float32 there, float64 here
            np.testing.assert_array_max_ulp(got, want, maxulp=1)
        else:
            np.testing.assert_array_equal(got, want, err_msg=jax.tree_util.keystr(path))

    jax.tree_util.tree_map_with_path(check, loaded, expected)
    # On the host too (NumPy leaves: the whole tensor in one read).
    on_host = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), expected)
    host = jaxckpt.load_safetensors(tmp_path / "hf", on_host, names=MAXTEXT_MAP)
    jax.tree.map(np.testing.assert_array_equal, host, jax.device_get(loaded))


# ------------------------------------------------------------------------ reshape and scale


@pytest.mark.parametrize(
    ("reshape", "message"),
    [
        ("0, [1, 2]", r"reshape lists the file tensor's axes.*got '0, \[1, 2\]'"),
        ([], r"reshape lists .*got \[\]"),
        ([0, []], r"reshape lists .*got \[0, \[\]\]"),
        ([0, -1], r"reshape lists .*got \[0, -1\]"),
        ([[0, True]], r"reshape lists .*got \[\[0, True\]\]"),
    ],
)
def test_a_malformed_reshape_is_refused_when_the_map_loads(reshape, message):
    rule = {"match": "^w$", "name": "weight", "reshape": reshape}
    with pytest.raises(errors.ConfigError, match=rf"name-map rule 0: {message}"):
        jaxckpt.NameMap.load({"rules": [rule]})


@pytest.mark.parametrize("scale", [0, "2", True, float("inf")])
def test_a_bad_scale_is_refused_when_the_map_loads(scale):
    rule = {"match": "^w$", "name": "weight", "scale": scale}
    with pytest.raises(errors.ConfigError, match=r"rule 0: scale must be a finite non-zero"):
        jaxckpt.NameMap.load({"rules": [rule]})


def test_a_drop_rule_needs_no_name_whatever_else_it_says_and_a_rule_is_a_mapping():
    """A drop rule with a split (no name: it goes nowhere) was a KeyError: 'name'; a rule
    that is not a mapping is named as such."""
    names = jaxckpt.NameMap.load({"rules": [{"match": "^opt\\.", "drop": True, "split": 0}]})
    assert place(names, "opt.mu", (2, 3)) is None
    with pytest.raises(errors.ConfigError, match=r"rule 0 \('matchx'\) needs 'match'"):
        jaxckpt.NameMap.load({"rules": ["matchx"]})


def test_a_name_map_file_may_be_any_path_like(small_checkpoint, tmp_path):
    # names= takes an os.PathLike, as the signatures say: an epath or a caller's own path
    # type too, not only str and pathlib.Path (mypy found these refused as "not a mapping").
    class OwnPath:
        def __fspath__(self):
            return str(tmp_path / "map.yaml")

    (tmp_path / "map.yaml").write_text("rules:\n  - match: '^a\\.w$'\n    name: weight\n")
    for i, names in enumerate([epath.Path(tmp_path / "map.yaml"), OwnPath()]):
        result = jaxckpt.export_safetensors(
            small_checkpoint, tmp_path / f"out{i}", names=names, include=r"^a\."
        )
        assert result.tensors == 1
        assert list(safetensors.numpy.load_file(result.out_dir / "model.safetensors")) == ["weight"]


@pytest.mark.parametrize(
    ("rule", "error", "message"),
    [
        (
            {"reshape": [0, [2, 1]]},
            errors.NameMapError,
            r"reshape \[0, \[2, 1\]\] does not fit leaf 'w' \(tensor shape \(4, 2, 3\)\): it "
            r"must take each axis 0\.\.2 once, in order",
        ),
        ({"reshape": [[0, 1]]}, errors.NameMapError, r"reshape \[\[0, 1\]\] does not fit leaf 'w'"),
        (  # after the split, axes 0..1 are left
            {"split": 0, "name": "w.{i}", "reshape": [0, 1, 2]},
            errors.NameMapError,
            r"reshape \[0, 1, 2\] does not fit leaf 'w' \(tensor shape \(2, 3\)\)",
        ),
        (  # the permutation is over the reshaped axes
            {"reshape": [0, [1, 2]], "transpose": [2, 0, 1]},
            errors.ConfigError,
            r"transpose \(2, 0, 1\) does not fit leaf 'w' \(tensor shape \(4, 6\)\)",
        ),
        (
            {"match": "^n$", "scale": 2.0},
            errors.NameMapError,
            r"leaf 'n' is int32: only floating-point leaves can be scaled",
        ),
    ],
)
def test_a_reshape_or_scale_that_does_not_fit_is_refused_everywhere(
    mesh, tmp_path, rule, error, message
):
    state = {"w": np.ones((4, 2, 3), np.float32), "n": np.arange(3, dtype=np.int32)}
    with jaxckpt.CheckpointManager(tmp_path / "ckpt") as m:
        m.save(1, state=state)
    names = {"rules": [{"match": "^w$", "name": "weight"} | rule, {"match": ".", "drop": True}]}
    with pytest.raises(error, match=message):
        jaxckpt.export_safetensors(tmp_path / "ckpt", tmp_path / "out", names=names)
    live = {k: jax.device_put(v, NamedSharding(mesh, P())) for k, v in state.items()}
    with pytest.raises(error, match=message):
        jaxckpt.save_safetensors(live, tmp_path / "live", names=names)
    safetensors.numpy.save_file({"weight": np.ones(1, np.float32)}, tmp_path / "x.safetensors")
    placed = "n" if rule.get("match") == "^n$" else "w"  # a target of the other is dropped
    with pytest.raises(error, match=message):
        jaxckpt.load_safetensors(tmp_path / "x.safetensors", {placed: state[placed]}, names=names)
    assert not (tmp_path / "out").exists() and not (tmp_path / "live").exists()


def test_reshape_round_trips_whatever_the_shards_cut(mesh, tmp_path):
    """Merged axes cut by shards in every way (inside the inner axis, across both, along the
    outer one): the file is the reshaped leaf, and import puts back the leaf."""
    x = np.arange(8 * 8 * 6, dtype=np.float32).reshape(8, 8, 6)
    names = {"rules": [{"match": "^w$", "name": "w", "reshape": [[0, 1], 2]}]}
    want = x.reshape(64, 6)
    for spec in (P(None, "data", "model"), P("model", "data"), P(None, ("data", "model")), P()):
        sharding = NamedSharding(mesh, spec)
        out = tmp_path / str(spec).replace(" ", "")
        jaxckpt.save_safetensors({"w": jax.device_put(x, sharding)}, out, names=names)
        np.testing.assert_array_equal(
            safetensors.numpy.load_file(out / "model.safetensors")["w"], want
        )
        target = {"w": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)}
        loaded = jaxckpt.load_safetensors(out, target, names=names)
        np.testing.assert_array_equal(np.asarray(loaded["w"]), x)


@one_job_at_a_time
def test_live_sharded_state_written_by_each_process_without_gathering(tmp_path):
    from children import live_export
    from multihost import run_job

    out = tmp_path / "hf"
    results = run_job(live_export.save_sharded, processes=2, devices=4, args={"out": str(out)})
    files = results[0].report()["files"]
    assert len(files) > 1 and results[1].report()["files"] == files
    tensors = {}
    for f in files:
        tensors |= safetensors.numpy.load_file(out / f)
    rng = np.random.default_rng(0)
    w = rng.standard_normal((8, 6), dtype=np.float32)
    s = rng.standard_normal((3, 4, 6), dtype=np.float32)
    for name in ("w", "col", "rep"):
        np.testing.assert_array_equal(tensors[name], w)
    np.testing.assert_array_equal(tensors["n"], np.arange(3))
    for i in range(3):
        np.testing.assert_array_equal(tensors[f"layers.{i}.w"], s[i].T)
    h = rng.standard_normal((2, 8, 3), dtype=np.float32)
    np.testing.assert_array_equal(tensors["heads"], h.reshape(16, 3).T)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in tensors.values())
    assert not list(tmp_path.glob(".hf.tmp-*"))


def test_live_export_of_a_sharded_model_loads_in_transformers(mesh, tmp_path):
    model = GPT2(CFG, nnx.Rngs(3))
    state = nnx.state(model)
    sharded = jax.tree.map(
        lambda x: jax.device_put(x, NamedSharding(mesh, P(None, "model") if x.ndim == 2 else P())),
        state,
    )
    result = jaxckpt.save_safetensors(sharded, tmp_path, names=GPT2_MAP, max_shard_size="80KB")
    assert result.step is None and len(result.files) > 1
    (tmp_path / "config.json").write_text(json.dumps(hf_config_json(CFG)))
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    np.testing.assert_allclose(hf_logits(hf), np.asarray(model(TOKENS)), atol=1e-4, rtol=0)


@pytest.mark.parametrize("short_rows", [64, 100_000])
def test_live_export_of_column_sharded_rows_short_and_long(mesh, tmp_path, short_rows):
    """Rows split across devices along the last axis: short row segments are copied side by
    side in blocks (one block; or, for 37 MiB of them, several, the last one partial), long
    ones written from the shards' own memory; both give the bytes safetensors reads back."""
    from jaxckpt.hf._format import COPY_BLOCK_BYTES

    rng = np.random.default_rng(1)
    host = {
        "short": rng.standard_normal((short_rows, 96), np.float32),  # 192-byte row segments
        "long": rng.standard_normal((4, 2, 2 * 2**15), np.float32),  # 128 KiB segments
        "bf16": rng.standard_normal((24, 40)).astype(jax.numpy.bfloat16),
    }
    blocks = host["short"].nbytes / COPY_BLOCK_BYTES
    assert blocks < 1 if short_rows == 64 else 2 < blocks < 3
    specs = {
        "short": P("data", "model") if short_rows == 64 else P(None, "model"),  # rows: one run
        "long": P(None, None, "model"),
        "bf16": P(None, "model"),
    }
    state = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in host.items()}
    result = jaxckpt.save_safetensors(state, tmp_path / "out")
    (name,) = result.files
    got = safetensors.numpy.load_file(tmp_path / "out" / name)
    for key, value in host.items():
        assert got[key].dtype == value.dtype and got[key].shape == value.shape
        assert got[key].tobytes() == value.tobytes(), key


@pytest.mark.parametrize(
    ("damage", "problem"),
    [("truncate", "truncated"), ("flip", "checksum mismatch")],
)
def test_export_refuses_a_corrupt_step(small_checkpoint, tmp_path, damage, problem):
    """Truncated (the read fails) or one flipped byte (the read succeeds): never shipped."""
    from reliability.faults import largest_data_file

    f = largest_data_file(small_checkpoint / "1")
    data = bytearray(f.read_bytes())
    if damage == "truncate":
        del data[-1]
    else:
        data[len(data) // 2] ^= 0x01
    f.write_bytes(bytes(data))
    with pytest.raises(
        errors.CorruptCheckpointError, match=rf"step 1 .* is corrupt: (state|packed)/.*{problem}"
    ):
        jaxckpt.export_safetensors(small_checkpoint, tmp_path / "out")
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # no output, no temporary


@pytest.mark.parametrize(
    ("shape", "cuts"),
    [
        (
            (6, 2, 10),
            [(slice(2, 5), slice(0, 2), slice(a, b)) for a, b in [(0, 3), (3, 4), (4, 10)]],
        ),
        ((10,), [(slice(a, b),) for a, b in [(0, 5), (5, 10)]]),
        ((3000, 4), [(slice(0, 3000), slice(a, a + 1)) for a in range(4)]),  # > IOV_MAX rows
        ((4, 8), [(slice(1, 3), slice(0, 8))]),  # whole rows: one buffer
    ],
    ids=["3d-last-axis", "1d", "many-rows", "whole-rows"],
)
def test_write_rows_gathers_side_by_side_pieces(tmp_path, shape, cuts):
    from jaxckpt.hf import _format as st

    full = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    path = tmp_path / "t.bin"
    path.write_bytes(b"\0" * (16 + full.nbytes))
    fd = os.open(path, os.O_WRONLY)
    try:
        assert st.write_rows(fd, 16, shape, [(c, np.ascontiguousarray(full[c])) for c in cuts])
    finally:
        os.close(fd)
    got = np.frombuffer(path.read_bytes()[16:], np.float32).reshape(shape)
    rows = cuts[0][:-1]
    np.testing.assert_array_equal(got[rows], full[rows])
    outside = np.ones(shape, bool)
    outside[rows] = False
    assert not got[outside].any()  # nothing written elsewhere


def test_write_rows_refuses_what_is_not_a_block_of_whole_rows(tmp_path):
    from jaxckpt.hf import _format as st

    full = np.arange(48, dtype=np.float32).reshape(4, 3, 4)
    fd = os.open(tmp_path / "t.bin", os.O_WRONLY | os.O_CREAT)
    try:
        middle = (slice(0, 4), slice(0, 2), slice(0, 4))  # split on a middle axis
        assert not st.write_rows(fd, 0, full.shape, [(middle, full[middle])])
        half = (slice(0, 4), slice(0, 3), slice(0, 2))  # does not span the last axis
        assert not st.write_rows(fd, 0, full.shape, [(half, full[half])])
        strided = (slice(0, 4), slice(0, 3), slice(0, 4))
        assert not st.write_rows(fd, 0, full.shape, [(strided, np.asfortranarray(full))])
    finally:
        os.close(fd)
    assert (tmp_path / "t.bin").stat().st_size == 0


def test_live_export_splits_a_host_leaf_into_layers(tmp_path):
    """A NumPy leaf (not a jax.Array) under a split rule: each layer is its own tensor. It
    failed with a TypeError (its pieces had no concrete bounds to number the layers by)."""
    stacked = np.arange(24, dtype=np.float32).reshape(3, 2, 4)
    names = {"rules": [{"match": r"^w$", "name": "layer.{i}.weight", "split": 0}]}
    result = jaxckpt.save_safetensors({"w": stacked}, tmp_path / "out", names=names)
    assert result.tensors == 3
    got = safetensors.numpy.load_file(tmp_path / "out" / "model.safetensors")
    for i in range(3):
        np.testing.assert_array_equal(got[f"layer.{i}.weight"], stacked[i])


ZERO_SIZE = {"z0": (0,), "z1": (8, 0), "z2": (0, 8)}


def test_zero_size_leaves_go_through_both_safetensors_exports(mesh, tmp_path):
    # Before: the live export raised OSError "pwritev wrote nothing" for (0,) and (8, 0),
    # ValueError "cannot reshape" for (0, 8)
    sharding = NamedSharding(mesh, P("data", "model"))
    state = {
        "w": jax.device_put(np.arange(64, dtype=np.float32).reshape(8, 8), sharding),
        **{
            k: jax.device_put(np.zeros(s, np.float32), NamedSharding(mesh, P()))
            for k, s in ZERO_SIZE.items()
        },
        "z3": jax.device_put(np.zeros((0, 8), np.float32), sharding),  # sharded, no elements
    }
    with jaxckpt.CheckpointManager(tmp_path / "ckpt") as m:
        m.save(1, state=state)
    jaxckpt.hf.save_safetensors(state, tmp_path / "live")
    jaxckpt.export_safetensors(tmp_path / "ckpt", tmp_path / "step")
    for out in ("live", "step"):
        got = safetensors.numpy.load_file(tmp_path / out / "model.safetensors")  # upstream
        assert {k: v.shape for k, v in got.items()} == {k: np.shape(v) for k, v in state.items()}
        assert got["w"].tobytes() == np.asarray(state["w"]).tobytes()
        with safetensors.safe_open(tmp_path / out / "model.safetensors", "pt") as f:
            assert f.get_tensor("z2").shape == torch.Size([0, 8])


def test_a_failed_live_export_leaves_nothing_behind(tmp_path):
    # Before: `.out.tmp-live` stayed beside the output
    gone = jnp.ones((8,))
    gone.delete()  # its copy to the host fails once the files are made
    with pytest.raises(RuntimeError, match="deleted"):
        jaxckpt.save_safetensors({"w": jnp.ones((4, 4)), "gone": gone}, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []

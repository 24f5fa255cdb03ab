"""A GPT-2 in Flax NNX, laid out like Hugging Face's GPT2LMHeadModel.

Its tree maps onto the HF tensor names with `configs/hf/gpt2.yaml`: kernels are (in, out)
like HF's Conv1D weights (no transpose), the LM head is tied to the token embedding. Every
parameter is annotated with logical axis names ("vocab", "embed", "qkv", "heads", "mlp");
`RULES` (or a config's `rules:`) maps them onto mesh axes, e.g. with
`jaxckpt.target_from_flax(abstract_state, mesh, RULES)`.

    model = GPT2(GPT2Config(), rngs=nnx.Rngs(0))
    logits = model(tokens)                          # (batch, seq, vocab)
    hf_config_json(GPT2Config())                    # config.json for transformers
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

# Tensor parallelism over a "model" mesh axis: attention heads and the MLP's hidden units
# are split, embeddings and norms replicated.
RULES = (("vocab", None), ("embed", None), ("qkv", "model"), ("heads", "model"), ("mlp", "model"))


@dataclasses.dataclass(frozen=True)
class GPT2Config:
    vocab_size: int = 128
    n_positions: int = 32
    n_embd: int = 64
    n_layer: int = 2
    n_head: int = 4
    dropout: float = 0.0
    layer_norm_epsilon: float = 1e-5


def hf_config_json(cfg: GPT2Config) -> dict:
    """The transformers GPT2Config for the same architecture."""
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": cfg.vocab_size,
        "n_positions": cfg.n_positions,
        "n_embd": cfg.n_embd,
        "n_layer": cfg.n_layer,
        "n_head": cfg.n_head,
        "n_inner": None,
        "activation_function": "gelu_new",
        "resid_pdrop": cfg.dropout,
        "embd_pdrop": cfg.dropout,
        "attn_pdrop": cfg.dropout,
        "layer_norm_epsilon": cfg.layer_norm_epsilon,
        "tie_word_embeddings": True,
        "bos_token_id": cfg.vocab_size - 1,
        "eos_token_id": cfg.vocab_size - 1,
    }


def linear(n_in: int, n_out: int, axes: tuple[str, str], rngs: nnx.Rngs) -> nnx.Linear:
    """A Linear whose kernel is annotated with logical `axes` (its bias with the last)."""
    return nnx.Linear(
        n_in,
        n_out,
        kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), axes),
        bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), axes[1:]),
        rngs=rngs,
    )


def layer_norm(cfg: GPT2Config, rngs: nnx.Rngs) -> nnx.LayerNorm:
    return nnx.LayerNorm(
        cfg.n_embd,
        epsilon=cfg.layer_norm_epsilon,
        scale_init=nnx.with_partitioning(nnx.initializers.ones_init(), ("embed",)),
        bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), ("embed",)),
        rngs=rngs,
    )


class Attention(nnx.Module):
    def __init__(self, cfg: GPT2Config, rngs: nnx.Rngs):
        self.n_head = cfg.n_head
        self.c_attn = linear(cfg.n_embd, 3 * cfg.n_embd, ("embed", "qkv"), rngs)
        self.c_proj = linear(cfg.n_embd, cfg.n_embd, ("heads", "embed"), rngs)
        self.drop = nnx.Dropout(cfg.dropout, rngs=rngs)

    def __call__(self, x):
        b, t, d = x.shape
        q, k, v = jnp.split(self.c_attn(x), 3, axis=-1)
        q, k, v = (a.reshape(b, t, self.n_head, d // self.n_head) for a in (q, k, v))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(d // self.n_head).astype(x.dtype)
        causal = jnp.tril(jnp.ones((t, t), bool))
        scores = jnp.where(causal, scores, jnp.finfo(x.dtype).min)
        out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v).reshape(b, t, d)
        return self.drop(self.c_proj(out))


class Mlp(nnx.Module):
    def __init__(self, cfg: GPT2Config, rngs: nnx.Rngs):
        self.c_fc = linear(cfg.n_embd, 4 * cfg.n_embd, ("embed", "mlp"), rngs)
        self.c_proj = linear(4 * cfg.n_embd, cfg.n_embd, ("mlp", "embed"), rngs)
        self.drop = nnx.Dropout(cfg.dropout, rngs=rngs)

    def __call__(self, x):
        return self.drop(self.c_proj(jax.nn.gelu(self.c_fc(x), approximate=True)))  # gelu_new


class Block(nnx.Module):
    def __init__(self, cfg: GPT2Config, rngs: nnx.Rngs):
        self.ln_1 = layer_norm(cfg, rngs)
        self.attn = Attention(cfg, rngs)
        self.ln_2 = layer_norm(cfg, rngs)
        self.mlp = Mlp(cfg, rngs)

    def __call__(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2(nnx.Module):
    def __init__(self, cfg: GPT2Config, rngs: nnx.Rngs):
        # The annotations are metadata only, so the model can be built anywhere; the caller
        # places the state with RULES (see examples/train.py).
        with nnx.use_eager_sharding(False):
            self._build(cfg, rngs)

    def _build(self, cfg: GPT2Config, rngs: nnx.Rngs):
        normal = nnx.initializers.normal(0.02)
        self.wte = nnx.Embed(
            cfg.vocab_size,
            cfg.n_embd,
            embedding_init=nnx.with_partitioning(normal, ("vocab", "embed")),
            rngs=rngs,
        )
        self.wpe = nnx.Embed(
            cfg.n_positions,
            cfg.n_embd,
            embedding_init=nnx.with_partitioning(normal, (None, "embed")),
            rngs=rngs,
        )
        self.drop = nnx.Dropout(cfg.dropout, rngs=rngs)
        self.h = nnx.List([Block(cfg, rngs) for _ in range(cfg.n_layer)])
        self.ln_f = layer_norm(cfg, rngs)

    def __call__(self, tokens):
        x = self.drop(self.wte(tokens) + self.wpe(jnp.arange(tokens.shape[-1])))
        for block in self.h:
            x = block(x)
        return self.wte.attend(self.ln_f(x))  # the LM head is tied to the embedding

"""Export a trained example model to Hugging Face safetensors and load it in transformers.

    python examples/export_hf.py --ckpt-dir runs/demo/ckpt --out runs/demo/hf

1. `jaxckpt.export_safetensors` writes the step's model (not its optimizer state) as
   sharded safetensors, named by `configs/hf/gpt2.yaml`; `config.json` comes from the
   training config. The step is verified against its checksums first.
2. The same step is restored into the NNX model (only its "model" part: `partial=True`),
   here onto a single device, whatever mesh it was trained on.
3. transformers' `GPT2LMHeadModel.from_pretrained` loads the files; both models score the
   same tokens and the logits must agree.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import jax

if __name__ == "__main__":  # before any device is touched
    jax.config.update("jax_platforms", "cpu")

import numpy as np
from flax import nnx

import jaxckpt

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from examples.gpt2 import GPT2, hf_config_json  # noqa: E402
from examples.train import Config  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt-dir", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--step", type=int, help="default: the latest committed step")
    parser.add_argument("--names", type=Path, default=REPO / "configs" / "hf" / "gpt2.yaml")
    args = parser.parse_args(argv)

    result = jaxckpt.export_safetensors(
        args.ckpt_dir, args.out, step=args.step, names=args.names, overwrite=True
    )
    with jaxckpt.CheckpointManager(args.ckpt_dir, read_only=True) as mngr:
        saved = mngr.meta(result.step)["config"]  # the run's config, saved with every step
        cfg = Config(**{k: tuple(v) if isinstance(v, list) else v for k, v in saved.items()})
        (args.out / "config.json").write_text(json.dumps(hf_config_json(cfg.model()), indent=1))
        print(
            f"exported step {result.step}: {result.tensors} tensors, {result.total_size:,} "
            f"bytes in {len(result.files)} file(s) to {result.out_dir}"
        )

        # The model part of the step, onto one device: the target decides the layout.
        abstract = nnx.eval_shape(lambda: GPT2(cfg.model(), nnx.Rngs(0)))
        one_device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        target = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one_device),
            nnx.state(abstract),
        )
        restored = mngr.restore(result.step, state={"model": target}, partial=True)
    model = nnx.merge(nnx.graphdef(abstract), restored.state["model"])
    model.eval()  # no dropout
    tokens = np.random.default_rng(0).integers(0, cfg.vocab, (2, cfg.seq_len))
    jax_logits = np.asarray(model(tokens))

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local files only
    import torch
    import transformers

    hf = transformers.GPT2LMHeadModel.from_pretrained(args.out).eval()
    with torch.no_grad():
        hf_logits = hf(torch.tensor(tokens)).logits.numpy()
    diff = float(np.max(np.abs(hf_logits - jax_logits)))
    print(f"transformers GPT2LMHeadModel vs the JAX model: max |logit difference| {diff:.2e}")
    summary = {"step": result.step, "files": len(result.files), "max_logit_diff": diff}
    print("RESULT " + json.dumps(summary))
    return 0 if diff < 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())

"""Save a training state on one mesh, restore it onto others, with logical-axis rules.

    python examples/reshard.py [--ckpt-dir /tmp/reshard]

The example GPT-2's parameters carry logical axis names ("embed", "mlp", "heads", ...);
logical-axis rules map those names onto the axes of a mesh. The state is saved from a
(data=4, model=2) mesh with tensor-parallel rules, then restored:

* onto (data=2, model=4): the same rules, another mesh shape;
* onto (data=8,): other rules, everything replicated (pure data parallelism);
* onto one device.

`jaxckpt.target_from_flax(abstract_state, mesh, rules)` builds each target; `plan` says what
each restore reads before it runs; every restored value equals the saved one.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import jax

if __name__ == "__main__":  # before any device is touched
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", 8)

import numpy as np

import jaxckpt

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from examples.train import (
    Config,
    abstract_state,
    create_train_state,
    make_mesh,
    state_of,
)

DATA_PARALLEL = tuple((name, None) for name, _ in Config.rules)  # every logical axis replicated


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt-dir", type=Path, help="default: a temporary directory")
    args = parser.parse_args(argv)
    ckpt_dir = args.ckpt_dir or Path(tempfile.mkdtemp(prefix="jaxckpt-reshard-")) / "ckpt"

    cfg = Config()
    model, optimizer, _ = create_train_state(cfg, make_mesh((4, 2)))
    saved = state_of(model, optimizer)
    with jaxckpt.CheckpointManager(ckpt_dir) as mngr:
        mngr.save(1, state=saved)
    print(f"saved a GPT-2 train state from mesh (data=4, model=2) to {ckpt_dir}")

    # What a new job builds: the abstract state (no memory), placed by rules on its mesh.
    abstract = abstract_state(cfg)
    kernel = "model.h.0.mlp.c_fc.kernel.value"
    targets = {
        "(data=2, model=4), tensor-parallel rules": (make_mesh((2, 4)), cfg.rules),
        "(data=8,), everything replicated": (
            jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,)),
            DATA_PARALLEL,
        ),
        "one device": (jax.make_mesh((1,), ("data",), devices=jax.devices()[:1]), DATA_PARALLEL),
    }
    ok = True
    with jaxckpt.CheckpointManager(ckpt_dir, read_only=True) as mngr:
        for name, (mesh, rules) in targets.items():
            target = jaxckpt.target_from_flax(abstract, mesh, rules)
            plan = mngr.plan(state=target)
            restored = mngr.restore(state=target).state
            got, want = _by_name(restored), _by_name(saved)
            equal = got.keys() == want.keys() and all(np.array_equal(got[n], want[n]) for n in want)
            ok &= equal
            leaf = _leaves(restored)[kernel]
            print(f"\nonto {name}:")
            print(
                f"  {kernel}: {leaf.sharding.spec}, shards {leaf.addressable_shards[0].data.shape}"
            )
            print(f"  every leaf equal to the saved one: {equal}")
            print("  " + str(plan).replace("\n", "\n  "))
    return 0 if ok else 1


def _leaves(tree) -> dict:
    return {jaxckpt.leaf_name(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _by_name(tree) -> dict[str, np.ndarray]:
    """{leaf name: host value}, PRNG keys as their key data."""
    return {
        name: np.asarray(
            jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x
        )
        for name, x in _leaves(tree).items()
    }


if __name__ == "__main__":
    sys.exit(main())

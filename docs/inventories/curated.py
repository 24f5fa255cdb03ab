"""Writes the inventories of the JAX, NumPy, Flax and Orbax objects jaxckpt's reference links.

The docs build offline (`make docs` inside `make test`, where nothing beyond the package
registries can be reached), so mkdocstrings reads its inventories from this folder, not
from the projects' sites. `python.inv` is Python's own (3.11, as Debian's python3.11-doc
ships it). The sites of JAX, NumPy, Flax and Orbax publish theirs only online; each
`<project>.inv` here lists just the objects the reference names, at the address its site
gives them, and is written by this script (`python docs/inventories/curated.py`).
`tests/test_docs.py` checks that every entry is one the built site links.
"""

from __future__ import annotations

from pathlib import Path

from mkdocstrings import Inventory

HERE = Path(__file__).parent

# project: (version, base address, [(name, role, page and anchor; "$" is the name)])
PROJECTS = {
    "jax": (
        "latest",
        "https://docs.jax.dev/en/latest/",
        [
            ("jax.Array", "class", "_autosummary/jax.Array.html#$"),
            ("jax.ShapeDtypeStruct", "class", "_autosummary/jax.ShapeDtypeStruct.html#$"),
            ("jax.eval_shape", "function", "_autosummary/jax.eval_shape.html#$"),
            ("jax.set_mesh", "class", "_autosummary/jax.set_mesh.html#$"),
            ("jax.random.key", "function", "_autosummary/jax.random.key.html#$"),
            ("jax.tree_util", "module", "jax.tree_util.html#module-$"),
            (
                "jax.distributed.initialize",
                "function",
                "_autosummary/jax.distributed.initialize.html#$",
            ),
            ("jax.sharding.Mesh", "class", "jax.sharding.html#$"),
            ("jax.sharding.NamedSharding", "class", "jax.sharding.html#$"),
            ("jax.sharding.PartitionSpec", "class", "jax.sharding.html#$"),
        ],
    ),
    "numpy": (
        "stable",
        "https://numpy.org/doc/stable/",
        [("numpy.ndarray", "class", "reference/generated/numpy.ndarray.html#$")],
    ),
    "flax": (
        "latest",
        "https://flax.readthedocs.io/en/latest/",
        [
            ("flax.nnx.eval_shape", "function", "api_reference/flax.nnx/transforms.html#$"),
            ("flax.nnx.with_partitioning", "function", "api_reference/flax.nnx/spmd.html#$"),
            (
                "flax.nnx.Optimizer",
                "class",
                "api_reference/flax.nnx/training/optimizer.html#flax.nnx.optimizer.Optimizer",
            ),
        ],
    ),
    "orbax": (
        "latest",
        "https://orbax.readthedocs.io/en/latest/",
        [
            (
                "orbax.checkpoint.StandardCheckpointer",
                "class",
                "api_reference/checkpoint.checkpointers.html#$",
            ),
            (
                "orbax.checkpoint.CheckpointManager",
                "class",
                "api_reference/checkpoint.checkpoint_manager.html#$",
            ),
        ],
    ),
}


def inventory(project: str) -> Inventory:
    version, _, entries = PROJECTS[project]
    found = Inventory(project=project, version=version)
    for name, role, uri in entries:
        found.register(name, "py", role, uri)
    return found


def main() -> None:
    for project in PROJECTS:
        (HERE / f"{project}.inv").write_bytes(inventory(project).format_sphinx())


if __name__ == "__main__":
    main()

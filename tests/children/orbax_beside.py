"""A user's own plain Orbax saves and restores (local disk, gs://, s3://), run twice in one
process: before jaxckpt is imported, then beside open jaxckpt managers of other directories
(their wraps of Orbax's functions installed, their directories held). Prints one JSON
document, {"before": ..., "beside": ...}: for each store what the save wrote (its files,
the arrays' zarr3 metadata, their bytes) and what the restore read, or the error it raised;
tests/test_beside_orbax.py compares the two.

    python -m children.orbax_beside LOCAL_DIR GS_PREFIX S3_PREFIX
"""

import hashlib
import json
import os
import re
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import fsspec
import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


def state() -> dict:
    axes = (jax.sharding.AxisType.Auto,) * 2
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=axes)
    w = np.arange(1024 * 512, dtype=np.float32).reshape(1024, 512)  # 2 MiB
    return {
        "w": jax.device_put(w, NamedSharding(mesh, P("data", "model"))),
        "b": jax.device_put(np.ones(4, np.int32), NamedSharding(mesh, P())),
    }


def plain(directory: str) -> dict:
    """A plain Orbax save of step 1 at `directory` and its restore onto the same shardings:
    the files written (OCDBT's data files by folder: their names are random), each array's
    zarr3 metadata and bytes as tensorstore reads them, what the restore gave back; or the
    type and message of the error the save or restore raised."""
    saved = state()
    target = jax.tree.map(ocp.utils.to_shape_dtype_struct, saved)
    try:
        with ocp.CheckpointManager(directory) as m:
            m.save(1, args=ocp.args.StandardSave(saved))
            m.wait_until_finished()
            restored = m.restore(1, args=ocp.args.StandardRestore(target))
    except Exception as e:  # what Orbax says of a store it does not know (s3://)
        said = str(e).splitlines()[0][:300].replace(directory.split("://")[-1], "DIR")
        return {"error": f"{type(e).__name__}: {said}"}
    step = f"{directory.rstrip('/')}/1"
    fs, root = fsspec.core.url_to_fs(step)
    files = sorted(
        {re.sub(r"/d/[^/]+$", "/d/*", name[len(root.rstrip("/")) + 1 :]) for name in fs.find(root)}
    )
    arrays = {}
    for name in saved:
        base = step if "://" in step else f"file://{step}"
        kvstore = f"{base}/default/|ocdbt:{name}/"
        try:  # Orbax's default: zarr (v2); jaxckpt's: zarr3
            t = ts.open({"driver": "zarr", "kvstore": kvstore}, open=True).result()
        except ValueError:
            t = ts.open({"driver": "zarr3", "kvstore": kvstore}, open=True).result()
        arrays[name] = {
            "metadata": t.spec().to_json()["metadata"],
            "bytes": hashlib.sha256(np.asarray(t.read().result()).tobytes()).hexdigest(),
        }
    back = {
        name: {
            "bytes": hashlib.sha256(np.asarray(value).tobytes()).hexdigest(),
            "sharding": repr(value.sharding),
        }
        for name, value in restored.items()
    }
    return {"files": files, "arrays": arrays, "restored": back}


def main() -> None:
    local, gs, s3 = sys.argv[1:4]
    places = {"local": local, "gs": gs, "s3": s3}
    before = {store: plain(f"{url}/before") for store, url in places.items()}
    import jaxckpt

    managers = []
    try:
        for url in places.values():  # Orbax arrays (incremental=False): every wrap at work
            m = jaxckpt.CheckpointManager(f"{url}/jaxckpt", incremental=False)
            managers.append(m)
            m.save(1, state=state())
            m.wait()
            m.restore(state=state())
        beside = {store: plain(f"{url}/beside") for store, url in places.items()}
    finally:
        for m in managers:
            m.close()
    print(json.dumps({"before": before, "beside": beside}))


if __name__ == "__main__":
    main()

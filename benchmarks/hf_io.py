"""Export to and import from safetensors, side by side with the safetensors library.

State: LEAVES float32 leaves of 64 MiB (default 8 = 512 MiB), saved once with jaxckpt from a
(4, 2) mesh of 8 CPU devices. Each measurement runs in a fresh process, contenders
alternating, `--repeat` times; medians are reported with min-max.

* export: `jaxckpt.export_safetensors(ckpt, out)` (reads the checkpoint tensor by tensor)
  vs `safetensors.numpy.save_file(arrays already in memory)` + fsync;
* import onto 8 devices, (4, 2) mesh, P("data", "model"): `jaxckpt.load_safetensors`
  vs `safetensors.numpy.load_file` + `jax.device_put` per tensor.

Peak RSS is measured above the baseline each process had just before the timed call.

    python benchmarks/hf_io.py [--leaves 8] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

SHAPE = (4096, 4096)

WORKER = textwrap.dedent(
    """
    import json, os, resource, sys, time
    import jax
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", 8)
    import numpy as np
    import safetensors.numpy
    from jax.sharding import NamedSharding, PartitionSpec as P
    import jaxckpt

    mode, work, leaves = sys.argv[1], sys.argv[2], int(sys.argv[3])
    shape = {shape}
    auto = (jax.sharding.AxisType.Auto,) * 2
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=auto)
    sharding = NamedSharding(mesh, P("data", "model"))
    names = [f"w{{i}}" for i in range(leaves)]

    def rss():
        return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def arrays():
        rng = np.random.default_rng(0)
        return {{n: rng.standard_normal(shape, dtype=np.float32) for n in names}}

    if mode == "setup":
        with jaxckpt.CheckpointManager(os.path.join(work, "ckpt")) as m:
            m.save(1, state={{n: jax.device_put(a, sharding) for n, a in arrays().items()}})
        jaxckpt.export_safetensors(os.path.join(work, "ckpt"), os.path.join(work, "hf"))
        print("RESULT {{}}")
        sys.exit(0)

    out = os.path.join(work, "out-" + mode)
    if mode == "st_save":
        data = arrays()
    base = rss()
    t0 = time.perf_counter()
    if mode == "jx_export":
        jaxckpt.export_safetensors(os.path.join(work, "ckpt"), out, overwrite=True)
    elif mode == "st_save":
        os.makedirs(out, exist_ok=True)
        path = os.path.join(out, "model.safetensors")
        safetensors.numpy.save_file(data, path, metadata={{"format": "pt"}})
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    elif mode == "jx_import":
        target = {{n: jax.ShapeDtypeStruct(shape, np.float32, sharding=sharding) for n in names}}
        jax.block_until_ready(jaxckpt.load_safetensors(os.path.join(work, "hf"), target))
    elif mode == "st_import":
        loaded = safetensors.numpy.load_file(os.path.join(work, "hf", "model.safetensors"))
        jax.block_until_ready({{n: jax.device_put(a, sharding) for n, a in loaded.items()}})
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print("RESULT " + json.dumps({{"seconds": seconds, "peak_above": peak - base}}))
    """
).format(shape=SHAPE)


def run(mode: str, work: Path, leaves: int) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", WORKER, mode, str(work), str(leaves)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{mode} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][7:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--leaves", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "hf_io.md")
    args = parser.parse_args()
    state_bytes = args.leaves * SHAPE[0] * SHAPE[1] * 4

    work = Path(tempfile.mkdtemp(prefix="jaxckpt-hf-bench-"))
    try:
        run("setup", work, args.leaves)
        modes = ["jx_export", "st_save", "jx_import", "st_import"]
        results: dict[str, list[dict]] = {m: [] for m in modes}
        for _ in range(args.repeat):  # alternate contenders within each round
            for mode in modes:
                results[mode].append(run(mode, work, args.leaves))
    finally:
        shutil.rmtree(work, ignore_errors=True)

    def med(mode, key):
        return statistics.median(r[key] for r in results[mode])

    def spread(mode):
        values = [r["seconds"] for r in results[mode]]
        return f"{min(values):.2f}-{max(values):.2f}"

    gbps = {m: state_bytes / med(m, "seconds") / 1e9 for m in results}
    labels = {
        "jx_export": "jaxckpt.export_safetensors (from the checkpoint)",
        "st_save": "safetensors.numpy.save_file + fsync (arrays in memory)",
        "jx_import": "jaxckpt.load_safetensors onto 8 devices",
        "st_import": "safetensors.numpy.load_file + jax.device_put",
    }
    lines = [
        f"# safetensors export/import: {state_bytes / 2**30:.2f} GiB of float32 ({args.leaves} x 64 MiB)",
        "",
        f"Medians of {args.repeat} fresh-process runs, contenders alternating; "
        f"`python benchmarks/hf_io.py --leaves {args.leaves} --repeat {args.repeat}`; "
        f"{os.cpu_count()} CPUs, 8 CPU devices. Peak RSS is above the process's baseline.",
        "",
        "| operation | median s | min-max s | GB/s | peak RSS above baseline |",
        "| --- | --- | --- | --- | --- |",
    ]
    for mode in results:
        lines.append(
            f"| {labels[mode]} | {med(mode, 'seconds'):.2f} | {spread(mode)} | {gbps[mode]:.2f} | "
            f"{med(mode, 'peak_above') / state_bytes:.2f}x the state |"
        )
    lines += [
        "",
        f"Ratios: export / save_file throughput = {gbps['jx_export'] / gbps['st_save']:.2f}; "
        f"import / (load_file + device_put) throughput = {gbps['jx_import'] / gbps['st_import']:.2f}.",
    ]
    text = "\n".join(lines) + "\n"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

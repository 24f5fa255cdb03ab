"""Pod scale, counted rather than timed (issue 28): storage traffic per process as the
process count grows, jaxckpt against plain Orbax in the same harness.

N = 1, 2, 4, 8 real processes (`jax.distributed` on 127.0.0.1, gloo, 2 CPU devices each)
save `--mib` MiB of incompressible float32 (3/4 in 8 MiB leaves, 1/4 in 1 MiB ones) on a mesh
of all 2N devices, in three layouts:

* replicated: `P()` over a `(2N,)` mesh, every process holds the whole state (pure data
  parallelism, or the slice axis of a multi-slice job);
* fsdp: `P("data")` over the same mesh, every process holds 1/N;
* mixed: a `(N, 2)` data x model mesh, `P(None, "model")`: sharded inside a process,
  replicated across processes.

Each process counts its bytes read and written (`/proc/self/io` rchar / wchar: every byte
through read(2)/write(2), from the page cache or not) around `save` + `wait`, and around a
restore in a new manager onto the same mesh (jaxckpt: verified); the step folder's files
and bytes are counted after the save. Writes `benchmarks/results/scale.md` and
`benchmarks/results/scale.png`.

    python benchmarks/scale.py [--processes 1 2 4 8] [--mib 64]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.scale_worker import DEVICES, measure
from benchmarks.tables import table
from tests.multihost import run_job

OUT = Path(__file__).resolve().parent / "results"
LAYOUTS = ("replicated", "fsdp", "mixed")
CONTENDERS = ("jaxckpt", "orbax")


def run(contender: str, layout: str, processes: int, mib: int, root: Path) -> dict:
    """One job: every process's counts, and the step folder's files and bytes."""
    directory = root / f"{contender}-{layout}-{processes}"
    spec = {"contender": contender, "layout": layout, "mib": mib, "directory": str(directory)}
    jobs = run_job(measure, processes=processes, devices=DEVICES, args=spec, timeout=600)
    reports = [r.report() for r in jobs]
    sizes = [f.stat().st_size for f in (directory / "1").rglob("*") if f.is_file()]
    shutil.rmtree(directory)
    return {"processes": reports, "files": len(sizes), "bytes": sum(sizes)}


def summary(job: dict) -> dict:
    """The ratios to the state's bytes: restore reads of all processes, the busiest
    writer's writes, process 0's writes and reads against the busiest other process."""
    ps = job["processes"]
    size = ps[0]["state_bytes"]
    writes = [p["save"]["wchar"] for p in ps]
    return {
        "restore_reads": sum(p["restore"]["rchar"] for p in ps) / size,
        "restore_reads_max": max(p["restore"]["rchar"] for p in ps) / size,
        "save_writes": sum(writes) / size,
        "busiest_writer": max(writes) / size,
        "save_reads": sum(p["save"]["rchar"] for p in ps) / size,
        "save_reads_p0": ps[0]["save"]["rchar"] / size,
        "read_calls": sum(p["restore"]["syscr"] for p in ps),
        "write_calls": sum(p["save"]["syscw"] for p in ps),
        "files": job["files"],
        "stored": job["bytes"] / size,
        "bitwise": all(p["bitwise"] for p in ps),
        "save_s": max(p["save"]["seconds"] for p in ps),
        "restore_s": max(p["restore"]["seconds"] for p in ps),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS))
    parser.add_argument("--contenders", nargs="+", default=list(CONTENDERS))
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory(prefix="jaxckpt-scale-") as root:
        for layout in args.layouts:
            for n in args.processes:
                for contender in args.contenders:
                    s = summary(run(contender, layout, n, args.mib, Path(root)))
                    results[(layout, n, contender)] = s
                    print(layout, n, contender, json.dumps(s), flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "scale.json").write_text(
        json.dumps(
            [
                {"layout": k[0], "processes": k[1], "contender": k[2], **v}
                for k, v in results.items()
            ],
            indent=1,
        )
    )
    write(results, args)


def write(results: dict, args) -> None:
    rows = []
    for (layout, n, contender), s in results.items():
        rows.append(
            [
                layout,
                str(n),
                contender,
                f"{s['restore_reads']:.2f}x",
                f"{s['restore_reads_max']:.2f}x",
                f"{s['busiest_writer']:.2f}x ({s['busiest_writer'] * n:.2f}/N)",
                f"{s['save_writes']:.2f}x",
                f"{s['save_reads']:.2f}x ({s['save_reads_p0']:.2f}x p0)",
                str(s["files"]),
                "yes" if s["bitwise"] else "**no**",
                f"{s['save_s']:.2f} / {s['restore_s']:.2f}",
            ]
        )
    header = [
        "layout",
        "N",
        "contender",
        "restore reads, all",
        "busiest reader",
        "busiest writer",
        "save writes, all",
        "save reads, all",
        "files",
        "bitwise",
        "save / restore s",
    ]
    text = "\n".join(
        [
            "# Pod scale: storage traffic against the process count",
            "",
            f"`python benchmarks/scale.py --processes {' '.join(map(str, args.processes))} --mib {args.mib}`:"
            " bytes through read(2)/write(2) of every process (`/proc/self/io`), as multiples of"
            " the state's bytes; restores onto the same mesh, in a new manager, verified.",
            "",
            *table(header, rows),
        ]
    )
    (OUT / "scale.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()

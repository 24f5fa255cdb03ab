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
and bytes are counted after the save, the metadata apart (every file but the arrays' data
files and the packed leaves' bytes). Writes `benchmarks/results/scale.md` (the table and a
model of how each count grows to 256 and 1,024 hosts) and `scale.png` beside BENCHMARKS.md
(the counts against N).

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

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "results"
PNG = ROOT / "scale.png"
LAYOUTS = ("replicated", "fsdp", "mixed")
CONTENDERS = ("jaxckpt", "orbax")


def run(contender: str, layout: str, processes: int, mib: int, root: Path) -> dict:
    """One job: every process's counts, and the step folder's files and bytes."""
    directory = root / f"{contender}-{layout}-{processes}"
    spec = {"contender": contender, "layout": layout, "mib": mib, "directory": str(directory)}
    jobs = run_job(measure, processes=processes, devices=DEVICES, args=spec, timeout=600)
    reports = [r.report() for r in jobs]
    files = {f: f.stat().st_size for f in (directory / "1").rglob("*") if f.is_file()}
    meta = [n for f, n in files.items() if f.parent.name != "d" and f.suffix != ".bin"]
    shutil.rmtree(directory)
    return {
        "processes": reports,
        "files": len(files),
        "bytes": sum(files.values()),
        "meta_files": len(meta),
        "meta_bytes": sum(meta),
    }


def summary(job: dict) -> dict:
    """The ratios to the state's bytes: restore reads of all processes, the busiest
    writer's writes, process 0's writes and reads against the busiest other process."""
    ps = job["processes"]
    size = ps[0]["state_bytes"]
    writes = [p["save"]["wchar"] for p in ps]
    return {
        "restore_reads": sum(p["restore"]["rchar"] for p in ps) / size,
        "restore_reads_max": max(p["restore"]["rchar"] for p in ps) / size,
        # a restore writes no file: what it writes goes to the collectives' sockets
        "restore_sent_max": max(p["restore"]["wchar"] for p in ps) / size,
        "save_writes": sum(writes) / size,
        "busiest_writer": max(writes) / size,
        "save_reads": sum(p["save"]["rchar"] for p in ps) / size,
        "save_reads_p0": ps[0]["save"]["rchar"] / size,
        "read_calls": sum(p["restore"]["syscr"] for p in ps),
        "write_calls": sum(p["save"]["syscw"] for p in ps),
        "files": job["files"],
        "meta_files": job["meta_files"],
        "meta_bytes": job["meta_bytes"],
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
                f"{s['restore_sent_max']:.2f}x",
                f"{s['busiest_writer']:.2f}x ({s['busiest_writer'] * n:.2f}/N)",
                f"{s['save_writes']:.2f}x",
                f"{s['save_reads']:.2f}x ({s['save_reads_p0']:.2f}x p0)",
                f"{s['read_calls']:,} / {s['write_calls']:,}",
                f"{s['files']} ({s['meta_files']} metadata, {s['meta_bytes'] / 1024:.0f} KiB)",
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
        "restore: busiest sender over the collectives",
        "busiest writer",
        "save writes, all",
        "save reads, all",
        "read(2) calls of the restore / write(2) calls of the save, all",
        "files per step",
        "bitwise",
        "save / restore s",
    ]
    command = f"python benchmarks/scale.py --processes {' '.join(map(str, args.processes))}"
    text = "\n".join(
        [
            "# Pod scale: storage traffic against the process count",
            "",
            f"`{command} --mib {args.mib}` (issue 28): N real processes (jax.distributed, gloo,"
            f" 127.0.0.1, {DEVICES} CPU devices each) save and restore {args.mib} MiB of"
            " incompressible float32 (3/4 in 8 MiB leaves, 1/4 in 1 MiB ones). Bytes through"
            " read(2)/write(2) of every process (`/proc/self/io`; the collectives receive with"
            " recv(2), which it does not count), as multiples of the state's bytes; restores"
            " onto the same mesh, in a new manager, verified (jaxckpt). Layouts: replicated"
            " `P()` on a `(2N,)` mesh; fsdp `P('data')`; mixed `P(None, 'model')` on an"
            " `(N, 2)` data x model mesh. Targets: restore reads <= 1.1x, busiest writer"
            f" <= 1.25/N. Plot: [{PNG.name}](../../{PNG.name}).",
            "",
            *table(header, rows),
            *model(results),
        ]
    )
    (OUT / "scale.md").write_text(text)
    plot(results, PNG)
    print(text)


def _fit(points: list[tuple[int, float]], n: int) -> float:
    """A count's straight line through its measured (N, count) points, at N = n."""
    xs, ys = zip(*points, strict=True)
    if len(set(xs)) < 2:
        return ys[-1]
    slope = (ys[-1] - ys[0]) / (xs[-1] - xs[0])
    return ys[0] + slope * (n - xs[0])


def model(results: dict) -> list[str]:
    """How jaxckpt's counts grow to 256 and 1,024 hosts: measured, and a line through the
    measured points where a count grows with N."""
    mine = {k: v for k, v in results.items() if k[2] == "jaxckpt"}
    if not mine:
        return []
    layout = "replicated" if any(k[0] == "replicated" for k in mine) else next(iter(mine))[0]
    points = sorted((k[1], v) for k, v in mine.items() if k[0] == layout)
    biggest = points[-1][1]
    files = [(n, v["files"]) for n, v in points]
    meta = [(n, v["meta_bytes"] / 2**10) for n, v in points]
    reads = max(v["restore_reads"] for _, v in points)
    p0 = max(v["save_reads_p0"] * n for n, v in points)
    at = (256, 1024)
    rows = [
        [
            "storage reads of a restore, whole job",
            "O(state): each byte read once in the job (`_spread`)",
            f"{reads:.2f}x at most, measured",
            "the floor",
        ],
        [
            "busiest writer of a save",
            "O(state / N): each replicated shard written by one holder, in slices",
            f"{biggest['busiest_writer'] * points[-1][0]:.2f}/N at N = {points[-1][0]}",
            "yes",
        ],
        [
            "bytes a process sends over the collectives at a restore",
            "O(state held): an all-gather brings each process the (N-1)/N of its replicated"
            " bytes that others read; the network carries what storage no longer does",
            f"{biggest['restore_sent_max']:.2f}x of the state at N = {points[-1][0]}",
            "yes: ICI/DCN, within the restore budget per batch",
        ],
        [
            "collectives of a restore",
            "O(read batches), not N: one agreement per stage, one all-gather per batch"
            " (within the restore budget)",
            "the same at any N",
            "yes",
        ],
        [
            "files per step",
            "O(N): each process's OCDBT folder and packed file pair, written by itself",
            " / ".join(f"{_fit(files, n):,.0f}" for n in at),
            "yes: listed once per restore by each process (O(N) each)",
        ],
        [
            "metadata bytes per step (KiB)",
            "O(N): per-process indexes and OCDBT manifests; every process reads the"
            " indexes at restore, O(N) each, O(N^2) in the job",
            " / ".join(f"{_fit(meta, n):,.0f}" for n in at),
            "yes while a process's share stays below its data share (at 1,024 hosts the"
            " job reads that many KiB 1,024 times)",
        ],
        [
            "process 0's reads at a save",
            "O(state / N): each process hashes the files it wrote for the manifest,"
            " process 0 also the step's metadata",
            f"{p0:.2f}/N at most",
            "yes: the job reads each step once more (the files just written: the page"
            " cache on local disk, a GET of one's own objects on object storage), 1/N"
            " of it on each host",
        ],
    ]
    return [
        f"## How the counts grow (jaxckpt, {layout}; 256 / 1,024 hosts extrapolated)",
        "",
        *table(["count", "grows as", "at 256 / 1,024 hosts", "acceptable"], rows),
    ]


def plot(results: dict, out: Path) -> None:
    """Restore reads (whole job) and the busiest writer (times N) against N, per layout."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layouts = sorted({k[0] for k in results}, key=LAYOUTS.index)
    fig, axes = plt.subplots(1, len(layouts), figsize=(5 * len(layouts), 4), squeeze=False)
    for ax, layout in zip(axes[0], layouts, strict=True):
        for contender, style in (("jaxckpt", "-"), ("orbax", "--")):
            got = sorted((k[1], v) for k, v in results.items() if k[::2] == (layout, contender))
            if not got:
                continue
            ns = [n for n, _ in got]
            ax.plot(
                ns,
                [v["restore_reads"] for _, v in got],
                "o" + style,
                label=f"{contender}: restore reads",
            )
            ax.plot(
                ns,
                [v["busiest_writer"] * n for n, v in got],
                "s" + style,
                label=f"{contender}: busiest writer x N",
            )
        ax.axhline(1.1, color="grey", lw=0.8, ls=":")
        ax.axhline(1.25, color="grey", lw=0.8, ls="-.")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("processes N")
        ax.set_ylabel("multiple of the state's bytes")
        ax.set_title(layout)
        ax.legend(fontsize=7)
    fig.suptitle("Storage traffic against the process count (targets: 1.1x reads, 1.25 writer x N)")
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)


if __name__ == "__main__":
    main()

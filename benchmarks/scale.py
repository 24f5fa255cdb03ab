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
files and the packed leaves' bytes). In a bucket (gs://: fake-gcs-server, jaxckpt and plain
Orbax; s3://: moto's S3 server, jaxckpt alone: Orbax writes no s3://) the job's requests are
counted from the server's log instead. Writes `benchmarks/results/scale.md` (the table and a
model of how each count grows to 256 and 1,024 hosts) and `scale.png` beside BENCHMARKS.md
(the counts against N).

    python benchmarks/scale.py [--processes 1 2 4 8] [--mib 64]
    python benchmarks/scale.py --replot     # the figure again, from the last run's JSON
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # (children.job)
from benchmarks.figures import foreground, save_light_and_dark
from benchmarks.scale_worker import DEVICES, measure
from benchmarks.tables import table
from reliability import gcs, s3
from tests.multihost import run_job

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "results"
PNG = ROOT / "scale.png"
LAYOUTS = ("replicated", "fsdp", "mixed")
CONTENDERS = ("jaxckpt", "orbax")
SERVERS = {"gs": gcs, "s3": s3}  # fake-gcs-server, moto's S3 server


def run(
    contender: str, layout: str, processes: int, mib: int, root: Path, store: str = "local"
) -> dict:
    """One job: every process's counts, and the step folder's files and bytes (on local
    disk; in a bucket, `store` "gs" or "s3", its requests as its server logged them)."""
    name = f"{contender}-{layout}-{processes}"
    directory = root / name
    spec = {"contender": contender, "layout": layout, "mib": mib, "directory": str(directory)}
    if store != "local":
        spec |= {
            "directory": f"{store}://{SERVERS[store].BUCKET}/{name}",
            "store": store,
            "requests_log": str(root / f"{store}.log"),
        }
    if contender == "local":
        spec["local_root"] = str(root / f"{name}-local")
    jobs = run_job(measure, processes=processes, devices=DEVICES, args=spec, timeout=600)
    reports = [r.report() for r in jobs]
    shutil.rmtree(root / f"{name}-local", ignore_errors=True)
    if store != "local" or contender == "local":
        return {"processes": reports}
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


def _calls(process: dict, phase: str) -> tuple[int, int, int]:
    """A process's collectives (all-gathers, broadcasts), barriers (JAX's
    `sync_global_devices` and the coordination service's) and other coordination-service
    calls (key-value, preemption sync point) in a phase."""
    calls = process[phase]["calls"]
    collectives = calls.get("process_allgather", 0) + calls.get("broadcast_one_to_all", 0)
    barriers = calls.get("sync_global_devices", 0) + calls.get("wait_at_barrier", 0)
    return collectives, barriers, sum(calls.values()) - collectives - barriers


def _most_calls(ps: list[dict], phase: str) -> list[int]:
    """The most collectives, barriers and coordination calls of any process in a phase."""
    return [max(c) for c in zip(*(_calls(p, phase) for p in ps), strict=True)]


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
        "bitwise": all(p["restore"]["bitwise"] for p in ps),
        "save_s": max(p["save"]["seconds"] for p in ps),
        "restore_s": max(p["restore"]["seconds"] for p in ps),
        "save_calls": _most_calls(ps, "save"),
        "restore_calls": _most_calls(ps, "restore"),
    }


def bucket_summary(job: dict) -> dict:
    """A job on object storage: its requests by kind at the save and at the restore (the
    server's log, the whole job), its calls."""
    ps = job["processes"]
    save, restore = (ps[0][phase]["requests"] for phase in ("save", "restore"))
    return {
        "save_requests": {k: save.get(k, 0) for k in gcs.REQUEST_KINDS},
        "restore_requests": {k: restore.get(k, 0) for k in gcs.REQUEST_KINDS},
        "bitwise": all(p["restore"]["bitwise"] for p in ps),
        "save_calls": _most_calls(ps, "save"),
        "restore_calls": _most_calls(ps, "restore"),
    }


def local_summary(job: dict) -> dict:
    """A local-tier job, per process (the busiest): its own part and the copy of a peer's
    it keeps, its bytes read and written at the save (its part, the copy it sends, the copy
    it receives) and at the two restores (all parts there; process 0's folder lost, its
    part sent by the peer that keeps it), against the state's bytes."""
    ps = job["processes"]
    size = ps[0]["state_bytes"]
    phases = ["restore"] + (["restore_lost"] if "restore_lost" in ps[0] else [])

    def most(key, phase=None):
        return max((p[phase][key] if phase else p[key]) for p in ps) / size

    return {
        "own_part": most("own_part"),
        "copy_kept": most("copy_kept"),
        "save_writes_max": most("wchar", "save"),
        "save_reads_max": most("rchar", "save"),
        "restore_reads_max": most("rchar", "restore"),
        "lost_reads_max": most("rchar", "restore_lost") if "restore_lost" in ps[0] else None,
        "tiers": sorted({p[phase]["tier"] for p in ps for phase in phases}),
        "bitwise": all(p[phase]["bitwise"] for p in ps for phase in phases),
        "save_calls": _most_calls(ps, "save"),
        "restore_calls": _most_calls(ps, "restore"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS))
    parser.add_argument("--contenders", nargs="+", default=list(CONTENDERS))
    parser.add_argument("--gcs-layouts", nargs="*", default=["replicated", "fsdp"])
    # jaxckpt only: plain Orbax writes no s3:// (google/orbax#359)
    parser.add_argument("--s3-layouts", nargs="*", default=["replicated", "fsdp"])
    parser.add_argument("--local-layouts", nargs="*", default=["replicated", "fsdp"])
    parser.add_argument(
        "--replot", action="store_true", help="redraw the figure from the last run's JSON"
    )
    args = parser.parse_args()
    if args.replot:
        rows = json.loads((OUT / "scale.json").read_text())
        keys = ("storage", "layout", "processes", "contender")
        plot({tuple(r[k] for k in keys): r for r in rows}, PNG)
        return
    jobs = [
        ("local", layout, contender) for layout in args.layouts for contender in args.contenders
    ]
    jobs += [
        ("gs", layout, contender) for layout in args.gcs_layouts for contender in args.contenders
    ]
    jobs += [("s3", layout, "jaxckpt") for layout in args.s3_layouts]
    jobs += [("local", layout, "local") for layout in args.local_layouts]
    results = {}
    with tempfile.TemporaryDirectory(prefix="jaxckpt-scale-") as root:
        servers = []
        try:
            for store, server in SERVERS.items():  # each logs a line per request
                os.environ.update(server.LOOPBACK_ENV)
                options = {"log_level": "info"} if server is gcs else {}
                proc, url = server.start(Path(root) / f"{store}.log", **options)
                servers.append((server, proc))
                os.environ.update(server.point_at(url))
            for storage, layout, contender in jobs:
                for n in args.processes:
                    job = run(contender, layout, n, args.mib, Path(root), storage)
                    if storage in SERVERS:
                        s = bucket_summary(job)
                    else:
                        s = (local_summary if contender == "local" else summary)(job)
                    results[(storage, layout, n, contender)] = s
                    print(storage, layout, n, contender, json.dumps(s), flush=True)
        finally:
            for server, proc in servers:
                server.stop(proc)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "scale.json").write_text(
        json.dumps(
            [
                {"storage": k[0], "layout": k[1], "processes": k[2], "contender": k[3], **v}
                for k, v in results.items()
            ],
            indent=1,
        )
    )
    write(results, args)


def _calls_text(calls: list[int]) -> str:
    return " / ".join(map(str, calls))


def write(results: dict, args) -> None:
    persistent = {k[1:]: v for k, v in results.items() if k[0] == "local" and k[3] != "local"}
    rows = []
    for (layout, n, contender), s in persistent.items():
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
    calls = [
        [layout, str(n), contender, _calls_text(s["save_calls"]), _calls_text(s["restore_calls"])]
        for (layout, n, contender), s in persistent.items()
    ]
    on_buckets = []
    for (storage, layout, n, contender), s in results.items():
        if storage in SERVERS:
            save, restore = s["save_requests"], s["restore_requests"]
            on_buckets.append(
                [f"{storage}://", layout, str(n), contender]
                + [f"{save[k]:,} / {restore[k]:,}" for k in gcs.REQUEST_KINDS]
                + [f"{sum(save.values()) / n:.0f} / {sum(restore.values()) / n:.0f}"]
                + ["yes" if s["bitwise"] else "**no**"]
            )
    local = []
    for (_, layout, n, contender), s in results.items():
        if contender == "local":
            lost = s["lost_reads_max"]
            local.append(
                [
                    layout,
                    str(n),
                    f"{s['own_part']:.2f}x / {s['copy_kept']:.2f}x",
                    f"{s['save_writes_max']:.2f}x / {s['save_reads_max']:.2f}x",
                    f"{s['restore_reads_max']:.2f}x",
                    "-" if lost is None else f"{lost:.2f}x",
                    ", ".join(s["tiers"]),
                    _calls_text(s["save_calls"]) + " ; " + _calls_text(s["restore_calls"]),
                    "yes" if s["bitwise"] else "**no**",
                ]
            )
    command = (
        f"python benchmarks/scale.py --processes {' '.join(map(str, args.processes))}"
        f" --mib {args.mib}"
    )
    text = "\n".join(
        [
            "# Pod scale: storage traffic against the process count",
            "",
            f"`{command}`: N real processes (jax.distributed, gloo,"
            f" 127.0.0.1, {DEVICES} CPU devices each) save and restore {args.mib} MiB of"
            " incompressible float32 (3/4 in 8 MiB leaves, 1/4 in 1 MiB ones). Bytes through"
            " read(2)/write(2) of every process (`/proc/self/io`; the collectives receive with"
            " recv(2), which it does not count), as multiples of the state's bytes; restores"
            " onto the same mesh, in a new manager, verified (jaxckpt). Layouts: replicated"
            " `P()` on a `(2N,)` mesh; fsdp `P('data')`; mixed `P(None, 'model')` on an"
            " `(N, 2)` data x model mesh. Targets: restore reads <= 1.1x, busiest writer"
            f" <= 1.25/N. Plot: [{PNG.name}](../../{PNG.name}).",
            "",
            "## On local disk",
            "",
            *table(header, rows),
            "## Collectives and coordination calls, per process",
            "",
            "The most of any process, from the manager's making to its close"
            " (`_internals.count_collectives`): collectives (all-gathers, broadcasts) /"
            " barriers (`sync_global_devices`, the coordination service's) / other"
            " coordination-service calls (key-value, preemption sync point). Orbax's own"
            " count as well as jaxckpt's.",
            "",
            *table(["layout", "N", "contender", "save", "restore"], calls),
            "## On object storage (fake-gcs-server and moto's S3 server on 127.0.0.1)",
            "",
            "The whole job's requests to the store at the save / at the restore, by kind"
            " (the server's log, one line per request, between two barriers of the"
            " harness), and in all per process. The servers log no size for a download: the"
            " bytes read are counted on local disk, above. Plain Orbax writes no s3://"
            " (google/orbax#359).",
            "",
            *table(
                ["store", "layout", "N", "contender", *gcs.REQUEST_KINDS, "per process", "bitwise"],
                on_buckets,
            ),
            "## The local tier",
            "",
            "`LocalTier(every_steps=1, replicas=1)`, one step saved to the local tier alone"
            " (each process's part into its own folder, a copy to the next process over the"
            " peer protocol), restored with every part there, then again after process 0's"
            " folder was deleted (its part fetched from the peer that keeps it). The busiest"
            " process, against the state's bytes: its part / the copy it keeps; save writes /"
            " reads (its part, the copy it sends with sendfile(2), which counts it as read"
            " and written, the copy it receives and checks); restore reads; the same after"
            " process 0's loss (the peer's reads include the part it sends); calls as above,"
            " save ; restore.",
            "",
            *table(
                [
                    "layout",
                    "N",
                    "part / copy kept",
                    "save writes / reads",
                    "restore reads",
                    "restore reads, a part lost",
                    "tier",
                    "calls, save ; restore",
                    "bitwise",
                ],
                local,
            ),
            *model(results),
        ]
    )
    (OUT / "scale.md").write_text(text)
    plot(results, PNG)
    print(text)


def _fit(points: list[tuple[int, float]], n: int) -> float:
    """A count's straight line through its last two measured (N, count) points (the
    largest N, where a constant term matters least), at N = n; a count that falls with N
    held at its last value (a line would take it below zero)."""
    xs, ys = zip(*points[-2:], strict=True)
    if len(set(xs)) < 2:
        return ys[-1]
    slope = max(0.0, (ys[-1] - ys[0]) / (xs[-1] - xs[0]))
    return ys[0] + slope * (n - xs[0])


def model(results: dict) -> list[str]:
    """How jaxckpt's counts grow to 256 and 1,024 hosts: measured, and a line through the
    measured points where a count grows with N."""

    def measured(storage: str, contender: str) -> list[tuple[int, dict]]:
        """(N, summary) of jaxckpt's jobs in one layout (replicated where measured)."""
        got = {k[1:3]: v for k, v in results.items() if k[0] == storage and k[3] == contender}
        layouts = {layout for layout, _ in got}
        layout = "replicated" if "replicated" in layouts else min(layouts, default=None)
        return sorted((n, v) for (name, n), v in got.items() if name == layout)

    points = measured("local", "jaxckpt")
    if not points:
        return []

    def per_n(values: list[tuple[int, object]]) -> str:
        return ", ".join(f"{v} at N = {n}" for n, v in values)

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
            "collectives / barriers / coordination calls of a process, restore",
            "O(read batches), not N: one agreement per stage, one all-gather per batch"
            " (within the restore budget)",
            per_n([(n, _calls_text(v["restore_calls"])) for n, v in points]),
            "yes",
        ],
        [
            "collectives / barriers / coordination calls of a process, save",
            "O(1) per save: Orbax's barriers, jaxckpt's agreement on the step and its"
            " digests (process 0 takes N, one key-value read)",
            per_n([(n, _calls_text(v["save_calls"])) for n, v in points]),
            "yes",
        ],
        [
            "files per step",
            "O(N): each process's OCDBT folder and packed file pair, written by itself",
            " / ".join(f"{_fit(files, n):,.0f}" for n in at),
            "yes: each process lists them once per restore, one request per 1,000",
        ],
        [
            "metadata bytes per step (KiB)",
            "O(N): per-process indexes, their merge and OCDBT manifests; every process"
            " reads the merged index at restore, O(N) bytes each, O(N^2) in the job",
            " / ".join(f"{_fit(meta, n):,.0f}" for n in at),
            "yes while a process's share stays below its data share (at 1,024 hosts the"
            " job reads that many KiB 1,024 times)",
        ],
        [
            "process 0's reads at a save",
            "O(state / N): each process hashes the files it wrote for the manifest,"
            " process 0 also the step's metadata and every packed index (to merge them)",
            f"{p0:.2f}/N at most",
            "yes: the job reads each step once more (the files just written: the page"
            " cache on local disk, a GET of one's own objects on object storage), 1/N"
            " of it on each host",
        ],
    ]
    if gcs_points := measured("gs", "jaxckpt"):
        save = [(n, sum(v["save_requests"].values())) for n, v in gcs_points]
        rows.append(
            [
                "requests to gs:// of a save, whole job (per process)",
                "O(N) in the job, O(1) per process: each lists and stats what it wrote and"
                " the step's shared files (process 0 also reads every packed index, to merge"
                " them: O(N) on one host); measured "
                + ", ".join(f"{c:,} ({c / n:,.0f}) at N = {n}" for n, c in save),
                " / ".join(f"{_fit(save, n):,.0f} ({_fit(save, n) / n:,.0f})" for n in at),
                "yes: flat per host",
            ]
        )
        each = [(n, sum(v["restore_requests"].values()) / n) for n, v in gcs_points]
        rows.append(
            [
                "requests to gs:// of a restore, whole job (per process)",
                "O(N) in the job, O(1) per process: each process lists the step (one"
                " request per 1,000 files), reads its info, its manifest and the packed"
                " indexes process 0 merged at the commit (`packed/index.json`, one GET), and"
                " its share of the data; measured "
                + ", ".join(f"{c * n:,.0f} ({c:,.0f}) at N = {n}" for n, c in each),
                " / ".join(f"{_fit(each, n) * n:,.0f} ({_fit(each, n):,.0f})" for n in at),
                "yes: flat per host",
            ]
        )
    if local_points := measured("local", "local"):
        held = [(n, f"{v['own_part'] + v['copy_kept']:.2f}x") for n, v in local_points]
        rows.append(
            [
                "local tier: a process's bytes on its disk and over the peer protocol",
                "O(state held): its part and one copy of a peer's (replicas=1), sent and"
                " received once per local save; at a restore only a lost part moves",
                per_n(held),
                "yes: flat in N (a restore reads its part twice, checked before it is read)",
            ]
        )
    return [
        "## How the counts grow (jaxckpt, replicated; 256 / 1,024 hosts extrapolated)",
        "",
        *table(["count", "grows as", "at 256 / 1,024 hosts", "acceptable"], rows),
    ]


def plot(results: dict, out: Path) -> None:
    """First row, per layout on local disk: restore reads (whole job) and the busiest
    writer (times N) against N. Second row (replicated): a process's collectives and
    barriers, the job's requests to gs:// and s3://, the local tier's bytes per process."""
    save_light_and_dark(lambda: _figure(results), out, dpi=90)


def _figure(results: dict) -> Any:
    import matplotlib.pyplot as plt

    def series(storage: str, layout: str, contender: str) -> list[tuple[int, dict]]:
        return sorted(
            (k[2], v)
            for k, v in results.items()
            if (k[0], k[1], k[3]) == (storage, layout, contender)
        )

    layouts = sorted({k[1] for k in results if k[0] == "local"}, key=LAYOUTS.index)
    columns = max(len(layouts), 3)
    fig, axes = plt.subplots(2, columns, figsize=(5 * columns, 8), squeeze=False)
    styles = (("jaxckpt", "-"), ("orbax", "--"))
    for ax, layout in zip(axes[0], layouts, strict=False):
        for contender, style in styles:
            got = series("local", layout, contender)
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
        ax.axhline(1.1, color=foreground(), lw=0.8, ls=":", label="1.1x the state")
        ax.axhline(1.25, color=foreground(), lw=0.8, ls="-.", label="1.25x the state")
        ax.set_ylabel("multiple of the state's bytes")
        ax.set_title(f"{layout}: storage traffic")
    calls, requests, local = axes[1][:3]
    for contender, style in styles:
        got = series("local", "replicated", contender)
        for phase, marker in (("save", "s"), ("restore", "o")):
            ax_values = [sum(v[f"{phase}_calls"]) for _, v in got]
            calls.plot(
                [n for n, _ in got], ax_values, marker + style, label=f"{contender}: {phase}"
            )
        got = series("gs", "replicated", contender)
        for phase, marker in (("save", "s"), ("restore", "o")):
            counts = [sum(v[f"{phase}_requests"].values()) for _, v in got]
            requests.plot(
                [n for n, _ in got], counts, marker + style, label=f"{contender}: {phase}"
            )
    got = series("s3", "replicated", "jaxckpt")
    for phase, marker in (("save", "s"), ("restore", "o")):
        counts = [sum(v[f"{phase}_requests"].values()) for _, v in got]
        requests.plot([n for n, _ in got], counts, marker + ":", label=f"jaxckpt, s3://: {phase}")
    calls.set_title("replicated: a save's and a restore's calls between processes")
    calls.set_ylabel("collectives + barriers + coordination calls")
    requests.set_title("replicated, gs:// (and s3://): requests of the whole job")
    requests.set_ylabel("requests")
    for layout, style in (("replicated", "-"), ("fsdp", "--")):
        got = series("local", layout, "local")
        ns = [n for n, _ in got]
        local.plot(ns, [v["own_part"] for _, v in got], "o" + style, label=f"{layout}: own part")
        local.plot(ns, [v["copy_kept"] for _, v in got], "s" + style, label=f"{layout}: copy kept")
    local.set_title("local tier: bytes per process")
    local.set_ylabel("multiple of the state's bytes")
    for ax in axes.flat:
        if ax.has_data():
            ax.set_xscale("log", base=2)
            ax.set_xlabel("processes N")
            ax.legend(fontsize=7)
        else:
            ax.set_visible(False)
    fig.suptitle("Against the number of processes: what a save and a restore read, write and ask")
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    main()

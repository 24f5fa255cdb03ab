"""jaxckpt vs plain Orbax vs raw disk vs safetensors, side by side; writes BENCHMARKS.md.

    python benchmarks/compare.py [--quick] [--runs 7] [--out BENCHMARKS.md] [--pages-only]
    python benchmarks/compare.py --gpu --out benchmarks/results/gpu.md   (an ~8 GiB state)

Each state runs in a fresh process (`benchmarks/worker.py`) on 8 CPU devices, (4, 2) mesh
(with --gpu: the accelerators of the host). In that process every contender saves and
restores the same state, alternating, every shard given new bytes before each save (as a
training step does: jaxckpt's default, incremental save writes only what changed, and the
same bytes again would cost it nothing): one warm-up round (reported as the first save), then
`--runs` timed rounds, each operation after an `os.sync()` (no one else's writes still being
flushed); medians and min-max are reported, and every ratio comes from one run.

Contenders:
* jaxckpt: `CheckpointManager.save` (returns after the device-to-host copy), `wait`, `restore`
  (checksums verified, the default); with compression="zstd" on the AdamW state;
* orbax: plain `ocp.CheckpointManager` with its defaults (async, OCDBT, zstd),
  `StandardSave` / `StandardRestore`;
* raw disk: the same shard bytes written by 8 threads, one file per shard, each fsynced
  (a practical physical limit here); restore reads them and puts them on the target;
* safetensors: `save_file` / `load_file` + `device_put` against jaxckpt's export and import.

Also: each contender's first save in FIRST_SAVES fresh processes of its own, and the step
time of a jitted matmul while a save runs in the background (alternating rounds). The page
opens with its targets, each ratio with the range of its per-round ratios, then the
earlier ones; every other page under benchmarks/results/ follows.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.tables import table
from reliability import launch

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"

STATES = {
    # name: description, leaf shapes, and which extra measurements run
    "64MiB": dict(
        description="~64 MiB float32, 16 leaves",
        shapes=[(1024, 1024)] * 16,
        reshard=True,
        export=True,
        zstd=False,
    ),
    "512MiB": dict(
        description="~512 MiB float32, 16 leaves of 32 MiB",
        shapes=[(2048, 4096)] * 16,
        reshard=True,
        export=False,
        zstd=False,
    ),
    "1GiB-adamw": dict(
        description="~1 GiB: float32 params + AdamW mu and nu (3 x 16 leaves of 21 MiB)",
        shapes=[(2304, 2304)] * 48,
        reshard=True,
        export=True,
        zstd=True,
    ),
    "1GiB-4000-leaves": dict(
        description="~1 GiB in 4,000 float32 leaves of 256 KiB",
        shapes=[(256, 256)] * 4000,
        reshard=False,
        export=False,
        zstd=False,
        slowdown_runs=3,  # Orbax's save of it takes ~60 s while the matmul runs
    ),
}
GPU_STATE = dict(  # shapes and description set by --gpu-leaf-side
    reshard=False,
    export=False,
    zstd=True,
)
RESTORES = ("same mesh", "onto (2, 4)", "onto 1 device")
FIRST_SAVES = 7  # fresh processes per contender: one first save is one sample of noise
SAVE_FILE = "safetensors save_file (host arrays)"
GATHER_SAVE_FILE = "np.asarray (gather) + safetensors save_file"
ORBAX_SAVE_FILE = "Orbax restore + np.asarray + safetensors save_file"
EXPORTS = (
    "jaxckpt save_safetensors (live state)",
    "jaxckpt export_safetensors (from the checkpoint)",
)


def run_state(spec: dict, runs: int, platform_: str, **extra) -> dict:
    job = dict(spec, runs=runs, platform=platform_, **extra)
    job.setdefault("slowdown_runs", runs)
    with tempfile.TemporaryDirectory(prefix="jaxckpt-bench-", dir=os.environ.get("BENCH_DIR")) as w:
        proc = launch.run(
            "-m",
            "benchmarks.worker",
            json.dumps(job),
            w,
            stdout=subprocess.PIPE,  # the worker's progress goes to stderr, shown as it runs
            text=True,
            timeout=3600,
        )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"benchmark worker failed ({proc.returncode})")
    return json.loads(lines[-1][7:])


def med(values: list[float]) -> float:
    return statistics.median(values)


def cell(values: list[float] | None, digits: int = 3) -> str:
    if not values:
        return "-"
    return f"{med(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def verdict(value: float, limit: float, at_most: bool) -> str:
    ok = value <= limit if at_most else value >= limit
    return f"{value:.2f} {'ok' if ok else 'MISSED'}"


def paired(ours: list[float], theirs: list[float], limit: float, at_most: bool = True) -> str:
    """The verdict on the ratio of medians `ours / theirs`, with the range of the ratios of
    their values round by round (the rounds alternate, so each pair ran back to back)."""
    ratios = [a / b for a, b in zip(ours, theirs, strict=True)]
    return (
        f"{verdict(med(ours) / med(theirs), limit, at_most)} "
        f"({min(ratios):.2f} to {max(ratios):.2f})"
    )


def report(
    results: dict[str, dict], states: dict, runs: int, command: str, machine: str
) -> list[str]:
    any_result = next(iter(results.values()))
    lines = [
        "# Benchmarks: jaxckpt vs plain Orbax vs raw disk vs safetensors",
        "",
        f"Regenerated by `{command}` on {datetime.date.today().isoformat()}. Machine: "
        f"{machine}; {any_result['devices']} devices; jax {any_result['versions']['jax']}, "
        f"orbax-checkpoint {any_result['versions']['orbax']}. Each state runs in a fresh "
        "process; the contenders take turns (in an order where each follows every other one "
        "equally often), one warm-up round (the first save) then "
        f"{runs} timed rounds, every shard given new bytes before each save (as a training "
        "step does: jaxckpt's incremental save writes only what changed); medians with (min-max), seconds unless noted. Ratios are of "
        "medians from the same run. Peak RSS is the process's high-water mark above its "
        "level before the operation, as a multiple of the state's size.",
        "",
        "## Targets: jaxckpt against plain Orbax and the disk",
        "",
        "Each ratio is of the medians; in brackets the range of the ratios round by round "
        "(the contenders take turns, so each round pairs saves made one after the other). "
        "First save: the median of "
        f"{FIRST_SAVES} fresh processes each. During a save: the step time's slowdown while "
        "it runs in the background, and the training time it costs (the steps' time above "
        "what they take alone), jaxckpt's against Orbax's.",
        "",
    ]
    rows = []
    for name, r in results.items():
        c, s = r["contenders"], r["slowdown"]
        restores = [f"restore {t}" for t in RESTORES if f"restore {t}" in c["jaxckpt"]]

        def against(ours: list[float], theirs: list[float], unit: str, pairs: bool = True) -> str:
            digits = 2 if unit == "x" else 3
            said = f": {med(ours):.{digits}f}{unit} vs {med(theirs):.{digits}f}{unit}"
            if pairs:
                return paired(ours, theirs, 1.0) + said
            return verdict(med(ours) / med(theirs), 1.0, True) + said

        def during(metric: str, unit: str, s=s) -> str:
            return against(*([x[metric] for x in s[k]] for k in ("jaxckpt", "orbax")), unit)

        rows.append(
            [
                states[name]["description"],
                paired(c["jaxckpt"]["blocking"], c["orbax"]["blocking"], 1.0),
                # separate processes: no rounds to pair
                against(c["jaxckpt"]["first_blocking"], c["orbax"]["first_blocking"], " s", False),
                paired(c["jaxckpt"]["total"], c["orbax"]["total"], 1.0),
                paired(c["raw"]["total"], c["jaxckpt"]["total"], 0.6, at_most=False),
                "; ".join(paired(c["jaxckpt"][t], c["orbax"][t], 1.0) for t in restores),
                during("slowdown", "x"),
                during("cost", " s"),
            ]
        )
    lines += table(
        [
            "state",
            "blocking (<= 1.0)",
            "first save blocking (<= 1.0)",
            "until committed (<= 1.0)",
            "save rate / raw disk (>= 0.6)",
            "restore: " + ", ".join(RESTORES) + " (<= 1.0)",
            "slowdown during a save (<= 1.0)",
            "training time a save costs (<= 1.0)",
        ],
        rows,
    )
    lines += [
        "The many-leaf targets against the floor JAX sets are the leaf sweep's "
        "(`benchmarks/results/leaf_sweep.md`, below).",
        "",
        "## Earlier targets",
        "",
    ]
    rows = []
    for name, r in results.items():
        c = r["contenders"]
        same = "restore same mesh"
        reshard = [f"restore {t}" for t in RESTORES[1:] if f"restore {t}" in c["jaxckpt"]]
        row = [
            states[name]["description"],
            ", ".join(
                verdict(med(c["jaxckpt"][t]) / med(c["jaxckpt"][same]), 1.2, True) for t in reshard
            )
            or "-",
            verdict(med(c["jaxckpt"]["save_rss"]) / med(c["orbax"]["save_rss"]), 1.2, True),
        ]
        e = r["export"]
        row.append(
            ", ".join(
                verdict(med(e[SAVE_FILE]["time"]) / med(e[k]["time"]), 1.0, False) for k in EXPORTS
            )
            + " (live vs gather + save_file: "
            + f"{med(e[GATHER_SAVE_FILE]['time']) / med(e[EXPORTS[0]]['time']):.2f}; "
            + "from the checkpoint vs Orbax restore + save_file: "
            + f"{med(e[ORBAX_SAVE_FILE]['time']) / med(e[EXPORTS[1]]['time']):.2f})"
            if e
            else "-"
        )
        rows.append(row)
    lines += table(
        [
            "state",
            "resharded / same-mesh restore, (2,4) and 1 device (<= 1.2)",
            "save peak RSS / Orbax (<= 1.2)",
            "export rate / save_file (>= 1.0): live state, from the checkpoint",
        ],
        rows,
    )

    for name, r in results.items():
        c, gb = r["contenders"], r["state_bytes"] / 1e9
        lines += [f"## {states[name]['description']}", "", "Save:", ""]
        lines += table(
            [
                "contender",
                f"first save blocking ({FIRST_SAVES} fresh processes)",
                "save blocking",
                "save total (committed)",
                "GB/s",
                "peak RSS",
                "on disk",
                "files",
            ],
            [
                [
                    k,
                    cell(v["first_blocking"]) if k in ("jaxckpt", "orbax") else "-",
                    cell(v["blocking"]),
                    cell(v["total"]),
                    f"{gb / med(v['total']):.2f}",
                    f"{med(v['save_rss']):.2f}x",
                    f"{v['bytes'] / 2**20:.1f} MiB",
                    str(v["files"]),
                ]
                for k, v in c.items()
            ],
        )
        restores = [t for t in RESTORES if f"restore {t}" in c["jaxckpt"]]
        lines += ["Restore (jaxckpt verifies checksums first):", ""]
        lines += table(
            ["contender", *(f"restore {t}" for t in restores), "peak RSS (same mesh)"],
            [
                [
                    k,
                    *(cell(v[f"restore {t}"]) for t in restores),
                    f"{med(v['restore same mesh rss']):.2f}x",
                ]
                for k, v in c.items()
            ],
        )
        lines += [
            "A jitted 2048x2048 matmul stepping while a save runs in the background, "
            f"{len(r['slowdown']['jaxckpt'])} saves each (alternating; each against the "
            "steps just before it):",
            "",
        ]
        lines += table(
            [
                "contender",
                "step alone",
                "slowdown during the save",
                "training time the save costs",
                "save took, while stepping",
                "steps during the save",
            ],
            [
                [
                    k,
                    f"{med([x['alone'] for x in v]) * 1e3:.1f} ms",
                    cell([x["slowdown"] for x in v], 2),
                    cell([x["cost"] for x in v], 2),
                    cell([x["save"] for x in v], 2),
                    str(sum(x["steps"] for x in v)),
                ]
                for k, v in r["slowdown"].items()
            ],
        )
        if "jaxckpt zstd" in c:
            z, p = c["jaxckpt zstd"], c["jaxckpt"]
            lines += ["Compression (jaxckpt's default is none):", ""]
            lines += table(
                ["compression", "on disk", "save total", "restore same mesh"],
                [
                    [
                        label,
                        f"{v['bytes'] / 2**20:.1f} MiB ({v['bytes'] / p['bytes']:.2f}x)",
                        f"{med(v['total']):.3f} ({med(v['total']) / med(p['total']):.2f}x)",
                        f"{med(v['restore same mesh']):.3f} "
                        f"({med(v['restore same mesh']) / med(p['restore same mesh']):.2f}x)",
                    ]
                    for label, v in (("none", p), ("zstd", z))
                ],
            )
        if r["export"]:
            lines += ["Safetensors export and import:", ""]
            lines += table(
                ["operation", "time", "GB/s", "peak RSS"],
                [
                    [k, cell(v["time"]), f"{gb / med(v['time']):.2f}", f"{med(v['rss']):.2f}x"]
                    for k, v in r["export"].items()
                ],
            )
    return lines


def other_results(at: Path) -> list[str]:
    """The other benchmarks' pages (benchmarks/results/*.md, each written by its own
    script, which `make bench` runs), one section each (their own headings two levels
    down), their relative links made relative to the folder `at` of this page: this page
    is the current one, its history in git and CHANGELOG.md."""

    def rebased(link: re.Match) -> str:
        target = link.group(1)
        if "://" in target or target.startswith("#"):
            return link.group(0)
        return f"]({os.path.relpath((RESULTS / target).resolve(), at.resolve())})"

    lines = ["", "## The other benchmarks", ""]
    for page in sorted(RESULTS.glob("*.md")):
        heading, _, body = page.read_text().partition("\n")
        body = re.sub(r"^(#+) ", r"\1## ", body, flags=re.MULTILINE)  # below its heading
        lines += [
            f"### {heading.lstrip('# ')}",
            "",
            f"From [`benchmarks/results/{page.name}`]({os.path.relpath(page, at.resolve())}).",
            re.sub(r"\]\(([^)\s]+)\)", rebased, body.rstrip()),
            "",
        ]
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the 64 MiB state, 3 runs (~1 min)")
    parser.add_argument("--gpu", action="store_true", help="the ~8 GiB state on accelerators")
    parser.add_argument("--runs", type=int, default=None, help="timed rounds (default 7)")
    parser.add_argument(
        "--gpu-leaf-side", type=int, default=6656, help="with --gpu: leaves are N x N float32"
    )
    parser.add_argument("--out", type=Path, default=ROOT / "BENCHMARKS.md")
    parser.add_argument(
        "--pages-only",
        action="store_true",
        help="keep --out's own tables and append the other benchmarks' pages anew (after "
        "one of them is rerun, where nothing this script measures changed)",
    )
    args = parser.parse_args()
    if args.pages_only:
        own = args.out.read_text().partition("\n## The other benchmarks\n")[0].splitlines()
        args.out.write_text("\n".join(own + other_results(args.out.parent)))
        return 0
    # 7 rounds: save blocking on the 1 GiB state is bimodal (~15 or ~30-60 ms, for Orbax
    # too), and 5 rounds put its median on either side.
    runs = args.runs or (3 if args.quick else 7)
    if args.gpu:
        n = args.gpu_leaf_side
        states = {
            "gpu": dict(
                GPU_STATE,
                shapes=[(n, n)] * 48,
                description=f"~{48 * n * n * 4 / 2**30:.1f} GiB: float32 params + AdamW mu "
                f"and nu (3 x 16 leaves of {n * n * 4 / 2**20:.0f} MiB)",
            )
        }
    else:
        states = {k: STATES[k] for k in (["64MiB"] if args.quick else STATES)}

    results = {}
    for name, spec in states.items():
        print(f"running {name}: {spec['description']} ...", flush=True)
        where = "gpu" if args.gpu else "cpu"
        results[name] = run_state(spec, runs, where)
        firsts: dict[str, list[float]] = {"jaxckpt": [], "orbax": []}
        for i in range(FIRST_SAVES):  # each first save in a process of its own, alternating
            for contender, blocking in firsts.items():
                first = run_state(
                    spec,
                    runs,
                    where,
                    first_save_only=contender,
                    profile=bool(os.environ.get("BENCH_PROFILE"))
                    and contender == "jaxckpt"
                    and i == 0,
                )
                blocking.append(first["blocking"])
        for contender, blocking in firsts.items():
            results[name]["contenders"][contender]["first_blocking"] = blocking
    command = "python benchmarks/compare.py" + " --quick" * args.quick + " --gpu" * args.gpu
    command += f" --runs {runs}"
    machine = f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"
    lines = report(results, states, runs, command, machine)

    text = "\n".join(lines + other_results(args.out.parent))
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What a save writes when little changed, and when everything did: jaxckpt and plain Orbax
side by side (issue 53's harness).

Two states of ~500 MiB of float32 on a (4, 2) mesh of 8 CPU devices, saved five times by
each tool, each tool in a fresh process (the tools take turns, `--repeat` times):

* `frozen base`: a fine-tune: a base of 18 leaves of 25 MiB (450 MiB) that never changes,
  and adapters plus their two Adam moments (51 MiB, 3 x 17 leaves of 1 MiB) that change
  between saves. The base is passed as the same arrays each time (`same arrays`: an NNX
  model whose optimizer never touches the base, an Equinox model's frozen part) or as new
  arrays of the same bytes (`new arrays`: a Linen fine-tune whose `optax.multi_transform`
  adds zero updates to the base);
* `pretraining`: every leaf changes between saves.

For each later save (2 to 5): the bytes the process wrote (`/proc/self/io` write_bytes:
its background threads included) and the step folder's size, the time `save` blocked and
until committed (each save after an `os.sync()`); the directory's size after five saves; then the last step restored in a
fresh process onto the same mesh and onto (2, 4), compared bitwise. Medians, ranges.

Targets (issue 53), frozen base: each later save writes <= 1.05x the changed bytes +
metadata and commits in <= 0.25x a full save's time; five steps on disk <= 1.5x one state;
the restore of such a step <= 1.05x a full step's. Pretraining: the blocking and committed
times and the bytes of jaxckpt with incremental=False (each step standing alone).

    python benchmarks/incremental.py [--repeat 3] [--out benchmarks/results/incremental.md]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
from benchmarks.incremental_state import CHANGED_BYTES, SCENARIOS, STATE_BYTES, state
from benchmarks.tables import write_page
from reliability import launch

MIB = 2**20
SAVES = 5
TOOLS = ("jaxckpt, incremental=False", "jaxckpt", "orbax")  # (jaxckpt: its default)


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def written_bytes() -> int:
    """What this process (all its threads) wrote so far (/proc/self/io)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("write_bytes"))


def worker(tool: str, scenario: str, directory: Path) -> dict:
    """Five saves by `tool` into `directory`, in this process: their measures."""
    import jax

    steps: list[dict] = []
    base = None
    if tool.startswith("jaxckpt"):
        import jaxckpt

        full = tool.endswith("incremental=False")  # each step standing alone, as before
        mngr = jaxckpt.CheckpointManager(directory, incremental=False if full else None)
        save = lambda step, state: mngr.save(step, state=state)  # noqa: E731
    else:
        import orbax.checkpoint as ocp

        mngr = ocp.CheckpointManager(directory)
        save = lambda step, state: mngr.save(step, args=ocp.args.StandardSave(state))  # noqa: E731
    for step in range(1, SAVES + 1):
        saved = state(step, scenario, base)
        base = saved["base"]
        jax.block_until_ready(saved)
        os.sync()  # each save starts with no earlier save's writes still being flushed
        before = written_bytes()
        start = time.perf_counter()
        save(step, saved)
        blocking = time.perf_counter() - start
        mngr.wait_until_finished() if tool == "orbax" else mngr.wait()
        committed = time.perf_counter() - start
        steps.append(
            {
                "blocking": blocking,
                "committed": committed,
                "written": written_bytes() - before,
                "folder": folder_bytes(directory / str(step)),
            }
        )
    mngr.close()
    return {"steps": steps, "on_disk": folder_bytes(directory)}


def restore_worker(tool: str, scenario: str, directory: Path, mesh: str) -> dict:
    """The last step restored onto `mesh` ("same" or "(2, 4)") in this fresh process,
    checked bitwise against the state saved."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    shape = (4, 2) if mesh == "same" else (2, 4)
    sharding = NamedSharding(jax.make_mesh(shape, ("data", "model")), P("data", "model"))
    saved = state(SAVES, scenario)  # (a frozen base's bytes are those of any step's)
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), saved
    )
    start = time.perf_counter()
    if tool.startswith("jaxckpt"):
        import jaxckpt

        with jaxckpt.CheckpointManager(directory, read_only=True) as m:
            got = m.restore(SAVES, state=target).state
    else:
        import orbax.checkpoint as ocp

        with ocp.CheckpointManager(directory) as m:
            got = m.restore(SAVES, args=ocp.args.StandardRestore(target))
    jax.block_until_ready(got)
    seconds = time.perf_counter() - start
    same = jax.tree.all(
        jax.tree.map(lambda a, b: np.asarray(a).tobytes() == np.asarray(b).tobytes(), got, saved)
    )
    return {"restore": seconds, "bitwise": bool(same)}


def child(*args: str) -> dict:
    return launch.report("-m", "benchmarks.incremental", "--worker", *args, timeout=1200)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "incremental.md"
    )
    parser.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        kind, *rest = args.worker
        if kind == "save":
            result = worker(rest[0], rest[1], Path(rest[2]))
        else:
            result = restore_worker(rest[0], rest[1], Path(rest[2]), rest[3])
        print("RESULT " + json.dumps(result))
        return 0
    runs: dict[tuple[str, str], list[dict]] = {}
    work = Path(tempfile.mkdtemp(prefix="jaxckpt-incremental-"))
    try:
        for done in range(1, args.repeat + 1):
            for scenario in SCENARIOS:
                for tool in TOOLS:  # the tools take turns
                    directory = work / f"{tool.replace(' ', '-')}-{SCENARIOS.index(scenario)}"
                    shutil.rmtree(directory, ignore_errors=True)
                    got = child("save", tool, scenario, str(directory))
                    for mesh in ("same", "(2, 4)"):
                        got[mesh] = child("restore", tool, scenario, str(directory), mesh)
                    runs.setdefault((scenario, tool), []).append(got)
            write(args, runs, done)  # each round's page (a round takes ~20 min here)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def write(args: argparse.Namespace, runs: dict[tuple[str, str], list[dict]], rounds: int) -> None:
    state_mib, changed_mib = STATE_BYTES / MIB, CHANGED_BYTES / MIB

    def median(values: list[float]) -> str:
        return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"

    rows = []
    for (scenario, tool), got in runs.items():
        later = [s for run in got for s in run["steps"][1:]]
        first = [run["steps"][0] for run in got]
        rows.append(
            [
                scenario,
                tool,
                f"{statistics.median(s['written'] for s in first) / MIB:.1f}",
                f"{statistics.median(s['written'] for s in later) / MIB:.1f}",
                f"{statistics.median(s['folder'] for s in later) / MIB:.1f}",
                median([s["blocking"] * 1000 for s in later]),
                median([s["committed"] for s in later]),
                f"{statistics.median(r['on_disk'] for r in got) / STATE_BYTES:.2f}x",
                median([r["same"]["restore"] for r in got]),
                median([r["(2, 4)"]["restore"] for r in got]),
                "yes" if all(r[m]["bitwise"] for r in got for m in ("same", "(2, 4)")) else "NO",
            ]
        )
    about = (
        f"A {state_mib:.0f} MiB state of float32 on a (4, 2) mesh of 8 CPU devices, "
        f"saved {SAVES} times by each tool in a fresh process (the tools taking turns, "
        f"{rounds} round(s)); 'frozen base': {state_mib - changed_mib:.0f} MiB never "
        f"change, {changed_mib:.0f} MiB (adapters and two Adam moments) change "
        "between saves; 'pretraining': everything changes. MiB written: the process's "
        "write_bytes (/proc/self/io); later saves: steps 2-5, medians (range). On disk: the "
        "directory after five saves, as a multiple of one state. Restores of the last step "
        "in a fresh process, checked bitwise. jaxckpt: its defaults (incremental); "
        "incremental=False: each step standing alone. plain Orbax: `ocp.CheckpointManager`'s "
        "defaults (async, OCDBT, zstd). `python benchmarks/incremental.py`. Machine: "
        f"{os.cpu_count()} CPUs."
    )
    header = [
        "state",
        "tool",
        "MiB written, step 1",
        "MiB written, each later step",
        "later step's folder, MiB",
        "blocking, ms",
        "until committed, s",
        f"{SAVES} steps on disk",
        "restore, same mesh, s",
        "restore onto (2, 4), s",
        "bitwise",
    ]
    write_page(args.out, "Incremental steps: what a save writes", about, header, rows)


if __name__ == "__main__":
    sys.exit(main())

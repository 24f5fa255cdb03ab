"""What `full_save_every` costs and what it buys: how far one damaged file reaches among an
incremental fine-tune's steps, against the bytes written.

The `frozen base, same arrays` state of `incremental.py` (450 MiB never change, 51 MiB of
adapters and their Adam moments change at every save; float32 on a (4, 2) mesh of 8 CPU
devices), saved 20 times with `keep_last=3` by jaxckpt with each `full_save_every`, each in
a fresh process; plain Orbax (its defaults) beside it. For each: the MiB the process wrote
per save (`/proc/self/io`, steps 2-20, mean: the full saves among them), the time `save`
blocked and until committed (median, slowest), the directory on disk after the 20 saves;
from each step's `shares.json`, the most steps that read one step's files (those one damaged
file makes unrestorable); and from `jaxckpt ls --json`, whether a kept step restores
whatever single step's files on disk are damaged.

    python benchmarks/full_saves.py [--out benchmarks/results/full_saves.md]
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
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
from benchmarks.incremental import MIB, folder_bytes, written_bytes
from benchmarks.incremental_state import STATE_BYTES, state
from benchmarks.tables import write_page
from reliability import launch

SAVES = 20
KEEP_LAST = 3
SCENARIO = "frozen base, same arrays"
SETTINGS = ("None", "10", "5", "2", "orbax")  # jaxckpt's full_save_every, then Orbax


def worker(setting: str, directory: Path) -> dict:
    """`SAVES` saves into `directory` in this process, with `setting`: their measures."""
    keep = KEEP_LAST
    if setting == "orbax":
        import orbax.checkpoint as ocp

        mngr = ocp.CheckpointManager(
            directory, options=ocp.CheckpointManagerOptions(max_to_keep=keep)
        )
        save = lambda step, s: mngr.save(step, args=ocp.args.StandardSave(s))  # noqa: E731
        wait = mngr.wait_until_finished
    else:
        import jaxckpt

        every = None if setting == "None" else int(setting)
        mngr = jaxckpt.CheckpointManager(
            directory, full_save_every=every, retention=jaxckpt.RetentionPolicy(keep_last=keep)
        )
        save = lambda step, s: mngr.save(step, state=s)  # noqa: E731
        wait = mngr.wait
    steps, base = [], None
    for step in range(1, SAVES + 1):
        saved = state(step, SCENARIO, base)
        base = saved["base"]
        os.sync()
        before = written_bytes()
        start = time.perf_counter()
        save(step, saved)
        blocking = time.perf_counter() - start
        wait()
        committed = time.perf_counter() - start
        shares = directory / str(step) / "jaxckpt" / "shares.json"  # (before retention's next)
        steps.append(
            {
                "blocking": blocking,
                "committed": committed,
                "written": written_bytes() - before,
                "reads": json.loads(shares.read_text())["steps"] if shares.exists() else [],
            }
        )
    mngr.close()
    return {"steps": steps, "on_disk": folder_bytes(directory)}


def reach(steps: list[dict]) -> int:
    """The most of the saves' steps that read one step's files (its own and those that
    refer to it), whether retention kept them or not."""
    reads = {step: {step, *s["reads"]} for step, s in enumerate(steps, 1)}
    return max(sum(s in files for files in reads.values()) for s in reads)


def survives(directory: Path) -> bool:
    """From `jaxckpt ls --json` (the steps on disk, which earlier ones each reads):
    whether every step's files, damaged alone, leave a kept step that reads none of them."""
    listed = subprocess.run(
        [sys.executable, "-m", "jaxckpt", "ls", "--json", str(directory)],
        capture_output=True,
        text=True,
        check=True,
        env=launch.environment(),
    )
    rows = json.loads(listed.stdout)["steps"]
    reads = {r["step"]: {r["step"], *r.get("shares", [])} for r in rows}
    kept = [r["step"] for r in rows if not r["status"].startswith("retired")]
    return all(any(s not in reads[k] for k in kept) for s in reads)


def child(setting: str, directory: Path) -> dict:
    return launch.report(
        "-m", "benchmarks.full_saves", "--worker", setting, directory, timeout=1800
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "full_saves.md"
    )
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(worker(args.worker[0], Path(args.worker[1]))))
        return 0
    rows = []
    work = Path(tempfile.mkdtemp(prefix="jaxckpt-full-saves-"))
    try:
        for setting in SETTINGS:
            directory = work / setting
            got = child(setting, directory)
            later = got["steps"][1:]
            orbax = setting == "orbax"
            blocking = [s["blocking"] * 1000 for s in later]
            committed = [s["committed"] for s in later]
            rows.append(
                [
                    "plain Orbax" if orbax else f"full_save_every={setting}",
                    f"{statistics.mean(s['written'] for s in later) / MIB:.1f}",
                    f"{statistics.median(blocking):.1f} ({max(blocking):.1f})",
                    f"{statistics.median(committed):.2f} ({max(committed):.2f})",
                    f"{got['on_disk'] / STATE_BYTES:.2f}x",
                    "1 (each step stands alone)" if orbax else str(reach(got["steps"])),
                    "yes" if orbax or survives(directory) else "no",
                ]
            )
            shutil.rmtree(directory, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    about = (
        f"The 'frozen base, same arrays' state of incremental.md ({STATE_BYTES / MIB:.0f} MiB "
        f"of float32 on a (4, 2) mesh of 8 CPU devices, 51 MiB of it changing at every "
        f"save), saved {SAVES} times with keep_last={KEEP_LAST}, each setting in a fresh "
        "process. MiB written: the process's write_bytes (/proc/self/io), steps 2-20, mean "
        "(the full saves among them); blocking and until committed: medians of steps 2-20 "
        "(the slowest: a full save's). On disk: the directory after the 20 saves, as a "
        "multiple of one state (retired steps, kept for the bytes a kept step reads, "
        "included). Steps one file reaches: the most of the 20 steps that read one step's "
        "files (its own, and those that refer to it: each step's shares.json as it "
        "committed), whether retention kept them or not; a kept step restores: whether "
        "every step's files on disk, damaged alone, leave a kept step that reads none of "
        "them (`jaxckpt ls --json`). plain Orbax: its defaults "
        f"(max_to_keep={KEEP_LAST}). `python benchmarks/full_saves.py`. Machine: "
        f"{os.cpu_count()} CPUs."
    )
    header = [
        "setting",
        "MiB written a save",
        "blocking, ms (slowest)",
        "until committed, s (slowest)",
        f"on disk after {SAVES} saves",
        "steps one file reaches",
        "a kept step restores",
    ]
    write_page(args.out, "Incremental steps: what full saves cost", about, header, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())

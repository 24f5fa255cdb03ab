"""What a directory of many steps costs to open and list (continuous checkpointing keeps
thousands): jaxckpt against plain Orbax's CheckpointManager on the same kind of directory,
in one run. Each directory holds one real step, linked (hard links: no copies) under N
step numbers, so that only the count differs.

    python benchmarks/many_steps.py [--counts 100,1000,10000] [--repeat 3]

Times (medians of --repeat, each in this process): a writer's manager opened (and closed), then its
`latest_step()`, its `all_steps()`; for Orbax, `CheckpointManager(dir)` (and closed), then `reload()` +
`latest_step()`, `reload()` + `all_steps()` (what a loop that must see the directory as it
is now calls). Written to benchmarks/results/many_steps.md.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.tables import write_page

OUT = Path(__file__).resolve().parent / "results" / "many_steps.md"


def directory_of(root: Path, count: int, save) -> Path:
    """`root` holding one step saved by `save(directory, 1)`, linked under steps 2..count."""
    save(root, 1)
    for step in range(2, count + 1):
        shutil.copytree(root / "1", root / str(step), copy_function=os.link)
    return root


def timed(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--counts", default="100,1000,10000")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()

    import jax

    jax.config.update("jax_platforms", "cpu")
    import numpy as np
    import orbax.checkpoint as ocp

    import jaxckpt

    logging.getLogger("absl").setLevel(logging.ERROR)  # Orbax: a line for each step
    state = {"w": np.arange(1024, dtype=np.float32), "b": np.ones(16, np.float32)}

    def jaxckpt_save(directory, step):
        with jaxckpt.CheckpointManager(directory) as m:
            m.save(step, state=state)

    def orbax_save(directory, step):
        with ocp.CheckpointManager(directory) as m:
            m.save(step, args=ocp.args.StandardSave(state))

    def jaxckpt_calls(directory):
        opened = timed(lambda: jaxckpt.CheckpointManager(directory).close(), args.repeat)
        with jaxckpt.CheckpointManager(directory) as m:
            latest = timed(m.latest_step, args.repeat)
            every = timed(m.all_steps, args.repeat)
        return opened, latest, every

    def orbax_calls(directory):
        opened = timed(lambda: ocp.CheckpointManager(directory).close(), args.repeat)
        with ocp.CheckpointManager(directory) as m:
            latest = timed(lambda: (m.reload(), m.latest_step()), args.repeat)
            every = timed(lambda: (m.reload(), m.all_steps()), args.repeat)
        return opened, latest, every

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for count in (int(c) for c in args.counts.split(",")):
            found = {}
            for who, save, calls in (
                ("jaxckpt", jaxckpt_save, jaxckpt_calls),
                ("Orbax", orbax_save, orbax_calls),
            ):
                directory = directory_of(Path(tmp) / f"{who}-{count}", count, save)
                found[who] = calls(directory)
                shutil.rmtree(directory)
                print(f"{count} steps, {who}: {found[who]}", flush=True)
            ours, theirs = found["jaxckpt"], found["Orbax"]
            rows.append(
                [f"{count:,}"]
                + [
                    f"{a * 1e3:,.1f} ms vs {b * 1e3:,.1f} ms"
                    for a, b in zip(ours, theirs, strict=True)
                ]
                + [f"{b / a:,.0f}x" for a, b in zip(ours[:2], theirs[:2], strict=True)]
            )
    write_page(
        OUT,
        "Many steps: opening and listing (jaxckpt vs plain Orbax)",
        f"`python benchmarks/many_steps.py --counts {args.counts} --repeat {args.repeat}`; "
        "medians, this machine. Orbax's listing reads every step's metadata at opening and "
        "at each reload; jaxckpt lists the directory itself, for opening and latest_step() "
        "from the newest step folder down to the newest committed one.",
        ["steps", "open", "latest_step()", "all_steps()", "open: faster", "latest: faster"],
        rows,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

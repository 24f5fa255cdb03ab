"""The jaxckpt demo (`make demo`): a crashed run resumes and matches an uninterrupted one.

1. Train 40 steps straight, without checkpoints: the reference.
2. Train again with jaxckpt saving every 10 steps asynchronously, and kill the process with
   SIGKILL after step 25: no clean shutdown, a save may be in flight.
3. Start a new process: it restores the latest committed step (model, optimizer, PRNG key,
   grain iterator position) and trains to step 40.
4. Compare every loss and the final model and optimizer state with the reference, bitwise.

Everything runs on 8 CPU devices on a (4, 2) data x model mesh, in `runs/demo/`.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
TRAIN = REPO / "examples" / "train.py"
CONFIG = REPO / "configs" / "demo.yaml"


def run_train(*args: str, timeout: float = 600) -> tuple[subprocess.CompletedProcess, float]:
    """Runs examples/train.py in a fresh process; returns it and its wall time."""
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, str(TRAIN), f"--config={CONFIG}", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return proc, time.perf_counter() - t0


def read_log(path: Path, field: str = "bits") -> dict[int, Any]:
    """{step: field} from a train.py log (`bits`: float32 bits of the loss, `loss`,
    `batch_crc`); a later line for the same step wins."""
    out = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        out[record["step"]] = record[field]
    return out


def differing_leaves(a: Path, b: Path) -> tuple[int, list[str]]:
    """Number of leaves in the .npz `a`, and those that differ bitwise in `b`."""
    with np.load(a) as x, np.load(b) as y:
        if sorted(x.files) != sorted(y.files):
            return len(x.files), sorted(set(x.files) ^ set(y.files))
        return len(x.files), [k for k in x.files if not np.array_equal(x[k], y[k])]


def _check(proc: subprocess.CompletedProcess, what: str, expect_rc: int = 0) -> None:
    if proc.returncode != expect_rc:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
        raise SystemExit(f"demo: {what} exited {proc.returncode}, expected {expect_rc}")


def main() -> int:
    out = REPO / "runs" / "demo"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    ckpt = out / "ckpt"
    steps, kill_at = 40, 25
    print(f"jaxckpt demo: {steps} steps of a small NNX transformer on 8 CPU devices, mesh 4x2")

    print("1/3 uninterrupted reference run ...", flush=True)
    ref, t_ref = run_train(
        f"--steps={steps}", f"--log={out / 'ref.jsonl'}", f"--final={out / 'ref.npz'}"
    )
    _check(ref, "the reference run")

    print(f"2/3 checkpointed run, killed with SIGKILL after step {kill_at} ...", flush=True)
    crashed, t_crash = run_train(
        f"--steps={steps}",
        f"--ckpt-dir={ckpt}",
        "--save-every=10",
        f"--stop-at={kill_at}",
        "--kill",
        f"--log={out / 'crashed.jsonl'}",
    )
    _check(crashed, "the killed run", expect_rc=-9)
    for line in crashed.stdout.splitlines():
        print("    " + line)

    print("3/3 new process resumes from the latest committed step ...", flush=True)
    resumed, t_resume = run_train(
        f"--steps={steps}",
        f"--ckpt-dir={ckpt}",
        "--save-every=10",
        f"--log={out / 'resumed.jsonl'}",
        f"--final={out / 'resumed.npz'}",
    )
    _check(resumed, "the resumed run")
    for line in resumed.stdout.splitlines():
        print("    " + line)

    reference = read_log(out / "ref.jsonl")
    before = read_log(out / "crashed.jsonl")
    after = read_log(out / "resumed.jsonl")
    resumed_from = min(after) - 1
    combined = {**{s: b for s, b in before.items() if s <= resumed_from}, **after}
    equal = sum(combined.get(s) == bits for s, bits in reference.items())
    n_leaves, bad_leaves = differing_leaves(out / "ref.npz", out / "resumed.npz")

    rows = [
        ("uninterrupted", f"1-{steps}", f"{t_ref:.1f}s"),
        ("killed (SIGKILL)", f"1-{max(before)}", f"{t_crash:.1f}s"),
        (f"resumed from step {resumed_from}", f"{min(after)}-{max(after)}", f"{t_resume:.1f}s"),
    ]
    print("\n  run                        steps    wall time")
    for name, span, t in rows:
        print(f"  {name:<26} {span:<8} {t:>9}")
    ok = equal == len(reference) == steps and not bad_leaves
    print(f"\n  losses equal to the uninterrupted run, bitwise: {equal}/{len(reference)}")
    print(
        f"  final model + optimizer leaves equal, bitwise: {n_leaves - len(bad_leaves)}/{n_leaves}"
    )
    print(
        f"  checkpoints in {ckpt.relative_to(REPO)}: steps {sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit())}"
    )
    print("\n  RESULT: " + ("exact resumption after a crash" if ok else "MISMATCH"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

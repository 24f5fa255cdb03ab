"""The jaxckpt demo (`make demo`): preempted, resumed on another mesh, verified, exported.

A GPT-2 (examples/gpt2.py) trains 40 steps on 8 CPU devices (examples/train.py: AdamW with
a warmup-cosine schedule, dropout, a shuffled grain pipeline, jaxckpt every 10 steps):

1. an uninterrupted reference run on a (data=4, model=2) mesh;
2. a checkpointed run on the same mesh that receives SIGTERM (a preemption notice) after
   step 25: it saves the step it is at and exits cleanly;
3. a new process resumes from that step on a (data=2, model=4) mesh (the restore reshards)
   and finishes: same data order, losses within 1e-5 of the reference;
4. another new process resumes from the same step on the original mesh: every loss and the
   final model and optimizer state are bitwise equal to the reference;
5. `jaxckpt ls` and `jaxckpt verify` check every step's files against their checksums;
6. the final step is exported to safetensors and loaded in transformers (same logits).

Everything lands in `runs/demo/`; a summary table ends it.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "configs" / "demo.yaml"
STEPS, PREEMPT_AFTER = 40, 25


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


def run(args: list[str], *, signal_after: str | None = None, timeout: float = 600):
    """Runs a Python script in a fresh process, streaming its output; with `signal_after`,
    sends it SIGTERM once it prints a line starting so. Returns (rc, output, seconds)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines = []
    for line in proc.stdout:
        line = line.rstrip()
        if "WARNING" in line or "Loading weights" in line:
            continue  # absl and transformers chatter
        lines.append(line)
        print(f"      | {line}", flush=True)
        if signal_after and line.startswith(signal_after):
            print("      > demo: SIGTERM (a preemption notice)", flush=True)
            proc.send_signal(signal.SIGTERM)
            signal_after = None
    rc = proc.wait(timeout=timeout)
    return rc, lines, time.perf_counter() - t0


def train(*args: str, **kwargs):
    return run(
        ["examples/train.py", f"--config={CONFIG}", f"--steps={STEPS}", "--print-every=5", *args],
        **kwargs,
    )


def check(rc: int, what: str) -> None:
    if rc != 0:
        raise SystemExit(f"demo: {what} exited {rc}")


def main() -> int:
    out = REPO / "runs" / "demo"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    ckpt, ckpt_same = out / "ckpt", out / "ckpt-same-mesh"
    print(f"jaxckpt demo: a GPT-2 trained {STEPS} steps on 8 CPU devices, in {out}", flush=True)
    rows = []

    print("[1/6] uninterrupted reference run, mesh data=4 x model=2", flush=True)
    rc, _, t = train("--mesh=4x2", f"--log={out / 'ref.jsonl'}", f"--final={out / 'ref.npz'}")
    check(rc, "the reference run")
    rows.append(("uninterrupted reference", "4x2", f"1-{STEPS}", t))

    print(f"[2/6] checkpointed run, mesh 4x2; SIGTERM after step {PREEMPT_AFTER}", flush=True)
    rc, lines, t = train(
        "--mesh=4x2",
        f"--ckpt-dir={ckpt}",
        "--save-every=10",
        f"--log={out / 'preempted.jsonl'}",
        signal_after=f"step {PREEMPT_AFTER}:",
    )
    check(rc, "the preempted run")
    saved = next(int(line.split()[3][:-1]) for line in lines if line.startswith("preempted: saved"))
    rows.append((f"preempted (SIGTERM), saved step {saved}", "4x2", f"1-{saved}", t))
    shutil.copytree(ckpt, ckpt_same)  # the same checkpoints, for the same-mesh resume

    print(f"[3/6] new process, mesh data=2 x model=4: resume from step {saved}", flush=True)
    rc, _, t = train("--mesh=2x4", f"--ckpt-dir={ckpt}", f"--log={out / 'other.jsonl'}")
    check(rc, "the resume on another mesh")
    rows.append(("resumed on another mesh", "2x4", f"{saved + 1}-{STEPS}", t))

    print(f"[4/6] new process, the original mesh 4x2: resume from step {saved}", flush=True)
    rc, _, t = train(
        "--mesh=4x2",
        f"--ckpt-dir={ckpt_same}",
        f"--log={out / 'same.jsonl'}",
        f"--final={out / 'same.npz'}",
    )
    check(rc, "the resume on the same mesh")
    rows.append(("resumed on the same mesh", "4x2", f"{saved + 1}-{STEPS}", t))

    print("[5/6] jaxckpt ls and verify", flush=True)
    rc, _, _ = run(["-m", "jaxckpt", "ls", str(ckpt)])
    check(rc, "jaxckpt ls")
    rc, verified, _ = run(["-m", "jaxckpt", "verify", str(ckpt)])
    check(rc, "jaxckpt verify")

    print("[6/6] export the final step to safetensors, load it in transformers", flush=True)
    rc, lines, _ = run(["examples/export_hf.py", f"--ckpt-dir={ckpt}", f"--out={out / 'hf'}"])
    check(rc, "the export")
    exported = json.loads(next(line for line in lines if line.startswith("RESULT "))[7:])

    # ------------------------------------------------------------------------ the verdict
    ref = {f: read_log(out / "ref.jsonl", f) for f in ("bits", "loss", "batch_crc")}
    before = {f: read_log(out / "preempted.jsonl", f) for f in ref}
    same = {f: {**before[f], **read_log(out / "same.jsonl", f)} for f in ref}
    other = {f: read_log(out / "other.jsonl", f) for f in ref}
    resumed_steps = range(saved + 1, STEPS + 1)
    bitwise = sum(same["bits"].get(s) == b for s, b in ref["bits"].items())
    n_leaves, bad_leaves = differing_leaves(out / "ref.npz", out / "same.npz")
    order = sum(other["batch_crc"].get(s) == ref["batch_crc"][s] for s in resumed_steps)
    rel = [abs(other["loss"][s] - ref["loss"][s]) / abs(ref["loss"][s]) for s in resumed_steps]
    close = sum(r <= 1e-5 for r in rel)
    steps_ok = sum(line.split(":")[1].strip().startswith("ok") for line in verified)
    checks = [
        (
            "same mesh: losses bitwise equal to the reference",
            f"{bitwise}/{STEPS}",
            bitwise == STEPS,
        ),
        (
            "same mesh: final model + optimizer leaves bitwise equal",
            f"{n_leaves - len(bad_leaves)}/{n_leaves}",
            not bad_leaves,
        ),
        (
            "other mesh: same batches (data order)",
            f"{order}/{len(resumed_steps)}",
            order == len(resumed_steps),
        ),
        (
            f"other mesh: losses within 1e-5 relative (max {max(rel):.1e})",
            f"{close}/{len(resumed_steps)}",
            close == len(resumed_steps),
        ),
        ("steps verified against their checksums", f"{steps_ok} ok", steps_ok >= 3),
        (
            "safetensors loaded in transformers: max |logit diff|",
            f"{exported['max_logit_diff']:.1e}",
            exported["max_logit_diff"] < 1e-4,
        ),
    ]
    print("\n  run                                   mesh  steps     wall time")
    for name, mesh, span, seconds in rows:
        print(f"  {name:<37} {mesh:<5} {span:<9} {seconds:>7.1f}s")
    print()
    for what, value, ok in checks:
        print(f"  {what:<58} {value:>9}  {'ok' if ok else 'FAILED'}")
    ok = all(passed for _, _, passed in checks)
    print("\n  RESULT: " + ("all checks passed" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

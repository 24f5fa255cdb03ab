"""Every small file of a checkpoint swollen to 1.5 GiB (sparse: 4 KiB on disk), one at a
time, then each reader run on it in this process: the growth of the peak RSS the OS
provided (VmHWM, reset before each) and how it ended, one JSON line a case on stdout.

    python -m tests.children.swollen OUT.jsonl [OLD_ORBAX_PYTHON]

Kinds: `jaxckpt` (steps 1 and 2: state, rng, data, meta), `local` (the same in a local
tier), `orbax` (plain Orbax's CheckpointManager, default item), `orbax-0.2.3` (its oldest
layout, written by OLD_ORBAX_PYTHON, when given). A case's outcome is "ok", "named: ..." (a
`jaxckpt.errors` exception, or the CLI's one-line error and a non-zero exit) or "raw: ..."
(anything else: a failure). Run by tests/test_bounded_reads.py.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from click.testing import CliRunner
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from jaxckpt.cli import main as cli

SWOLLEN = 3 * 2**29  # 1.5 GiB
SMALL = 2**20  # every file below this size is swollen in turn
REPO = Path(__file__).resolve().parents[2]


class Iterator:
    def __init__(self, position=0):
        self.position = position

    def get_state(self):
        return {"position": self.position}

    def set_state(self, state):
        self.position = state["position"]


def kib(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field))


def measured(run):
    """(MB the peak RSS grew by while `run()` ran, its outcome)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM back to the current RSS
    before = kib("VmRSS:")
    try:
        run()
        outcome = "ok"
    except jaxckpt.errors.JaxckptError as e:
        outcome = f"named: {type(e).__name__}: {str(e)[:300]}"
    except Exception as e:
        outcome = f"raw: {type(e).__module__}.{type(e).__name__}: {str(e)[:300]}"
    return (kib("VmHWM:") - before) / 1024, outcome


class CliFailed(jaxckpt.errors.JaxckptError):
    pass


def cli_run(*args):
    result = CliRunner().invoke(cli, list(args), catch_exceptions=True)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    last = (result.output.strip().splitlines() or [""])[-1]
    if result.exit_code and last.startswith("jaxckpt: error: "):
        raise CliFailed(last)
    if result.exit_code and not (args[0] == "diff" and result.exit_code == 1):  # 1: they differ
        raise RuntimeError(f"exit {result.exit_code}: {result.output[-300:]!r}")


def main(out_path, old_python=None):
    root = Path(tempfile.mkdtemp())
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    sharding = NamedSharding(mesh, P("data"))

    def state(step):
        w = jax.device_put(jnp.full((512, 1024), step, jnp.float32), sharding)
        return {"w": w, "b": np.full(4, step, np.float32)}

    target = {
        "w": jax.ShapeDtypeStruct((512, 1024), jnp.float32, sharding=sharding),
        "b": np.zeros(4, np.float32),
    }
    kinds = {}  # kind: (the directory, the step folder swollen, its readers)

    ours, local, persistent = root / "jaxckpt", root / "local", root / "persistent"
    tier = jaxckpt.LocalTier(local, every_steps=1, replicas=0)
    for directory, tiers in ((ours, None), (persistent, tier)):  # (the second: local only)
        # (format 2: `w` an Orbax array, whose metadata files are swollen too)
        with jaxckpt.CheckpointManager(directory, local=tiers, incremental=False) as m:
            for step in (1, 2):
                m.save(step, state=state(step), rng=jax.random.key(step), data=Iterator(step))

    def reading(directory, older, step, *, local=None, target=target):
        """Every reader of `step` (one that reads two steps: of `older` and `step`)."""
        out = root / "out"

        def restore():
            with jaxckpt.CheckpointManager(directory, local=local, read_only=not local) as m:
                m.restore(int(step), state=target, data=Iterator() if target else None)

        def cli(*args):
            return lambda: cli_run(*args)

        at = ("--step", step)
        return {
            "restore": restore,
            "open.read": lambda: jaxckpt.open(directory).read(int(step), state=target),
            "ls": cli("ls", str(directory)),
            "inspect": cli("inspect", *at, str(directory)),
            "inspect --data": cli("inspect", "--data", *at, str(directory)),
            "verify": cli("verify", str(directory)),
            "diff --values": cli("diff", "--values", str(directory), older, step),
            "plan": cli("plan", str(directory), *at, "--mesh", "2x4"),
            "export": cli("export", str(directory), str(out), *at),
            "export --format orbax": cli(
                "export", str(directory), str(out), *at, "--format", "orbax"
            ),
        }

    kinds["jaxckpt"] = (ours, "2", reading(ours, "1", "2"))

    def restore_latest():  # the newest local step that verifies, or else the one before
        with jaxckpt.CheckpointManager(persistent, local=tier) as m:
            m.restore(state=target, data=Iterator())

    kinds["local"] = (local, "2", {"restore": restore_latest})

    plain = root / "orbax"
    with ocp.CheckpointManager(plain) as m:
        for step in (1, 2):
            m.save(step, args=ocp.args.StandardSave(state(step)))

    kinds["orbax"] = (plain, "2", reading(plain, "1", "2", target=None))
    if old_python:
        subprocess.run(
            [old_python, str(REPO / "tests" / "old_orbax" / "write.py"), str(root / "old")],
            check=True,
            timeout=300,
            env={"PATH": os.environ["PATH"], "JAX_PLATFORMS": "cpu"},
            capture_output=True,
        )
        old = root / "old" / "manager"
        kinds["orbax-0.2.3"] = (old, "7", reading(old, "0", "7", target=None))

    with open(out_path, "w") as out:
        for kind, (directory, step, readers) in kinds.items():
            pristine = root / f"{kind}.pristine"
            shutil.copytree(directory, pristine, symlinks=True)
            small = sorted(
                str(p.relative_to(pristine / step))
                for p in (pristine / step).rglob("*")
                if p.is_file() and p.stat().st_size < SMALL
            )
            for rel in small:
                for entry, run in readers.items():
                    shutil.rmtree(directory, ignore_errors=True)
                    shutil.rmtree(root / "out", ignore_errors=True)
                    shutil.copytree(pristine, directory, symlinks=True)
                    os.truncate(directory / step / rel, SWOLLEN)
                    mb, outcome = measured(run)
                    case = {"kind": kind, "file": rel, "entry": entry, "mb": mb}
                    out.write(json.dumps(case | {"outcome": outcome}) + "\n")
                    out.flush()
            if kind == "jaxckpt":  # a merged index a one-process step does not use
                for entry in ("restore", "open.read", "export"):
                    shutil.rmtree(directory, ignore_errors=True)
                    shutil.rmtree(root / "out", ignore_errors=True)
                    shutil.copytree(pristine, directory, symlinks=True)
                    with open(directory / step / "packed" / "index.json", "wb") as f:
                        f.truncate(SWOLLEN)
                    mb, outcome = measured(readers[entry])
                    case = {"kind": kind, "file": "stray packed/index.json", "entry": entry}
                    out.write(json.dumps(case | {"mb": mb, "outcome": outcome}) + "\n")
                    out.flush()
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main(*sys.argv[1:])

"""What makes Orbax log, for tests/test_cli_messages.py to read on stderr: a read-only
manager, then a save whose commit fails in the background (its temporary folder made
immutable once the arrays are written); prints "caught: <the SaveError>" to stderr. Then
the same failure of a user's own plain Orbax save beside the open manager, which Orbax
logs as it does without jaxckpt; prints "plain: <its error>". `debug` turns on the
jaxckpt.orbax debug log.

    python -m children.orbax_noise DIRECTORY default|debug
"""

import glob
import logging
import subprocess
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp

import jaxckpt
from jaxckpt import _internals


def main() -> None:
    jax.config.update("jax_platforms", "cpu")
    directory, debug = sys.argv[1], sys.argv[2] == "debug"
    if debug:
        logging.basicConfig(format="%(levelname)s:%(name)s:%(message)s", force=True)
        logging.getLogger("jaxckpt.orbax").setLevel(logging.DEBUG)
    with jaxckpt.CheckpointManager(directory) as m:
        m.save(1, state={"x": np.arange(1024, dtype=np.float32)})
    reader = jaxckpt.CheckpointManager(directory, read_only=True)
    assert reader.restore().step == 1
    reader.close()

    m = jaxckpt.CheckpointManager(directory)
    tmp = f"{directory}/2.orbax-checkpoint-tmp"

    def immutable():  # step 2's arrays are written: its commit fails in the background
        subprocess.run(["chattr", "+i", tmp], check=True, timeout=30)

    try:
        with _internals.on_writes_done(immutable):
            m.save(2, state={"x": np.arange(1024, dtype=np.float32)})
            m.wait()
    except jaxckpt.errors.SaveError as e:
        print(f"caught: {e}", file=sys.stderr)
    finally:
        subprocess.run(["chattr", "-i", tmp], check=False, timeout=30)

    plain = f"{directory}-plain"

    def plain_immutable():
        for folder in glob.glob(f"{plain}/1.orbax-checkpoint-tmp*"):
            subprocess.run(["chattr", "+i", folder], check=True, timeout=30)

    try:
        with (
            _internals.on_writes_done(plain_immutable),
            ocp.AsyncCheckpointer(ocp.StandardCheckpointHandler()) as ckptr,
        ):
            ckptr.save(f"{plain}/1", args=ocp.args.StandardSave({"x": np.arange(8.0)}))
            ckptr.wait_until_finished()
    except Exception as e:
        print(f"plain: {type(e).__name__}", file=sys.stderr)
    finally:
        for folder in glob.glob(f"{plain}/1.orbax-checkpoint-tmp*"):
            subprocess.run(["chattr", "-i", folder], check=False, timeout=30)
    m.close()


if __name__ == "__main__":
    main()

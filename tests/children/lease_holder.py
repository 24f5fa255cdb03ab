"""Holds the writer lease of a gs:// or s3:// directory (2 s terms), says "holding", and
saves step 2 once a line comes on stdin; the parent (tests/test_lock.py) freezes it in
between, past its term. Prints "saved", or "refused: <the LockedError>".

    python -m children.lease_holder GS_OR_S3_DIRECTORY
"""

import sys

import jax
import numpy as np

import jaxckpt


def main() -> None:
    jax.config.update("jax_platforms", "cpu")
    m = jaxckpt.CheckpointManager(sys.argv[1], writer_lease_s=2)
    m.save(1, state={"x": np.ones(100, np.float32)})
    m.wait()
    print("holding", flush=True)
    sys.stdin.readline()  # the parent freezes us (SIGSTOP) here, then lets us go on
    try:
        m.save(2, state={"x": np.ones(100, np.float32)})
        m.wait()
        print("saved", flush=True)
    except jaxckpt.errors.LockedError as e:
        print("refused:", e, flush=True)
    m.close()


if __name__ == "__main__":
    main()

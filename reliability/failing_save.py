"""A script whose save fails, for `reliability.hostile`: saves step 1, then, on a directory
made immutable meanwhile ("immutable"), or until the parent's Ctrl-C ("interrupt"), saves
on and leaves without catching anything, like a training script would. It prints "saving"
just before the failing saves.

    python -m reliability.failing_save DIRECTORY immutable|interrupt TIMEOUT_S
"""

import signal
import subprocess
import sys

import jax
import numpy as np

import jaxckpt


def main() -> None:
    # Ctrl-C raises KeyboardInterrupt whatever this process inherited: a job started in the
    # background of a non-interactive shell ignores SIGINT, and so would its children.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    jax.config.update("jax_platforms", "cpu")
    directory, how, timeout_s = sys.argv[1], sys.argv[2], int(sys.argv[3])
    m = jaxckpt.CheckpointManager(directory, timeout_s=timeout_s)
    m.save(1, state={"x": np.arange(1024, dtype=np.float32)})
    m.wait()
    if how == "immutable":
        subprocess.run(["chattr", "+i", directory], check=True, timeout=30)
    print("saving", flush=True)
    # A script that meets the failure dies of it: no close(), no cleanup of its own.
    for step in range(2, 100_000):  # "interrupt": until the parent's Ctrl-C
        m.save(step, state={"x": np.arange(2**16, dtype=np.float32) + step})


if __name__ == "__main__":
    main()

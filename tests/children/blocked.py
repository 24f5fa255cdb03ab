"""A process blocked for good in a real restore (of 16 MiB, over and over) or wait (its
writer frozen once the arrays are written), for tests/test_preemption.py to signal. It
echoes jaxckpt's log records and its markers (BLOCKED, WAITING) to stdout, written with
os.write: atomic lines, safe from a signal handler and from two threads.

    python -m children.blocked DIRECTORY restore|wait
"""

import logging
import os
import sys
import threading

import jax
import numpy as np

import jaxckpt
from jaxckpt import _internals


def echo(text):
    os.write(1, (text + "\n").encode())


class Echo(logging.Handler):
    def emit(self, record):
        echo(record.getMessage())


def main() -> None:
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", 8)
    logging.getLogger("jaxckpt").addHandler(Echo())
    directory, blocked_in = sys.argv[1:]
    x = np.arange(4 * 2**20, dtype=np.float32)
    m = jaxckpt.CheckpointManager(directory)
    if blocked_in == "restore":
        m.save(1, state={"x": x})
        m.wait()
        echo("BLOCKED")
        while True:
            m.restore(state={"x": np.zeros_like(x)})
    else:

        def freeze():  # in Orbax's background thread: it never goes on
            echo("BLOCKED")
            threading.Event().wait()

        with _internals.on_writes_done(freeze):
            m.save(1, state={"x": x})
            echo("WAITING")
            m.wait()


if __name__ == "__main__":
    main()

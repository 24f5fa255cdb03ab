"""Saves observed from outside, for tests/test_async.py; the last stdout line is JSON.

python -m children.async_saves stop_after_save DIRECTORY
    saves 64 MiB, drops the device buffer, stops itself (SIGSTOP) the instant `save`
    returned, then (continued) waits and prints the committed steps;
python -m children.async_saves write_errors DIRECTORY
    with files over 1 MiB failing (RLIMIT_FSIZE: EFBIG, as on a full disk), reports what
    each of save, wait and close raised.
"""

import json
import os
import resource
import signal
import sys

import jax
import jax.numpy as jnp

import jaxckpt


def stop_after_save(directory: str) -> None:
    m = jaxckpt.CheckpointManager(directory)
    x = jnp.arange(16 * 1024 * 1024, dtype=jnp.float32)  # 64 MiB: the write takes a while
    m.save(1, state={"x": x})
    x.delete()  # the device buffer is gone: save must already hold a host copy
    os.kill(os.getpid(), signal.SIGSTOP)  # the parent looks at the directory now
    m.wait()
    print(json.dumps(m.all_steps()))
    m.close()


def write_errors(directory: str) -> None:
    # Files over 1 MiB fail with EFBIG, as on a full disk; ignore the signal, keep the error.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))
    small = {"w": jnp.arange(16.0)}
    big = {"w": jax.random.normal(jax.random.key(0), (1024, 1024))}  # 4 MiB, incompressible
    report = {}

    def attempt(name, fn):
        try:
            fn()
            report[name] = None
        except jaxckpt.errors.SaveError as e:
            report[name] = str(e)

    m = jaxckpt.CheckpointManager(directory)
    m.save(1, state=small)
    m.wait()
    m.save(2, state=big)  # returns: the failure happens later
    report["visible_after_save"] = m.all_steps()
    attempt("wait", m.wait)
    attempt("wait_again", m.wait)  # raised once, not forever
    m.save(3, state=big)
    attempt("save", lambda: m.save(4, state=small))
    m.save(4, state=small)  # the manager keeps working
    m.save(5, state=big)
    attempt("close", m.close)
    report["steps"] = jaxckpt.CheckpointManager(directory).all_steps()
    print(json.dumps(report))


def main() -> None:
    jax.config.update("jax_num_cpu_devices", 8)
    how, directory = sys.argv[1:]
    {"stop_after_save": stop_after_save, "write_errors": write_errors}[how](directory)


if __name__ == "__main__":
    main()

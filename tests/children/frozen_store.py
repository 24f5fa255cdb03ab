"""A store that stops answering while a user waits on it (tests/test_stalls_storage.py):
this process freezes the store's server itself (SIGSTOP to its process group), at a point
its manager's own seam arms (`reliability.faults.store`), times the call that waits,
resumes the server (SIGCONT) and reads the committed step back. One JSON line per call:
its name, the error's type and text, and how long it took.

    python -m children.frozen_store save|restore|steps URL SERVER_PID

`save`: step 1 saved, then step 2, the server frozen once `save(2)` returned: `wait()`
(raises the SaveError), then `close()` (the writer lease's release, nothing in flight).
`restore`: step 1 saved, then restored read-only, the server frozen once the restore
starts reading arrays: `restore()`.
Both then resume the server and restore step 1 in a new manager (`"call": "after"`).
`steps`: steps 1 and 2 saved, nothing frozen (for the commands a test then runs).
"""

import json
import os
import signal
import sys
import time

import jax
import numpy as np

import jaxckpt
from reliability import faults


def _state(step: int) -> dict:
    # 4 MiB: an Orbax array (tensorstore's HTTP), and a small leaf packed (fsspec's)
    return {"w": np.arange(1 << 20, dtype=np.float32) + step, "b": np.full(8, step, np.int32)}


def _report(call: str, run) -> None:
    start = time.monotonic()
    try:
        run()
        found = {"type": None, "message": ""}
    except Exception as e:
        found = {"type": type(e).__name__, "message": str(e)}
    seconds = round(time.monotonic() - start, 2)
    print(json.dumps({"call": call, **found, "seconds": seconds}), flush=True)


def main() -> None:
    jax.config.update("jax_platforms", "cpu")
    scenario, url, server = sys.argv[1], sys.argv[2], int(sys.argv[3])
    frozen = []

    def freeze() -> None:
        if not frozen:
            os.killpg(server, signal.SIGSTOP)
            frozen.append(True)

    if scenario == "steps":
        with jaxckpt.CheckpointManager(url) as m:
            m.save(1, state=_state(1))
            m.save(2, state=_state(2))
        return
    if scenario == "save":

        def save_then_freeze(real, info, *args, **kwargs):
            real(info, *args, **kwargs)
            if info.step == 2:  # its background now writes to a store that does not answer
                freeze()

        m = faults.manager(url, writer_lease_s=3, store=faults.store(save=save_then_freeze))
        m.save(1, state=_state(1))
        m.wait()
        m.save(2, state=_state(2))
        _report("wait", m.wait)
        _report("close", m.close)
    else:
        with jaxckpt.CheckpointManager(url) as m:
            m.save(1, state=_state(1))

        def freeze_then_read(real, *args, **kwargs):
            freeze()
            return real(*args, **kwargs)

        reader = faults.manager(
            url, read_only=True, store=faults.store(read_arrays=freeze_then_read)
        )
        _report("restore", lambda: reader.restore(step=1))
    os.killpg(server, signal.SIGCONT)

    def after() -> None:
        with jaxckpt.CheckpointManager(url, read_only=True) as m:
            assert m.all_steps()[0] == 1, m.all_steps()
            got = m.restore(step=1).state
        for name, value in _state(1).items():
            np.testing.assert_array_equal(np.asarray(got[name]), value)

    _report("after", after)
    sys.stdout.flush()
    os._exit(0)  # (threads left waiting on the store that froze are not waited for)


if __name__ == "__main__":
    main()

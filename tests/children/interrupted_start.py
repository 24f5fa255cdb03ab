"""A restore interrupted by KeyboardInterrupt (what Ctrl-C raises) at the moment its
verifying thread has started but the pool that started it has not counted it yet: the
process must still end, by SIGINT, as an uncaught Ctrl-C ends it. The interrupt is placed, never timed: a trace
function raises it on the line of `Thread.start` that waits for the new thread.

    python -m children.interrupted_start DIRECTORY
"""

import linecache
import sys
import threading

import numpy as np

import jaxckpt


def interrupt_once_started(frame, event, arg):
    if event == "call" and frame.f_code is threading.Thread.start.__code__:
        thread = frame.f_locals["self"]
        return _in_start if thread.name.startswith("jaxckpt-verify") else None
    return None


def _in_start(frame, event, arg):
    line = linecache.getline(frame.f_code.co_filename, frame.f_lineno)
    if event == "line" and "self._started.wait()" in line:
        sys.settrace(None)
        raise KeyboardInterrupt
    return _in_start


def main() -> None:
    directory = sys.argv[1]
    state = {"x": np.arange(1024, dtype=np.float32)}
    with jaxckpt.CheckpointManager(directory) as m:
        m.save(1, state=state)
        m.wait()
        sys.settrace(interrupt_once_started)
        try:
            m.restore(1, state=state)
        except KeyboardInterrupt:
            print("interrupted", flush=True)
            raise  # uncaught, as Ctrl-C's is: the traceback keeps the restore's frames
        finally:
            sys.settrace(None)
        print("not interrupted", flush=True)


if __name__ == "__main__":
    main()

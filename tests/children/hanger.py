"""A child that hangs, for tests/test_launch.py: prints each argument as a line, stops
itself (SIGSTOP) if the last one is "stop", or from a background thread that then prints
"ran on" if it is "stop-in-a-thread"; then sleeps until it is killed.

    python -m children.hanger [LINE...] [stop | stop-in-a-thread]
"""

import sys
import threading
import time

from reliability import faults


def _stop_then_print() -> None:
    faults.stop_here()
    print("ran on", flush=True)  # only once the process is continued: never, here


def main() -> None:
    lines = sys.argv[1:]
    for line in lines:
        print(line, flush=True)
    if lines[-1:] == ["stop"]:
        faults.stop_here()
    if lines[-1:] == ["stop-in-a-thread"]:
        threading.Thread(target=_stop_then_print).start()
    time.sleep(3600)  # the parent kills it long before


if __name__ == "__main__":
    main()

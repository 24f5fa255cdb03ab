"""A child that hangs, for tests/test_launch.py: prints each argument as a line, stops
itself (SIGSTOP) if the last one is "stop", then sleeps until it is killed.

    python -m children.hanger [LINE...] [stop]
"""

import os
import signal
import sys
import time


def main() -> None:
    lines = sys.argv[1:]
    for line in lines:
        print(line, flush=True)
    if lines[-1:] == ["stop"]:
        os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(3600)  # the parent kills it long before


if __name__ == "__main__":
    main()

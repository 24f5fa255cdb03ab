"""Opens a gs:// or s3:// directory every way a user does, against a store that is down or
refuses (tests/test_object_storage.py points this process's clients there), and prints
one JSON line per entry point: the error's type, its message, and how long it took.

    python -m children.store_errors URL
"""

import json
import sys
import time

import jaxckpt


def main() -> None:
    url = sys.argv[1]
    calls = {
        "CheckpointManager": lambda: jaxckpt.CheckpointManager(url).close(),
        "CheckpointManager(read_only=True)": lambda: jaxckpt.CheckpointManager(
            url, read_only=True
        ).close(),
        "jaxckpt.open": lambda: jaxckpt.open(url).close(),
        "jaxckpt.verify": lambda: jaxckpt.verify(url),
    }
    for name, call in calls.items():
        start = time.monotonic()
        try:
            call()
            found = {"type": None, "message": ""}
        except Exception as e:
            found = {"type": type(e).__name__, "message": str(e)}
        seconds = round(time.monotonic() - start, 1)
        print(json.dumps({"call": name, **found, "seconds": seconds}), flush=True)


if __name__ == "__main__":
    main()

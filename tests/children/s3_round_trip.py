"""Saves a step to an s3:// directory and restores it bitwise, then prints the S3
configuration jaxckpt resolved from this process's environment (tests/test_object_storage.py
runs it under a profile's endpoint, and under AWS_ENDPOINT_URL_S3).

    python -m children.s3_round_trip S3_DIRECTORY
"""

import sys

import numpy as np

import jaxckpt
from jaxckpt import _s3_endpoint


def main() -> None:
    x = np.arange(2**19, dtype=np.float32)  # 2 MiB: an Orbax array, through tensorstore
    with jaxckpt.CheckpointManager(sys.argv[1]) as m:
        m.save(1, state={"x": x})
    with jaxckpt.CheckpointManager(sys.argv[1], read_only=True) as m:
        assert m.restore().state["x"].tobytes() == x.tobytes()
    print(_s3_endpoint.s3_config())


if __name__ == "__main__":
    main()

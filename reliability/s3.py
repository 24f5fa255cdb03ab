"""A real S3 server on 127.0.0.1 for s3:// tests: moto's server (`moto[server]`, the same S3
API moto's users test against, conditional writes included), with boto3, s3fs and
tensorstore pointed at it by the standard AWS variables, and every AWS endpoint (the
instance-metadata service included) kept off the network.

`LOOPBACK_ENV` goes into the environment before boto3 or s3fs make a client (the test
session sets it in conftest.py); `start()` then runs the server on a free port, and
`point_at(url)` is what sends every client there.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import urllib.parse
import urllib.request
from pathlib import Path

from reliability import gcs, launch

LOOPBACK_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_REGION": "us-east-1",
    # No profile files (a developer's own ~/.aws is never read), no instance metadata.
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    "AWS_EC2_METADATA_DISABLED": "true",
    "AWS_EC2_METADATA_SERVICE_ENDPOINT": "http://127.0.0.1:9",
    # Until point_at: nothing reaches AWS even if a client is made before the server runs.
    "AWS_ENDPOINT_URL": "http://127.0.0.1:9",
}
BUCKET = "jaxckpt-test"
# The kinds of request `requests` tells apart: reliability.gcs's, for the same tables.
REQUEST_KINDS = gcs.REQUEST_KINDS
# A request in the log (werkzeug's): `"GET /bucket/key?query HTTP/1.1" 200 -`.
_REQUEST = re.compile(r'"([A-Z]+) (\S+) HTTP/[\d.]+"')


def start(log: Path, timeout_s: float = 60) -> tuple[subprocess.Popen, str]:
    """Starts the server with one bucket, `BUCKET`; returns the process and its URL. Its
    log has a line per request (`requests` reads them)."""
    url = f"http://127.0.0.1:{launch.free_port()}"
    command = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", url.rpartition(":")[2]]
    proc = launch.serve(command, log, f"{url}/moto-api/", "the S3 server", timeout_s, LOOPBACK_ENV)
    request = urllib.request.Request(f"{url}/{BUCKET}", method="PUT")  # CreateBucket
    urllib.request.urlopen(request, timeout=10).close()
    return proc, url


def point_at(url: str) -> dict[str, str]:
    """The environment that sends boto3, s3fs and (through jaxckpt) tensorstore to `url`."""
    return {"AWS_ENDPOINT_URL": url}


def stop(proc: subprocess.Popen) -> None:
    launch.stop_server(proc)


def requests(log: Path, since: int = 0) -> list[tuple[str, str]]:
    """The requests the server logged after byte `since` of its log, in order, each as its
    kind (one of REQUEST_KINDS) and the object's key (of a listing: its prefix)."""
    with log.open("rb") as f:
        f.seek(since)
        text = f.read().decode(errors="replace")
    found = []
    for method, target in _REQUEST.findall(text):
        path, _, query = target.partition("?")
        params = dict(urllib.parse.parse_qsl(query, keep_blank_values=True))
        bucket, _, key = urllib.parse.unquote(path).lstrip("/").partition("/")
        if bucket == "moto-api":
            continue
        if method == "GET" and not key:
            kind, key = (
                ("list" if "list-type" in params or "prefix" in params else "other"),
                (params.get("prefix", "")),
            )
        elif method == "GET":
            kind = "read"
        elif method == "HEAD":
            kind = "metadata"
        elif method in ("PUT", "POST") and key:
            kind = "write"
        elif method == "DELETE" or (method == "POST" and "delete" in params):
            kind = "delete"
        else:
            kind = "other"
        found.append((kind, key))
    return found

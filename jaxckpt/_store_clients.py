"""The store clients set to the give-up time (`jaxckpt._store_time`) when a gs:// or
s3:// directory is first reached (`configure`): fsspec's s3fs and gcsfs (epath's backends
too), as jaxckpt's own subclasses that try a request again (`jaxckpt._s3fs`,
`jaxckpt._gcsfs`), and tensorstore's curl, which reads its limits from the environment.
What the user set in fsspec's configuration or the environment is kept.
"""

from __future__ import annotations

import functools
import math
import os
from typing import Any

from jaxckpt._store_time import ATTEMPTS, botocore_settings, give_up_s

# tensorstore's HTTP (curl) reads its limits from the environment when it makes its
# transport: once a process, at its first request to a store.
_TENSORSTORE_LIMITS = (
    "TENSORSTORE_CURL_CONNECT_TIMEOUT_SECONDS",
    "TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS",
    "TENSORSTORE_CURL_LOW_SPEED_LIMIT_BYTES",
)
_set_in_environment: dict[str, str] = {}


def _tensorstore_limits(seconds: float) -> None:
    """curl's limits of tensorstore's requests for the give-up time: `seconds / ATTEMPTS`
    to connect, and an attempt given up once as long passed without a byte (curl looks
    once a second: counted in). What the user set is kept."""
    each = max(1, math.ceil(seconds / ATTEMPTS))
    values = (str(each), str(max(1, each - 1)), "1")
    for name, value in zip(_TENSORSTORE_LIMITS, values, strict=True):
        if os.environ.get(name) in (None, _set_in_environment.get(name)):
            os.environ[name] = _set_in_environment[name] = value


# fsspec's settings of each protocol as jaxckpt last set them: replaced when the give-up
# time changes, unless someone else set them since (their setting is kept).
_set_here: dict[tuple[str, str], Any] = {}


def configure(url: Any) -> None:
    """Sets the clients of `url`'s store to the give-up time now: fsspec's (s3fs, gcsfs:
    epath's too) and tensorstore's curl, unless tensorstore made its transport before;
    what the user set in fsspec's configuration or the environment is kept."""
    import fsspec

    protocol = str(url).partition("://")[0]
    seconds = give_up_s()
    if protocol in ("s3", "gs", "gcs"):
        _tensorstore_limits(seconds)
    if protocol == "s3":
        try:
            from jaxckpt._s3fs import bounded as bounded_s3
        except ImportError:  # no s3fs: `_storage.s3_config` says so
            return
        bounded_s3()
        options = fsspec.config.conf.setdefault("s3", {}).setdefault("config_kwargs", {})
        _set(options, "s3", botocore_settings(seconds, attempts=1))  # (`_retries`: again)
    elif protocol in ("gs", "gcs"):
        try:
            from jaxckpt._gcsfs import bounded
        except ImportError:  # no gcsfs: fsspec says so at the first request
            return
        bounded()
        _set(fsspec.config.conf.setdefault("gcs", {}), "gcs", _gcsfs_settings(seconds))


def _set(options: dict[str, Any], where: str, settings: dict[str, Any]) -> None:
    for name, value in settings.items():
        if name not in options or options[name] is _set_here.get((where, name)):
            options[name] = _set_here[where, name] = value


@functools.cache
def _gcsfs_settings(seconds: float) -> dict[str, Any]:
    import aiohttp

    each = seconds / ATTEMPTS  # (no total: a large object takes as long as it takes)
    return {"requests_timeout": aiohttp.ClientTimeout(sock_connect=each, sock_read=each)}

"""gcsfs (fsspec's gs://, epath's backend too) whose requests are tried again as
`_retries.retrying` tries them, all within a `_store_time.within` block's deadline.

gcsfs wraps one attempt of each request (its answer read whole) in its retries
(`gcsfs.retry.retry_request`), their number fixed when its class is made, 1 to 16 s apart:
an endpoint that refuses connections took 35 s to give up, and 6 answers of 503 in a row
failed a save. This class tries the same attempt again while it fails for a moment, as
`retrying` decides (or gcsfs's own `is_retriable`), for the give-up time; `bounded()` makes
it fsspec's gs:// and gcs:// (each request's timeouts are fsspec's configuration:
`_store_clients.configure`).
"""

from __future__ import annotations

import functools
from typing import Any

import fsspec
import gcsfs
from gcsfs.retry import is_retriable

from jaxckpt._retries import retrying
from jaxckpt._store_time import bounded_call

# (the `decorator` package, which made gcsfs's retries, keeps what it wrapped here)
_ONE_ATTEMPT = gcsfs.GCSFileSystem._request.__wrapped__


class GCSFileSystem(gcsfs.GCSFileSystem):
    """gcsfs's file system, each request tried again while it fails for a moment (for the
    give-up time), and given up at the deadline of the `within` block it was made in."""

    retries = 1

    async def _request(self, *args: Any, **kwargs: Any) -> Any:
        attempt = functools.partial(_ONE_ATTEMPT, self, *args, **kwargs)
        return await bounded_call(retrying(attempt, also=is_retriable))


@functools.cache
def bounded() -> None:
    """Makes `GCSFileSystem` fsspec's gs:// and gcs://, once."""
    for protocol in ("gs", "gcs"):
        fsspec.register_implementation(protocol, GCSFileSystem, clobber=True)

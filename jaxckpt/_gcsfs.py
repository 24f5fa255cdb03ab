"""gcsfs (fsspec's gs://, epath's backend too) with `_store_errors.ATTEMPTS` attempts a
request, not gcsfs's six, all within a `_store_errors.within` block's deadline.

gcsfs wraps one attempt of each request in its retries (`gcsfs.retry.retry_request`),
their number fixed when its class is made, and pauses 1, 2, 4, 8 and 16 s between them: an
endpoint that refuses connections took 35 s to give up. This class wraps the same attempt,
and gcsfs's same retries (which errors, the pauses), in fewer; `bounded()` makes it
fsspec's gs:// and gcs:// (each request's timeouts are fsspec's configuration:
`_store_errors.configure`).
"""

from __future__ import annotations

import functools
from typing import Any

import fsspec
import gcsfs
from gcsfs.retry import retry_request

from jaxckpt._store_errors import ATTEMPTS, bounded_call

# (the `decorator` package, which made gcsfs's retries, keeps what it wrapped here)
_ONE_ATTEMPT = gcsfs.GCSFileSystem._request.__wrapped__


class GCSFileSystem(gcsfs.GCSFileSystem):
    """gcsfs's file system, each request tried `ATTEMPTS` times at most, and given up at
    the deadline of the `within` block it was made in."""

    retries = ATTEMPTS
    _attempts = retry_request(_ONE_ATTEMPT, ATTEMPTS)

    async def _request(self, *args: Any, **kwargs: Any) -> Any:
        return await bounded_call(self._attempts(*args, **kwargs))


@functools.cache
def bounded() -> None:
    """Makes `GCSFileSystem` fsspec's gs:// and gcs://, once."""
    for protocol in ("gs", "gcs"):
        fsspec.register_implementation(protocol, GCSFileSystem, clobber=True)

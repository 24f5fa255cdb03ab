"""s3fs (fsspec's s3://, epath's backend too) with botocore's attempts as a request's only
ones, all within a `_store_errors.within` block's deadline.

botocore tries each request `_store_errors.ATTEMPTS` times (its `Config`, fsspec's
configuration: `_store_errors.configure`), and s3fs tried what botocore gave up on 5 times
more (`S3FileSystem.retries`, a class attribute): a store that does not answer was waited
for 5 times the give-up time. This class tries once; `bounded()` makes it fsspec's s3://.
"""

from __future__ import annotations

import functools
from typing import Any

import fsspec
import s3fs
from fsspec.asyn import sync_wrapper

from jaxckpt._store_errors import bounded_call


class S3FileSystem(s3fs.S3FileSystem):
    """s3fs's file system, each request botocore's attempts only, and given up at the
    deadline of the `within` block it was made in."""

    retries = 1

    async def _call_s3(self, method: Any, *args: Any, **kwargs: Any) -> Any:
        return await bounded_call(super()._call_s3(method, *args, **kwargs))

    call_s3 = sync_wrapper(_call_s3)  # (s3fs's own names its own `_call_s3`)


@functools.cache
def bounded() -> None:
    """Makes `S3FileSystem` fsspec's s3://, once."""
    fsspec.register_implementation("s3", S3FileSystem, clobber=True)

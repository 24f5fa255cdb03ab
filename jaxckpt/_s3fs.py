"""s3fs (fsspec's s3://, epath's backend too) whose requests are tried again as
`_retries.retrying` tries them, all within a `_store_time.within` block's deadline.

botocore tries each request once (its `Config`, fsspec's configuration:
`_store_clients.configure`) and so does s3fs (`S3FileSystem.retries`, a class attribute: it
tried what botocore gave up on 5 times more); this class tries each request again while it
fails for a moment, for the give-up time: an object's body read with the request that
fetched it (a connection cut short mid-body is tried again too). `bounded()` makes it
fsspec's s3://.
"""

from __future__ import annotations

import functools
from typing import Any

import fsspec
import s3fs
from fsspec.asyn import sync_wrapper

from jaxckpt._retries import retrying
from jaxckpt._store_time import bounded_call


class S3FileSystem(s3fs.S3FileSystem):
    """s3fs's file system, each request tried again while it fails for a moment (for the
    give-up time), and given up at the deadline of the `within` block it was made in."""

    retries = 1

    async def _call_s3(self, method: Any, *args: Any, **kwargs: Any) -> Any:
        parent = s3fs.S3FileSystem._call_s3
        return await bounded_call(retrying(lambda: parent(self, method, *args, **kwargs)))

    async def _cat_file(self, path: Any, *args: Any, **kwargs: Any) -> Any:
        parent = s3fs.S3FileSystem._cat_file
        return await bounded_call(retrying(lambda: parent(self, path, *args, **kwargs)))

    call_s3 = sync_wrapper(_call_s3)  # (s3fs's own names its own `_call_s3`)


@functools.cache
def bounded() -> None:
    """Makes `S3FileSystem` fsspec's s3://, once."""
    fsspec.register_implementation("s3", S3FileSystem, clobber=True)

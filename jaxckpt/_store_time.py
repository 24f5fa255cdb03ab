"""How long jaxckpt waits for a store (gs://, s3://): the give-up time `T`
(`JAXCKPT_STORAGE_TIMEOUT_S`, 30 s unless set), the settings it makes of each client's
attempts (botocore's, google-cloud-storage's), and `within(seconds)`, which bounds all the
requests s3fs and gcsfs make in a block, in all: an error path (the listing that words a
`SaveError`) never waits long on a store that just failed.

Left to their defaults, an endpoint that is down was retried for 5-13 s (botocore: 5
attempts), 35 s (gcsfs: 6, 1-16 s apart) or 2 minutes (google-cloud-storage), and one that
does not answer for minutes (botocore: 60 s a connection attempt; s3fs: 5 more tries of
each; tensorstore: no limit at all, and 32 tries). `T` bounds them all: each attempt of a
request waits at most `T / ATTEMPTS` to connect and as long for each part of an answer
(tensorstore: for a byte of it), and a request that fails for a moment is tried again for
about `T` (`jaxckpt._retries`); the clients are set to it by `jaxckpt._store_clients`.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import inspect
import math
import os
import time
from collections.abc import Awaitable, Iterator
from typing import Any, TypeVar

from jaxckpt.errors import ConfigError

R = TypeVar("R")

VARIABLE = "JAXCKPT_STORAGE_TIMEOUT_S"
DEFAULT_S = 30.0
ATTEMPTS = 3


def give_up_s() -> float:
    """The give-up time: `JAXCKPT_STORAGE_TIMEOUT_S`, or 30 s (ConfigError if it is not a
    number of seconds above 0)."""
    raw = os.environ.get(VARIABLE, "").strip()
    if not raw:
        return DEFAULT_S
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise ConfigError(f"{VARIABLE}={raw!r} is not a number of seconds above 0 (e.g. 30)")
    return seconds


@functools.cache
def botocore_settings(seconds: float, attempts: int = ATTEMPTS) -> dict[str, Any]:
    """botocore's `Config` for a give-up time (boto3's client, s3fs's `config_kwargs`):
    `attempts` of at most `seconds / ATTEMPTS` each."""
    each = seconds / ATTEMPTS
    # (botocore's `max_attempts` counts the retries only: 3 made 4 attempts)
    retries = {"total_max_attempts": attempts, "mode": "standard"}
    return {"connect_timeout": each, "read_timeout": each, "retries": retries}


def gcs_call_settings(*, once: bool = False) -> dict[str, Any]:
    """google-cloud-storage's `retry` and `timeout` of each call, for the give-up time
    (`once`: one attempt, of at most a third of it)."""
    from google.cloud.storage.retry import DEFAULT_RETRY

    seconds = give_up_s()
    retry = None if once else DEFAULT_RETRY.with_timeout(seconds)
    return {"retry": retry, "timeout": seconds / ATTEMPTS}


# The time left to the requests of a `within` block (monotonic), None outside one. A
# context variable: fsspec runs each request as a task of its own event loop's thread, made
# in a copy of the caller's context, so the block's deadline reaches it there.
_DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "jaxckpt_store_deadline", default=None
)


def time_left() -> float | None:
    """What is left of the `within` block this runs in (None outside one)."""
    deadline = _DEADLINE.get()
    return None if deadline is None else deadline - time.monotonic()


@contextlib.contextmanager
def within(seconds: float) -> Iterator[None]:
    """Every request s3fs and gcsfs make for this thread in the block (jaxckpt's and
    epath's) given up once `seconds` have passed since it began: fsspec's FSTimeoutError
    (which `storage_error` names as a store that did not answer), and none made after."""
    token = _DEADLINE.set(time.monotonic() + seconds)
    try:
        yield
    finally:
        _DEADLINE.reset(token)


async def bounded_call(call: Awaitable[R]) -> R:
    """`call` (one request of s3fs or gcsfs, all its attempts) within what is left of the
    `within` block it was made in, if any (asyncio.TimeoutError after)."""
    deadline = _DEADLINE.get()
    if deadline is None:
        return await call
    left = deadline - time.monotonic()
    if left <= 0:
        if inspect.iscoroutine(call):
            call.close()  # never started
        raise TimeoutError
    return await asyncio.wait_for(call, left)

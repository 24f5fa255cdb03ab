"""A store's passing failures tried again, within a time budget.

Object stores shed load: S3 answers 503 `SlowDown` and GCS 429 or 503, and both expect the
client to back off; connections are reset; a store restarts. Such a failure says nothing
of the data, and at pod scale it is not rare (at 10% of requests failed, three attempts a
request fail one request in a thousand: several a save). A request that meets one
(`transient`) is tried again after a pause that doubles from `FIRST_PAUSE_S` to
`MAX_PAUSE_S`, each with random jitter so that a pod's processes do not come back in step,
for as long as the give-up time (`JAXCKPT_STORAGE_TIMEOUT_S`, 30 s) from its first attempt:
throttling, resets or an outage of up to about that long pass unseen, while a store that
stays down, or does not answer (each attempt waiting at most a third of the give-up time),
is given up on within about the give-up time and a pause. Anything else (a missing object,
access refused, a failed condition) is raised at once.

Every request s3fs and gcsfs make for jaxckpt is tried here (`retrying`, from `_s3fs` and
`_gcsfs`, whose own retries are then one attempt); tensorstore's are sized the same way
(`tensorstore_retries`); the writer lease's requests through boto3 as blocking calls
(`retried`; google-cloud-storage retries its own for the give-up time).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from jaxckpt import _store_failures, _store_time

R = TypeVar("R")
log = logging.getLogger("jaxckpt")

FIRST_PAUSE_S = 0.2
MAX_PAUSE_S = 8.0
# S3's and GCS's answers of a store shedding load or failing for a moment, by error code.
_PASSING_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestThrottled",
        "RequestTimeout",
        "RequestTimeTooSkewed",
        "InternalError",
        "ServiceUnavailable",
        "OperationAborted",
    }
)
# A request is one attempt inside an attempt of another (s3fs reads an object's body
# around the request that fetched it): only the outer one tries again.
_INSIDE: contextvars.ContextVar[bool] = contextvars.ContextVar("jaxckpt_retrying", default=False)


def pause_s(attempt: int) -> float:
    """The pause before attempt `attempt + 1`: half the doubled base, and up to as much
    again at random."""
    base = min(MAX_PAUSE_S, FIRST_PAUSE_S * 2**attempt)
    return base / 2 + random.uniform(0, base / 2)


def transient(error: BaseException) -> bool:
    """Whether `error` (or one it was raised from) is a failure that passes: the store's 5xx,
    429 or 408, a throttling code, a connection refused, reset or cut short, a request that
    was not answered in time."""
    for cause in _store_failures.causes(error):
        status, code = _store_failures.status(cause)
        if code in _PASSING_CODES or status in (408, 429) or (status or 0) >= 500:
            return True
        if status is not None:  # the store answered otherwise: not passing
            return False
        if _store_failures.kind(cause) == "unreachable":
            return True
        if _store_failures.is_one(
            cause, "aiohttp", "ClientConnectionError", "ClientPayloadError", "ServerTimeoutError"
        ):
            return True
        if _store_failures.is_one(
            cause, "botocore.exceptions", "ResponseStreamingError", "IncompleteReadError"
        ):
            return True
        if isinstance(cause, ConnectionError | TimeoutError | asyncio.TimeoutError):
            return True
    return False


class _Tries:
    """One request's attempts: the pause before the next (None: give up), until the give-up
    time has passed since the first (or the `within` block it runs in ends)."""

    def __init__(self, also: Callable[[BaseException], bool] | None = None) -> None:
        self._end = time.monotonic() + _store_time.give_up_s()
        if (inside := _store_time.time_left()) is not None:
            self._end = min(self._end, time.monotonic() + inside)
        self._also, self._tried = also, 0

    def pause(self, error: BaseException) -> float | None:
        if not (transient(error) or (self._also is not None and self._also(error))):
            return None
        left = self._end - time.monotonic()
        if left <= 0:
            return None
        pause = min(pause_s(self._tried), left)
        self._tried += 1
        log.debug("the store failed a request (%s); again in %.1f s", error, pause)
        return pause


async def retrying(
    attempt: Callable[[], Awaitable[R]], *, also: Callable[[BaseException], bool] | None = None
) -> R:
    """`attempt()`, tried again while it fails as `transient` (or `also` says), for the
    give-up time from the first attempt (and no longer than the `within` block it runs in)."""
    if _INSIDE.get():
        return await attempt()
    token = _INSIDE.set(True)
    try:
        tries = _Tries(also)
        while True:
            try:
                return await attempt()
            except Exception as e:
                if (pause := tries.pause(e)) is None:
                    raise
                await asyncio.sleep(pause)
    finally:
        _INSIDE.reset(token)


def retried(call: Callable[[], R]) -> R:
    """`call()`, a blocking request, tried again as `retrying` tries one."""
    tries = _Tries()
    while True:
        try:
            return call()
        except Exception as e:
            if (pause := tries.pause(e)) is None:
                raise
            time.sleep(pause)


def tensorstore_retries(seconds: float) -> dict[str, Any]:
    """tensorstore's request retries for a give-up time: the same pauses, as many as fill
    `seconds` (tensorstore counts attempts, not time; its default: 32, up to 32 s apart).
    Each attempt of a store that does not answer waits a third of the give-up time: such a
    store is given up on after every attempt's, not after `seconds`."""
    retries, waited = 0, 0.0
    while waited < seconds:
        waited += min(MAX_PAUSE_S, FIRST_PAUSE_S * 2**retries)
        retries += 1
    pauses = {"initial_delay": f"{FIRST_PAUSE_S}s", "max_delay": f"{MAX_PAUSE_S}s"}
    return {"max_retries": retries, **pauses}


def with_store_context(spec: Any) -> Any:
    """A kvstore spec with each gcs or s3 driver in it given the context of its retries
    (`tensorstore_retries` of the give-up time; a context the spec has already is kept)."""
    if isinstance(spec, list):
        return [with_store_context(s) for s in spec]
    if not isinstance(spec, dict):
        return spec
    spec = {key: with_store_context(value) for key, value in spec.items()}
    if spec.get("driver") in ("gcs", "s3") and "context" not in spec:
        retries = tensorstore_retries(_store_time.give_up_s())
        spec["context"] = {f"{spec['driver']}_request_retries": retries}
    return spec

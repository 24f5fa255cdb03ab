"""A store (gs://, s3://) that does not answer, or refuses: how long jaxckpt waits for it,
and its failure as one named error, `StorageError`, whichever client met it.

Five clients talk to the stores under jaxckpt, each with its own exceptions and retries:
s3fs and boto3 (over botocore), gcsfs and google-cloud-storage, and tensorstore's own HTTP
(the arrays and OCDBT's files, read and written through Orbax). Left to their defaults, an
endpoint that is down was retried for 5-13 s (botocore: 5 attempts), 35 s (gcsfs: 6, 1-16 s
apart) or 2 minutes (google-cloud-storage), and one that does not answer for minutes
(botocore: 60 s a connection attempt; s3fs: 5 more tries of each; tensorstore: no limit
at all, and 32 tries); then `EndpointConnectionError`, `ClientConnectorError`, ...
surfaced raw.

The give-up time `T` (`JAXCKPT_STORAGE_TIMEOUT_S`, 30 s unless set) bounds them all: each
attempt of a request waits at most `T / ATTEMPTS` to connect and as long for each part of
an answer (tensorstore: for a byte of it), and a request that fails for a moment is tried
again for about `T` (`jaxckpt._retries`: s3fs and gcsfs in subclasses of their file
systems, `jaxckpt._s3fs` and `jaxckpt._gcsfs`; google-cloud-storage for `T`; tensorstore,
which reads curl's limits from the environment, set here unless the user set them, as many
times as fill it). A store that stays down or does not answer is given up on in about `T`
and a pause.
`within(seconds)` bounds all the requests s3fs and gcsfs make in a block, in all: an error
path (the listing that words a `SaveError`) never waits long on a store that just failed.

`reaching(url)` turns what the clients raise into `StorageError`, where a user enters
jaxckpt (`naming_the_store`: a `CheckpointManager`, `jaxckpt.open` and all that opens
through it; `naming_its_store`: a call of an open one, naming what it did); the CLI does
the same for whatever a command meets.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import inspect
import math
import os
import re
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, ParamSpec, TypeVar

from jaxckpt.errors import ConfigError, JaxckptError, StorageError

P = ParamSpec("P")
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


def gcs_to_s3(spec: Any) -> Any:
    """A kvstore spec with each of its GCS drivers (`{"driver": "gcs", "bucket", "path"}`)
    replaced by the s3 one of the same bucket and path."""
    from jaxckpt._storage import s3_kvstore

    if isinstance(spec, list):
        return [gcs_to_s3(s) for s in spec]
    if not isinstance(spec, dict):
        if isinstance(spec, str) and spec.startswith("gs://"):
            raise ValueError(f"an Orbax kvstore spec names {spec!r}: no s3:// for it")
        return spec
    if spec.get("driver") in ("gcs", "gcs_grpc"):
        return s3_kvstore(f"s3://{spec['bucket']}/{spec.get('path', '')}")
    return {key: gcs_to_s3(value) for key, value in spec.items()}


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


def naming_the_store(function: Callable[P, R]) -> Callable[P, R]:
    """`function` (of a `directory`: where a user enters jaxckpt), the failures of that
    directory's store raised as `StorageError` (`reaching`)."""
    signature = inspect.signature(function)

    @functools.wraps(function)
    def entered(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            directory = signature.bind_partial(*args, **kwargs).arguments.get("directory")
        except TypeError:  # arguments it does not take: the call itself says which
            directory = None
        with reaching(directory):
            return function(*args, **kwargs)

    return entered


def naming_its_store(doing: str) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """A method of an object with a `directory` (an open manager, checkpoint), its store's
    failures raised as `StorageError` (`reaching`) that say what it was `doing`."""

    def wrap(method: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(method)
        def called(*args: P.args, **kwargs: P.kwargs) -> R:
            with reaching(getattr(args[0], "directory", None), doing):
                return method(*args, **kwargs)

        return called

    return wrap


@contextlib.contextmanager
def reaching(url: Any, doing: str | None = None) -> Iterator[None]:
    """Raises a store's failure met inside (`storage_error`) as `StorageError` (saying
    what jaxckpt was `doing`, if given). A FileNotFoundError (NoCheckpointError too) met
    inside on object storage is one when the bucket itself is missing (one request to learn
    it, then)."""
    try:
        yield
    except Exception as e:
        found = storage_error(url, e, doing)
        if found is None and isinstance(e, FileNotFoundError):
            answer = _no_bucket(url)
            found = None if answer is None else StorageError(_message(url, "bucket", answer))
        if found is None:
            raise
        raise found from e


def storage_error(url: Any, error: BaseException, doing: str | None = None) -> StorageError | None:
    """`error` as a `StorageError` that names the store of `url` and what to check, if it
    (or an error it was raised from) is one of the store's failures: it could not be
    reached or did not answer, it refused the credentials or the access, its bucket is
    missing, it failed; None for anything else (a missing object, jaxckpt's own errors).
    `doing`: what jaxckpt was doing, and with which object ("reading state of step 3
    (gs://b/run/3/state)"), said first."""
    if url is None or "://" not in str(url) or isinstance(error, JaxckptError):
        return None
    for cause in causes(error):
        found = kind(cause)
        if found is not None:
            return StorageError(_message(url, found, cause, doing))
    return None


def store_failed(url: Any, error: BaseException) -> bool:
    """Whether `error` is the failure of `url`'s store (`storage_error`), raw or named:
    asking the store again (to hash, to list) then only waits on it once more."""
    return isinstance(error, StorageError) or storage_error(url, error) is not None


def causes(error: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    while error is not None and id(error) not in seen and len(seen) < 16:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__  # type: ignore[assignment]


# S3's error codes of credentials or access refused, and of a bucket that is not there.
_REFUSED_CODES = frozenset(
    {
        "AccessDenied",
        "AllAccessDisabled",
        "ExpiredToken",
        "InvalidAccessKeyId",
        "InvalidToken",
        "SignatureDoesNotMatch",
    }
)


def kind(error: BaseException) -> str | None:
    """What kind of failure of the store `error` is: "unreachable", "refused", "bucket",
    "failed" (the store's 5xx or 429), or None (not one)."""
    answered, code = status(error)
    if code == "NoSuchBucket":
        return "bucket"
    if answered in (401, 403) or code in _REFUSED_CODES:
        return "refused"
    if answered is not None and (answered >= 500 or answered == 429):  # (429: too many)
        return "failed"
    if is_one(error, "botocore.exceptions", "NoCredentialsError", "PartialCredentialsError"):
        return "refused"
    if is_one(error, "google.auth.exceptions", "DefaultCredentialsError", "RefreshError"):
        return "refused"
    # gcsfs raises a 403 as a plain OSError with this text (gcsfs.retry.validate_response)
    if type(error) is OSError and str(error).startswith("Forbidden: "):
        return "refused"
    # (Only the clients' own: a local tier's or a peer's OSError is not the store's.)
    if is_one(error, "fsspec.exceptions", "FSTimeoutError"):
        return "unreachable"
    if is_one(error, "botocore.exceptions", "ConnectionError", "ReadTimeoutError"):
        return "unreachable"
    if is_one(error, "aiohttp", "ClientConnectionError"):
        return "unreachable"
    if is_one(error, "requests.exceptions", "ConnectionError", "Timeout"):
        return "unreachable"
    if is_one(error, "google.api_core.exceptions", "RetryError"):  # its deadline passed
        return "unreachable"
    if isinstance(error, ValueError) and _TENSORSTORE_UNANSWERED.match(str(error)):
        return "unreachable"
    return None


# tensorstore's error (a ValueError holding its status) once its HTTP request gave up:
# "ABORTED: All 3 retry attempts failed: CURL error Timeout was reached: ...", "UNAVAILABLE:
# ... CURL error Couldn't connect to server", ...
_TENSORSTORE_UNANSWERED = re.compile(
    r"(ABORTED|UNAVAILABLE|DEADLINE_EXCEEDED): .*(retry attempts failed|CURL error)", re.S
)


def status(error: BaseException) -> tuple[int | None, str | None]:
    """The HTTP status and the store's error code an error carries, if any."""
    response = getattr(error, "response", None)
    if is_one(error, "botocore.exceptions", "ClientError") and isinstance(response, dict):
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return status, response.get("Error", {}).get("Code")
    if is_one(error, "google.api_core.exceptions", "GoogleAPICallError"):
        return getattr(error, "code", None), None
    if is_one(error, "gcsfs.retry", "HttpError"):
        return getattr(error, "code", None), None
    return None, None


def is_one(error: BaseException, module: str, *names: str) -> bool:
    """An instance of one of `module`'s classes `names`; False if it was never imported
    (then nothing raised one)."""
    found = sys.modules.get(module)
    kinds = tuple(getattr(found, name, None) for name in names)
    return any(isinstance(error, kind) for kind in kinds if isinstance(kind, type))


def _no_bucket(url: Any) -> BaseException | None:
    """The store's answer if it says that `url`'s bucket does not exist (one request to
    ask); None if it exists, or the store cannot say."""
    import fsspec

    protocol, _, path = str(url).partition("://")
    bucket = path.partition("/")[0]
    if protocol not in ("s3", "gs") or not bucket:
        return None
    try:
        configure(url)
        fs = fsspec.filesystem(protocol)
        if protocol == "s3":
            fs.call_s3("list_objects_v2", Bucket=bucket, MaxKeys=1)
        else:
            fs.call("GET", "b/{}", bucket)
    except FileNotFoundError as e:
        return e.__cause__ or e  # (S3's NoSuchBucket, as s3fs met it)
    except Exception:  # it exists and refuses us, or the store is down: not this error
        return None
    return None


# What to check, by store, for each kind of failure.
_ENDPOINT = {
    "s3": "the endpoint (AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL or the profile's "
    "endpoint_url; AWS's own when none)",
    "gs": "the endpoint (STORAGE_EMULATOR_HOST for an emulator; Google's own when none)",
}
_CREDENTIALS = {
    "s3": "the credentials (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or the "
    "instance's role)",
    "gs": "the credentials (gcloud auth application-default login, or the VM's service account)",
}


def _message(url: Any, kind: str, error: BaseException, doing: str | None = None) -> str:
    named = f"{url}: {doing}" if doing else str(url)
    protocol = str(url).partition("://")[0]
    protocol = "gs" if protocol == "gcs" else protocol
    bucket = str(url).partition("://")[2].partition("/")[0]
    at = _endpoint(protocol)
    said = " ".join(f"{type(error).__name__}: {error}".split())
    said = said if len(said) <= 400 else said[:400] + "..."
    if kind == "unreachable":
        return (
            f"{named}: the store at {at} could not be reached ({said}); jaxckpt gives up on a "
            f"store within {give_up_s():g} s ({VARIABLE} sets it). Check "
            f"{_ENDPOINT.get(protocol, 'the endpoint')}, the network, and that the store is up."
        )
    if kind == "refused":
        return (
            f"{named}: the store at {at} refused access ({said}). Check "
            f"{_CREDENTIALS.get(protocol, 'the credentials')}, and that they may list, read "
            f"and write the bucket {bucket}."
        )
    if kind == "bucket":
        return (
            f"{named}: the store at {at} has no bucket {bucket} ({said}). Check the bucket's "
            f"name and {_ENDPOINT.get(protocol, 'the endpoint')}, or create the bucket."
        )
    return f"{named}: the store at {at} failed ({said}). Try again, or check the store's status."


def _endpoint(protocol: str) -> str:
    if protocol == "s3":
        from jaxckpt._storage import s3_config

        try:
            return s3_config().endpoint or "AWS"
        except ConfigError:
            return "AWS"
    if protocol == "gs":
        return os.environ.get("STORAGE_EMULATOR_HOST") or "https://storage.googleapis.com"
    return protocol

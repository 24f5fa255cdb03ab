"""A store (gs://, s3://) that does not answer, or refuses: how long jaxckpt waits for it,
and its failure as one named error, `StorageError`, whichever client met it.

Four clients talk to the stores under jaxckpt, each with its own exceptions and retries:
s3fs and boto3 (over botocore), gcsfs and google-cloud-storage. Left to their defaults, an
endpoint that is down was retried for 5-13 s (botocore: 5 attempts), 35 s (gcsfs: 6, 1-16 s
apart) or 2 minutes (google-cloud-storage), and one that does not answer for minutes
(botocore: 60 s a connection attempt); then `EndpointConnectionError`,
`ClientConnectorError`, ... surfaced raw.

The give-up time `T` (`JAXCKPT_STORAGE_TIMEOUT_S`, 30 s unless set) bounds them all: a
request is tried `ATTEMPTS` times at most (google-cloud-storage: for `T` at most), each
attempt waiting at most `T / ATTEMPTS` to connect and as long for each part of an answer.
An endpoint that refuses connections is given up in a few seconds (the pauses between
attempts), one that does not answer in about `T` (on S3 up to 5 `T`: s3fs retries a request
that timed out 5 times itself, its class's number). tensorstore's own retries (the arrays)
are not changed here.

`reaching(url)` turns what the clients raise into `StorageError`, where a user enters
jaxckpt (`naming_the_store`: a `CheckpointManager`, `jaxckpt.open` and all that opens
through it); the CLI does the same for whatever a command meets.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import os
import sys
from collections.abc import Callable, Iterator
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
def botocore_settings(seconds: float) -> dict[str, Any]:
    """botocore's `Config` for a give-up time (boto3's client, s3fs's `config_kwargs`)."""
    each = seconds / ATTEMPTS
    retries = {"max_attempts": ATTEMPTS, "mode": "standard"}
    return {"connect_timeout": each, "read_timeout": each, "retries": retries}


def gcs_call_settings() -> dict[str, Any]:
    """google-cloud-storage's `retry` and `timeout` of each call, for the give-up time."""
    from google.cloud.storage.retry import DEFAULT_RETRY

    seconds = give_up_s()
    return {"retry": DEFAULT_RETRY.with_timeout(seconds), "timeout": seconds / ATTEMPTS}


# fsspec's settings of each protocol as jaxckpt last set them: replaced when the give-up
# time changes, unless someone else set them since (their setting is kept).
_set_here: dict[tuple[str, str], Any] = {}


def configure(url: Any) -> None:
    """Sets fsspec's client of `url`'s store (s3fs, gcsfs: epath's too) to the give-up time
    now; what the user set in fsspec's configuration is kept."""
    import fsspec

    protocol = str(url).partition("://")[0]
    seconds = give_up_s()
    if protocol == "s3":
        options = fsspec.config.conf.setdefault("s3", {}).setdefault("config_kwargs", {})
        _set(options, "s3", botocore_settings(seconds))
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


@contextlib.contextmanager
def reaching(url: Any) -> Iterator[None]:
    """Raises a store's failure met inside (`storage_error`) as `StorageError`. A
    FileNotFoundError (NoCheckpointError too) met inside on object storage is one when the
    bucket itself is missing (one request to learn it, then)."""
    try:
        yield
    except Exception as e:
        found = storage_error(url, e)
        if found is None and isinstance(e, FileNotFoundError):
            answer = _no_bucket(url)
            found = None if answer is None else StorageError(_message(url, "bucket", answer))
        if found is None:
            raise
        raise found from e


def storage_error(url: Any, error: BaseException) -> StorageError | None:
    """`error` as a `StorageError` that names the store of `url` and what to check, if it
    (or an error it was raised from) is one of the store's failures: it could not be
    reached or did not answer, it refused the credentials or the access, its bucket is
    missing, it failed; None for anything else (a missing object, jaxckpt's own errors)."""
    if url is None or "://" not in str(url) or isinstance(error, JaxckptError):
        return None
    for cause in _causes(error):
        kind = _kind(cause)
        if kind is not None:
            return StorageError(_message(url, kind, cause))
    return None


def _causes(error: BaseException) -> Iterator[BaseException]:
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


def _kind(error: BaseException) -> str | None:
    """What kind of failure of the store `error` is: "unreachable", "refused", "bucket",
    "failed" (the store's 5xx), or None (not one)."""
    status, code = _status(error)
    if code == "NoSuchBucket":
        return "bucket"
    if status in (401, 403) or code in _REFUSED_CODES:
        return "refused"
    if status is not None and status >= 500:
        return "failed"
    if _is(error, "botocore.exceptions", "NoCredentialsError", "PartialCredentialsError"):
        return "refused"
    if _is(error, "google.auth.exceptions", "DefaultCredentialsError", "RefreshError"):
        return "refused"
    # gcsfs raises a 403 as a plain OSError with this text (gcsfs.retry.validate_response)
    if type(error) is OSError and str(error).startswith("Forbidden: "):
        return "refused"
    # (Only the clients' own: a local tier's or a peer's OSError is not the store's.)
    if _is(error, "fsspec.exceptions", "FSTimeoutError"):
        return "unreachable"
    if _is(error, "botocore.exceptions", "ConnectionError", "ReadTimeoutError"):
        return "unreachable"
    if _is(error, "aiohttp", "ClientConnectionError"):
        return "unreachable"
    if _is(error, "requests.exceptions", "ConnectionError", "Timeout"):
        return "unreachable"
    if _is(error, "google.api_core.exceptions", "RetryError"):  # its deadline passed
        return "unreachable"
    return None


def _status(error: BaseException) -> tuple[int | None, str | None]:
    """The HTTP status and the store's error code an error carries, if any."""
    response = getattr(error, "response", None)
    if _is(error, "botocore.exceptions", "ClientError") and isinstance(response, dict):
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return status, response.get("Error", {}).get("Code")
    if _is(error, "google.api_core.exceptions", "GoogleAPICallError"):
        return getattr(error, "code", None), None
    if _is(error, "gcsfs.retry", "HttpError"):
        return getattr(error, "code", None), None
    return None, None


def _is(error: BaseException, module: str, *names: str) -> bool:
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


def _message(url: Any, kind: str, error: BaseException) -> str:
    protocol = str(url).partition("://")[0]
    protocol = "gs" if protocol == "gcs" else protocol
    bucket = str(url).partition("://")[2].partition("/")[0]
    at = _endpoint(protocol)
    said = " ".join(f"{type(error).__name__}: {error}".split())
    said = said if len(said) <= 400 else said[:400] + "..."
    if kind == "unreachable":
        return (
            f"{url}: the store at {at} could not be reached ({said}); jaxckpt gives up on a "
            f"store within {give_up_s():g} s ({VARIABLE} sets it). Check "
            f"{_ENDPOINT.get(protocol, 'the endpoint')}, the network, and that the store is up."
        )
    if kind == "refused":
        return (
            f"{url}: the store at {at} refused access ({said}). Check "
            f"{_CREDENTIALS.get(protocol, 'the credentials')}, and that they may list, read "
            f"and write the bucket {bucket}."
        )
    if kind == "bucket":
        return (
            f"{url}: the store at {at} has no bucket {bucket} ({said}). Check the bucket's "
            f"name and {_ENDPOINT.get(protocol, 'the endpoint')}, or create the bucket."
        )
    return f"{url}: the store at {at} failed ({said}). Try again, or check the store's status."


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

"""A store (gs://, s3://) that does not answer, or refuses: its failure as one named
error, `StorageError`, whichever client met it, naming the store, its endpoint and what
to check. `reaching(url)` turns what the clients raise into `StorageError` where a user
enters jaxckpt (`naming_the_store`: a `CheckpointManager`, `jaxckpt.open` and all that
opens through it; `naming_its_store`: a call of an open one, naming what it did); the CLI
does the same for whatever a command meets. What the failure is: `jaxckpt._store_failures`;
how long a store is waited for: `jaxckpt._store_time`.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
from collections.abc import Callable, Iterator
from typing import Any, ParamSpec, TypeVar

from jaxckpt._s3_endpoint import s3_config
from jaxckpt._store_clients import configure
from jaxckpt._store_failures import causes, kind
from jaxckpt._store_time import VARIABLE, give_up_s
from jaxckpt.errors import ConfigError, JaxckptError, StorageError

P = ParamSpec("P")
R = TypeVar("R")


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
        try:
            return s3_config().endpoint or "AWS"
        except ConfigError:
            return "AWS"
    if protocol == "gs":
        return os.environ.get("STORAGE_EMULATOR_HOST") or "https://storage.googleapis.com"
    return protocol

"""What a store client's failure is, whichever client raised it (s3fs and boto3 over
botocore, gcsfs, google-cloud-storage, tensorstore): the errors it was raised from
(`causes`), the HTTP status and error code it carries (`status`), and its kind (`kind`:
unreachable, refused, no such bucket, failed), for the retries (`jaxckpt._retries`) and for
the `StorageError` that names it (`jaxckpt._store_errors`).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator


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

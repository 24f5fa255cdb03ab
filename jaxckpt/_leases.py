"""The writer lease's object on object storage: written only on a condition the store
decides (create if absent, replace or delete if unchanged), through each store's own SDK
(google-cloud-storage, boto3), as fsspec has no conditional writes. `jaxckpt._lock`'s
`ObjectLease` is its one user; what else differs between stores is `jaxckpt._storage`'s.
"""

from __future__ import annotations

import contextlib
import datetime
import email.utils
import functools
import os
from collections.abc import Iterator
from typing import Any

from jaxckpt._retries import retried
from jaxckpt._s3_endpoint import S3Config, s3_config
from jaxckpt._storage import bucket_and_key
from jaxckpt._store_time import botocore_settings, gcs_call_settings, give_up_s
from jaxckpt.errors import ConfigError


class Conflict(Exception):
    """A conditional write or delete the store refused: the object exists (a create) or
    changed since the version given."""


class _LeaseObject:
    """One object written only on a condition the store decides (the writer lease,
    `jaxckpt._lock.ObjectLease`): `create` if absent, `replace`/`delete` if unchanged since
    `version` (Conflict otherwise). A version is opaque (a GCS generation, an S3 ETag).
    Any other error of the store is OSError. `clock_resolution_s`: how coarse the store's
    times are (`current`, `server_now`)."""

    clock_resolution_s = 0.0

    def create(self, data: bytes) -> Any:
        raise NotImplementedError

    def replace(self, data: bytes, version: Any) -> Any:
        raise NotImplementedError

    def current(self) -> tuple[Any, datetime.datetime] | None:
        """The object's version and when it was last written, by the store's clock; None
        if there is none."""
        raise NotImplementedError

    def fetch(self, version: Any = None) -> bytes | None:
        """The object's bytes if it is still at `version` (None: whatever it is now); None
        if it changed or is gone. At most MAX_LEASE_BYTES + 1 of them are asked for: a
        longer object is no lease jaxckpt wrote, and reads as the garbage it is."""
        raise NotImplementedError

    def delete(self, version: Any, *, once: bool = False) -> None:
        """`once`: one attempt, of at most a third of the give-up time (a writer's release:
        a lease left behind expires by itself)."""
        raise NotImplementedError

    def server_now(self) -> datetime.datetime:
        """The store's clock now (host clocks do not matter)."""
        raise NotImplementedError


MAX_LEASE_BYTES = 2**16  # a lease is ~150 bytes of JSON


class _NoRange(OSError):
    """A range the store refused: of an empty object."""


def lease_object(url: str) -> _LeaseObject | None:
    """The object at `url` for a lease, on a store that has conditional writes (gs://,
    s3://); None on any other."""
    if url.startswith("gs://"):
        return _GcsObject(url)
    if url.startswith("s3://"):
        return _S3Object(url)
    return None


class _GcsObject(_LeaseObject):
    """Generation preconditions (`ifGenerationMatch`, 0: absent). Each call is retried
    for the give-up time at most (`_store_time.gcs_call_settings`), not the client's
    two minutes."""

    def __init__(self, url: str):
        self._bucket, self._name = bucket_and_key(url)

    def _blob(self) -> Any:
        return _gcs_client().bucket(self._bucket).blob(self._name)

    def create(self, data: bytes) -> Any:
        return self.replace(data, 0)

    def replace(self, data: bytes, version: Any) -> Any:
        blob = self._blob()
        with _gcs_errors():
            blob.upload_from_string(
                data, "application/json", if_generation_match=version, **gcs_call_settings()
            )
        return blob.generation

    def current(self) -> tuple[Any, datetime.datetime] | None:
        with _gcs_errors():
            blob = _gcs_client().bucket(self._bucket).get_blob(self._name, **gcs_call_settings())
        return None if blob is None else (blob.generation, blob.updated)

    def fetch(self, version: Any = None) -> bytes | None:
        try:
            with _gcs_errors():
                blob = self._blob()
                got = blob.download_as_bytes(
                    start=0, end=MAX_LEASE_BYTES, if_generation_match=version, **gcs_call_settings()
                )
                return bytes(got)
        except _NoRange:  # an empty object: a range of it is refused
            return b""
        except (Conflict, FileNotFoundError):
            return None

    def delete(self, version: Any, *, once: bool = False) -> None:
        with _gcs_errors():
            self._blob().delete(if_generation_match=version, **gcs_call_settings(once=once))

    def server_now(self) -> datetime.datetime:
        probe = _gcs_client().bucket(self._bucket).blob(f"{self._name}.probe-{os.urandom(8).hex()}")
        with _gcs_errors():
            probe.upload_from_string(b"", **gcs_call_settings())
            try:
                return probe.time_created
            finally:
                probe.delete(**gcs_call_settings())


@functools.cache
def _gcs_client() -> Any:
    try:
        from google.cloud import storage
    except ImportError as e:
        raise ConfigError(
            "gs:// directories need google-cloud-storage and gcsfs: pip install 'jaxckpt[gcs]'"
        ) from e
    # STORAGE_EMULATOR_HOST (an emulator) is honoured by the client itself.
    return storage.Client()


@contextlib.contextmanager
def _gcs_errors() -> Iterator[None]:
    """google-cloud-storage's errors as `_LeaseObject`'s."""
    from google.api_core import exceptions

    try:
        yield
    except exceptions.PreconditionFailed as e:
        raise Conflict(str(e)) from e
    except exceptions.NotFound as e:
        raise FileNotFoundError(str(e)) from e
    except exceptions.RequestRangeNotSatisfiable as e:
        raise _NoRange(str(e)) from e
    except (exceptions.GoogleAPICallError, exceptions.RetryError) as e:  # (retried too long)
        raise OSError(str(e)) from e


class _S3Object(_LeaseObject):
    """S3's conditional writes: `If-None-Match: *` to create, `If-Match: <ETag>` to
    replace or delete (AWS since 2024; MinIO, Ceph and moto have them too). Its times are
    HTTP dates, in whole seconds."""

    clock_resolution_s = 1.0

    def __init__(self, url: str):
        self._bucket, self._key = bucket_and_key(url)

    def create(self, data: bytes) -> Any:
        return self._put(data, IfNoneMatch="*")

    def replace(self, data: bytes, version: Any) -> Any:
        try:
            return self._put(data, IfMatch=version)
        except FileNotFoundError as e:  # S3 answers 404, not 412, once it is gone
            raise Conflict(str(e)) from e

    def _put(self, data: bytes, **condition: str) -> Any:
        """The conditional write, tried again while the store fails for a moment
        (`_retries.retried`). An attempt whose answer was lost may have landed: the next
        one then finds its condition failed by its own bytes, which is no conflict."""
        attempts = 0

        def put() -> Any:
            nonlocal attempts
            attempts += 1
            with _s3_errors():
                found = _s3_client().put_object(
                    Bucket=self._bucket, Key=self._key, Body=data, **condition
                )
                return found["ETag"]

        try:
            return retried(put)
        except Conflict:
            if attempts > 1 and (now := self.current()) is not None and self.fetch(now[0]) == data:
                return now[0]
            raise

    def current(self) -> tuple[Any, datetime.datetime] | None:
        try:
            with _s3_errors():
                found = retried(
                    lambda: _s3_client().head_object(Bucket=self._bucket, Key=self._key)
                )
        except FileNotFoundError:
            return None
        return found["ETag"], found["LastModified"]

    def fetch(self, version: Any = None) -> bytes | None:
        condition = {} if version is None else {"IfMatch": version}
        at_most = f"bytes=0-{MAX_LEASE_BYTES}"
        try:
            with _s3_errors():
                return retried(
                    lambda: bytes(
                        _s3_client()
                        .get_object(Bucket=self._bucket, Key=self._key, Range=at_most, **condition)[
                            "Body"
                        ]
                        .read(MAX_LEASE_BYTES + 1)
                    )
                )
        except _NoRange:  # an empty object: a range of it is refused
            return b""
        except (Conflict, FileNotFoundError):
            return None

    def delete(self, version: Any, *, once: bool = False) -> None:
        def delete() -> None:
            with _s3_errors():
                _s3_client().delete_object(Bucket=self._bucket, Key=self._key, IfMatch=version)

        delete() if once else retried(delete)

    def server_now(self) -> datetime.datetime:
        with _s3_errors():
            found = retried(lambda: _s3_client().head_bucket(Bucket=self._bucket))
        return email.utils.parsedate_to_datetime(found["ResponseMetadata"]["HTTPHeaders"]["date"])


def _s3_client() -> Any:
    return _s3_client_for(s3_config(), give_up_s())


@functools.cache
def _s3_client_for(config: S3Config, give_up_s: float) -> Any:
    """A client of `config`'s endpoint that gives up on an attempt in a third of
    `give_up_s` (`_store_errors`), trying each request once (`_retries.retried` tries
    again)."""
    import boto3
    import botocore.config

    style = {"addressing_style": config.addressing_style} if config.addressing_style else None
    settings = botocore.config.Config(s3=style, **botocore_settings(give_up_s, attempts=1))
    return boto3.session.Session().client("s3", region_name=config.region, config=settings)


@contextlib.contextmanager
def _s3_errors() -> Iterator[None]:
    """boto3's errors as `_LeaseObject`'s: 412 (and 409, a conditional write that raced
    another) Conflict, 404 FileNotFoundError, any other OSError."""
    import botocore.exceptions

    try:
        yield
    except botocore.exceptions.ClientError as e:
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if status in (409, 412):
            raise Conflict(str(e)) from e
        if status == 404:
            raise FileNotFoundError(str(e)) from e
        if status == 416:
            raise _NoRange(str(e)) from e
        raise OSError(str(e)) from e
    except botocore.exceptions.BotoCoreError as e:
        raise OSError(str(e)) from e

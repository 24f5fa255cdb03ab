"""Where S3 requests go, as the AWS SDK resolves it (`s3_config`: every AWS tool's
configuration), and tensorstore's kvstore spec of an s3:// path that goes there too
(`s3_kvstore`; `gcs_to_s3` for the specs Orbax builds of a gs:// path), so that the arrays
go where the listings do.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import urllib.parse
from typing import Any

import fsspec

from jaxckpt.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class S3Config:
    """Where S3 requests go, as the AWS SDK resolves it (again whenever one of
    `_S3_VARIABLES` changes).

    `endpoint`: a custom endpoint (`AWS_ENDPOINT_URL_S3`, `AWS_ENDPOINT_URL`, or a profile's
    `endpoint_url`), None for AWS's own. `region`: `AWS_REGION`, `AWS_DEFAULT_REGION` or the
    profile's; None: the store's default (tensorstore asks the bucket). `addressing_style`:
    the profile's `s3.addressing_style`, else "path" for a custom endpoint (MinIO, Ceph and
    most S3-compatible stores serve no bucket-named hosts), else None (the SDK's choice).
    Credentials are the SDK's chain (variables, `AWS_PROFILE` and its files, the
    instance's role): never read here.
    """

    endpoint: str | None
    region: str | None
    addressing_style: str | None


# The variables that change where S3 requests go (`s3_config` is resolved again if one does).
_S3_VARIABLES = (
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_PROFILE",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "AWS_CONFIG_FILE",
)


def s3_config() -> S3Config:
    """The S3 configuration (`S3Config`) of the environment now; s3fs (epath's s3://
    backend too) is set to use it."""
    return _s3_config(tuple(os.environ.get(name) for name in _S3_VARIABLES))


@functools.cache
def _s3_config(variables: tuple[str | None, ...]) -> S3Config:  # (`variables`: the key)
    try:
        import boto3
        import botocore.exceptions
        import botocore.session
        import s3fs  # noqa: F401  (epath's backend for s3:// paths)
    except ImportError as e:
        raise ConfigError("s3:// directories need s3fs and boto3: pip install 'jaxckpt[s3]'") from e
    core = botocore.session.get_session()
    try:
        session = boto3.session.Session(botocore_session=core)
        url = session.client("s3").meta.endpoint_url
        profile = core.get_scoped_config().get("s3")
    except botocore.exceptions.BotoCoreError as e:  # a profile named but not there, ...
        raise ConfigError(f"the AWS configuration cannot be used for s3:// directories: {e}") from e
    custom = not (urllib.parse.urlsplit(url).hostname or "").endswith(".amazonaws.com")
    style = (profile if isinstance(profile, dict) else {}).get("addressing_style")
    style = style or ("path" if custom else None)
    # AWS_REGION is the SDKs' standard variable; botocore reads only AWS_DEFAULT_REGION.
    region = os.environ.get("AWS_REGION") or session.region_name
    options = fsspec.config.conf["s3"]  # (an explicit setting is kept)
    if style is not None:  # (config_kwargs also holds the give-up time's settings)
        options.setdefault("config_kwargs", {}).setdefault("s3", {"addressing_style": style})
    if region is not None:
        options.setdefault("client_kwargs", {"region_name": region})
    return S3Config(url if custom else None, region, style)


def s3_kvstore(url: str) -> dict[str, Any]:
    """tensorstore's kvstore spec of an s3:// folder or object, with `s3_config`'s endpoint
    and region, so that the arrays go where the listings do (tensorstore's s3 driver reads no
    endpoint from the environment or a profile). It finds the credentials itself, through
    the same chain: variables, AWS_PROFILE's files, the instance's role."""
    bucket, _, key = str(url).partition("://")[2].partition("/")
    config = s3_config()
    spec: dict[str, Any] = {"driver": "s3", "bucket": bucket, "path": key}
    if config.endpoint is not None:
        spec["endpoint"] = config.endpoint
    if config.region is not None:
        spec["aws_region"] = config.region
    return spec


def gcs_to_s3(spec: Any) -> Any:
    """A kvstore spec with each of its GCS drivers (`{"driver": "gcs", "bucket", "path"}`)
    replaced by the s3 one of the same bucket and path."""
    if isinstance(spec, list):
        return [gcs_to_s3(s) for s in spec]
    if not isinstance(spec, dict):
        if isinstance(spec, str) and spec.startswith("gs://"):
            raise ValueError(f"an Orbax kvstore spec names {spec!r}: no s3:// for it")
        return spec
    if spec.get("driver") in ("gcs", "gcs_grpc"):
        return s3_kvstore(f"s3://{spec['bucket']}/{spec.get('path', '')}")
    return {key: gcs_to_s3(value) for key, value in spec.items()}

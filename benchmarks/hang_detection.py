"""Hang detection: what a heartbeat costs, what the watchdog adds to a start, and how
long after the last heartbeat a hung node is ended.

    python benchmarks/hang_detection.py [--beats 200000] [--starts 15] [--hangs 3]

1. Heartbeat: `shardctl.train.heartbeat.beat()` into a folder under $TMPDIR (what a
   rank does once per step under the watchdog), mean µs per call.
2. Start-up: `python -m shardctl.train.watchdog -- true` vs `true` alone, median wall
   of `--starts` runs (the watchdog's import, its folder, the child, the exit).
3. Detection: the stand-in ranks of tests/data/watchdog (rank 1 stuck in a function,
   rank 0 waiting) under the real watchdog with hang timeouts of 5 and 15 s: seconds
   from the last heartbeat to the watchdog's exit 124 (the timeout, then at most one
   poll, the stack collection and the kill), and what that is beyond the timeout.

Prints JSON, and Markdown rows with --markdown.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FAKE = ROOT / "tests" / "data" / "watchdog"


def beat_cost(n: int) -> float:
    from shardctl.train import heartbeat

    with tempfile.TemporaryDirectory() as folder:
        os.environ["SHARDCTL_HEARTBEAT_DIR"] = folder
        os.environ.setdefault("RANK", "0")
        heartbeat._writer_ready = False
        heartbeat.beat(0)
        t0 = time.perf_counter()
        for step in range(n):
            heartbeat.beat(step)
        took = time.perf_counter() - t0
        os.close(heartbeat._writer.fd)  # type: ignore[union-attr]
        heartbeat._writer, heartbeat._writer_ready = None, False
        del os.environ["SHARDCTL_HEARTBEAT_DIR"]
    return took / n * 1e6


def _wall(argv: list[str], n: int) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        subprocess.run(argv, check=True, stderr=subprocess.DEVNULL)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def detection(timeout_s: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        (run_dir / "logs").mkdir(parents=True)
        env = {
            **os.environ, "SHARDCTL_RUN_DIR": str(run_dir),
            "SHARDCTL_HANG_TIMEOUT_S": str(timeout_s), "FAKE_OUT": tmp,
        }  # fmt: skip
        env.pop("SHARDCTL_HEARTBEAT_DIR", None)
        argv = [sys.executable, "-m", "shardctl.train.watchdog", "--", sys.executable,
                str(FAKE / "fake_launcher.py"), "2", "stuck"]  # fmt: skip
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
        ended = time.time()
        assert proc.returncode == 124, proc.stderr[-2000:]
        marker = json.loads((run_dir / "HUNG").read_text())
        report = Path(marker["report"]).read_text()
        assert report.count("Python stack") == 2
        # The stand-in ranks beat every 0.1 s; the last beat is ~idle_s before the verdict.
        declared = marker["time"]
        last_beat = declared - marker["idle_s"]
        return {
            "timeout_s": timeout_s,
            "last_beat_to_exit_s": round(ended - last_beat, 2),
            "beyond_timeout_s": round(ended - last_beat - timeout_s, 2),
            "declared_to_exit_s": round(ended - declared, 2),
        }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--beats", type=int, default=200_000)
    ap.add_argument("--starts", type=int, default=15)
    ap.add_argument("--hangs", type=int, default=3)
    ap.add_argument("--markdown", action="store_true")
    a = ap.parse_args()
    result = {
        "beat_us": round(beat_cost(a.beats), 2),
        "start_true_s": round(_wall(["true"], a.starts), 4),
        "start_watchdog_s": round(
            _wall([sys.executable, "-m", "shardctl.train.watchdog", "--", "true"], a.starts), 4
        ),
        "detection": [detection(t) for t in (5, 15) for _ in range(a.hangs)],
        "load_avg": round(os.getloadavg()[0], 2),
    }
    print(json.dumps(result, indent=2))
    if a.markdown:
        extra = result["start_watchdog_s"] - result["start_true_s"]
        print(f"| heartbeat | {result['beat_us']} µs per step |")
        print(f"| watchdog start-up | +{extra:.3f} s per node start |")
        for t in (5, 15):
            rows = [d for d in result["detection"] if d["timeout_s"] == t]
            beyond = [d["beyond_timeout_s"] for d in rows]
            print(
                f"| detection, timeout {t} s | last beat → exit 124: median "
                f"{statistics.median(d['last_beat_to_exit_s'] for d in rows):.2f} s "
                f"(beyond the timeout {min(beyond):.2f}–{max(beyond):.2f} s) |"
            )


if __name__ == "__main__":
    main()

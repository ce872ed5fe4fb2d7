"""A stand-in launcher for the watchdog's tests: starts N ranks of fake_rank.py.

    python fake_launcher.py N MODE   → every rank runs `fake_rank.py MODE` with RANK=i;
                                       exits with the first non-zero rank code (0 if none).
On SIGTERM it writes `launcher-got-TERM` into $FAKE_OUT and exits 7 (what the
signal-forwarding test looks for).
"""

import os
import signal
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent


def main() -> int:
    n, mode = int(sys.argv[1]), sys.argv[2]
    out = Path(os.environ.get("FAKE_OUT", "."))

    def on_term(signum, frame):
        (out / "launcher-got-TERM").write_text("yes\n")
        sys.exit(7)

    signal.signal(signal.SIGTERM, on_term)
    ranks = [
        subprocess.Popen(
            [sys.executable, str(HERE / "fake_rank.py"), mode],
            env={**os.environ, "RANK": str(i)},
        )
        for i in range(n)
    ]
    (out / "rank-pids").write_text(" ".join(str(p.pid) for p in ranks) + "\n")
    codes = [p.wait() for p in ranks]
    return next((c for c in codes if c), 0)


if __name__ == "__main__":
    sys.exit(main())

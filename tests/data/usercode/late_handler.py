"""A script that installs its SIGUSR2 handler late, as one that builds its model first:
it says it is ready (`ready-<rank>` holding its pid, in the folder given), waits until
the test touches `install` there, then installs a handler — its own `signal.signal`
(`own`) or shardctl's preemption flag (`shardctl`) — and waits for the signal for at
most 60 s. It prints `got SIGUSR2` when its handler has it and ends with 0; with 3
when the signal never came."""

import os
import signal
import sys
import time
from pathlib import Path

folder, mode = Path(sys.argv[1]), sys.argv[2]
rank = os.environ.get("RANK", "0")
(folder / f"ready-{rank}.tmp").write_text(str(os.getpid()))
(folder / f"ready-{rank}.tmp").rename(folder / f"ready-{rank}")  # whole when seen
deadline = time.monotonic() + 60
while not (folder / "install").exists() and time.monotonic() < deadline:
    time.sleep(0.05)

got: list[int] = []
if mode == "own":
    signal.signal(signal.SIGUSR2, lambda signum, frame: got.append(signum))
else:
    from shardctl.train.preemption import PreemptionFlag

    flag = PreemptionFlag()
    flag.install()
while time.monotonic() < deadline:
    signum = got[0] if got else (flag.signum if mode != "own" else None)
    if signum is not None:
        print(f"got {signal.Signals(signum).name}", flush=True)
        sys.exit(0)
    time.sleep(0.05)
sys.exit(3)

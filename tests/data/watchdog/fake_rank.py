"""A stand-in rank for the watchdog's tests: beats like a training rank.

Every rank installs its handlers, writes `rank-<R>-ready` into $FAKE_OUT, beats
`start` (the process group is up), beats step 0 `step` (training begins, as the
built-in loop does after its restore), then 20 steps of 0.1 s.

Modes: `ok` (20 quick steps, then finish), `stuck` (rank 1 stops beating after 3
steps, inside `stuck_in_a_collective`; the others keep waiting without beating, as
ranks blocked in a collective do), `slow` (steps 1-4 of rank 1 sleep 2.5 s each:
alive but slow), `exit3` (rank 0 exits 3 after 2 steps), `wait` (every rank writes
`rank-<R>-waiting` and sleeps in step 3 until the test signals it),
`startup-slow` (every rank stays $FAKE_STARTUP_S seconds in start-up, inside
`importing_slowly`, then trains), `startup-stuck` (every rank stays in start-up,
inside `stuck_in_startup`). On SIGUSR2 a rank writes `rank-<R>-got-USR2`.
"""

import os
import signal
import sys
import time
from pathlib import Path

from shardctl.train import heartbeat


def stuck_in_a_collective() -> None:
    time.sleep(3600)


def waiting_for_peers() -> None:
    time.sleep(3600)


def importing_slowly(seconds: float) -> None:
    time.sleep(seconds)


def stuck_in_startup() -> None:
    time.sleep(3600)


def main() -> int:
    mode = sys.argv[1]
    rank = int(os.environ["RANK"])
    out = Path(os.environ.get("FAKE_OUT", "."))
    signal.signal(signal.SIGUSR2, lambda s, f: (out / f"rank-{rank}-got-USR2").write_text("yes\n"))
    heartbeat.install_stack_dump()
    (out / f"rank-{rank}-ready").write_text("yes\n")  # the handlers are installed
    heartbeat.beat(None, "start")
    if mode == "startup-slow":
        importing_slowly(float(os.environ["FAKE_STARTUP_S"]))
    if mode == "startup-stuck":
        stuck_in_startup()
    heartbeat.beat(0, "step")  # training begins
    for step in range(1, 21):
        time.sleep(0.1)
        if mode == "stuck" and step == 4:
            if rank == 1:
                stuck_in_a_collective()
            waiting_for_peers()
        if mode == "slow" and rank == 1 and step <= 4:
            time.sleep(2.5)
        if mode == "exit3" and rank == 0 and step == 3:
            return 3
        if mode == "wait" and step == 3:
            (out / f"rank-{rank}-waiting").write_text("yes\n")
            time.sleep(3600)  # killed by the test's signal
        heartbeat.beat(step)
    heartbeat.beat(20, "finish")
    return 0


if __name__ == "__main__":
    sys.exit(main())

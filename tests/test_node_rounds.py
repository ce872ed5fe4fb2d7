"""Rounds of restarts inside a Slurm allocation, between the node tasks.

A node whose launcher is still inside a round that node 0 has already ended (its
ranks waiting in a collective or a rendezvous that will never complete) stops that
launcher and everything below it, tells node 0 its round is over, and starts the next
round; node 0 starts the next round only once every node said so (bounded). Without
it, a 32-node restart on the dev cluster found some nodes in the old round's
rendezvous for its 10-minute timeout while the others had moved on.

Runs `NodeTask` itself (no Slurm needed): the launcher is a stand-in script."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from shardctl.orchestrator.clusters.slurm.rounds import ack_round, wait_for_acks

LAUNCH = """#!/usr/bin/env bash
# Round 0: stuck (a child that never ends, as a rank waiting in a rendezvous would).
if [ "${SHARDCTL_RESTART}" = "0" ]; then
  sleep 600 &
  echo $! > "$OUT/stuck.pid"
  touch "$OUT/round0-started"
  wait
fi
echo "round ${SHARDCTL_RESTART}" > "$OUT/next-round"
"""

TASK = """
import sys
from shardctl.orchestrator.clusters.slurm import NodeTask
task = NodeTask(command=["bash", sys.argv[1]], run_dir=sys.argv[2], max_restarts=2)
print("RESULT", task(), flush=True)
"""


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"no {path.name} after {timeout} s"
        time.sleep(0.1)


def _gone(pid: int, timeout: float = 30) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return True
        if state == "Z":
            return True
        time.sleep(0.1)
    return False


@pytest.mark.timeout(120)
def test_a_node_still_in_an_ended_round_stops_its_launcher_and_starts_the_next(
    tmp_path: Path,
) -> None:
    run_dir, out = tmp_path / "run", tmp_path / "out"
    run_dir.mkdir()
    out.mkdir()
    launch = tmp_path / "launch.sh"
    launch.write_text(LAUNCH)
    env = {
        **os.environ, "OUT": str(out), "SLURM_NODEID": "1", "SLURM_JOB_ID": "7",
        "SLURM_RESTART_COUNT": "0", "SLURM_JOB_NUM_NODES": "2",
    }  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-c", TASK, str(launch), str(run_dir)], env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        _wait_for(out / "round0-started", proc)
        stuck = int((out / "stuck.pid").read_text())
        # Node 0 ended round 0 and decided a restart.
        decision = {"job": "7", "requeue": 0, "restart": 0, "decision": "restart"}
        (run_dir / "RESTART").write_text(json.dumps(decision) + "\n")
        output, _ = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    assert "RESULT finished" in output, output
    assert "this node's launcher of round 0 was stopped" in output, output
    assert _gone(stuck), "the stuck round's process outlived its round"
    assert (out / "next-round").read_text() == "round 1\n"
    # Node 0 learns that this node's round 0 is over (and round 1's, as it ended).
    assert (run_dir / "rounds" / "7-0-r0.node1").exists()


def test_node_0_waits_for_every_node_to_end_the_round_bounded(tmp_path: Path) -> None:
    run_dir = str(tmp_path)

    def acknowledge() -> None:
        for node in (1, 2, 3):
            time.sleep(0.3)
            ack_round(run_dir, "9", 1, 2, node)

    writer = threading.Thread(target=acknowledge)
    writer.start()
    try:
        assert wait_for_acks(run_dir, "9", 1, 2, nodes=4, wait_s=60) == []
    finally:
        writer.join()
    # Its acknowledgements are cleaned up; another round's are not counted.
    assert not list((tmp_path / "rounds").glob("9-1-r2.*"))
    ack_round(run_dir, "9", 1, 3, 1)
    started = time.monotonic()
    assert wait_for_acks(run_dir, "9", 1, 2, nodes=3, wait_s=1.0) == [1, 2]
    assert time.monotonic() - started >= 1.0

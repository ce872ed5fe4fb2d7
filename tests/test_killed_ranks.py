"""A rank killed on a node is pinned there from its launcher's own report (KILLED).

The requeue that leaves the node behind is test_slurm_hang.py's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.ckpt_run import free_port
from shardctl.orchestrator.clusters.slurm.killed_ranks import (
    killed_rank,
    record_killed,
)
from shardctl.orchestrator.outcome import Evidence, classify
from shardctl.orchestrator.rundir import KILLED_FILE

# Rank 1 of two kills itself with the signal it is given once both are up; rank 0
# waits in a collective for it, as a training rank would.
SCRIPT = """
import os, signal, sys
import torch.distributed as dist
dist.init_process_group("gloo")
dist.barrier()
if dist.get_rank() == 1:
    os.kill(os.getpid(), getattr(signal, sys.argv[1]))
dist.barrier()
"""


@pytest.fixture(scope="module")
def killed_report(tmp_path_factory: pytest.TempPathFactory) -> str:
    """What torchrun wrote to its stderr when rank 1 was SIGKILLed (a real launch)."""
    folder = tmp_path_factory.mktemp("killed")
    script = folder / "kill_self.py"
    script.write_text(SCRIPT)
    log = folder / "launcher.err"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with log.open("w") as err:
        proc = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
             "--master-port", str(free_port()), str(script), "SIGKILL"],
            stdout=subprocess.DEVNULL, stderr=err, env=env, timeout=240, check=False,
        )  # fmt: skip
    assert proc.returncode != 0
    return log.read_text()


def test_the_real_launchers_report_names_the_killed_rank(killed_report: str) -> None:
    assert killed_rank(killed_report) == (1, 9), killed_report[-3000:]


def test_only_a_nodes_signal_pins_it(killed_report: str) -> None:
    # The same report with another first cause: an abort, a TERM, an error exit.
    for code in ("-6", "-15", "1"):
        text = killed_report.replace("exitcode  : -9", f"exitcode  : {code}")
        assert killed_rank(text) is None, code
    assert killed_rank(killed_report.replace("exitcode  : -9", "exitcode  : -7")) == (1, 7)
    assert killed_rank("Traceback (most recent call last):\nValueError: x\n") is None


def test_the_node_task_records_this_attempts_kill_once(
    killed_report: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLURMD_NODENAME", "n2")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    log = tmp_path / "task.err"
    # An earlier attempt's report lies before this attempt's offset: not read.
    log.write_text(killed_report)
    offset = log.stat().st_size
    started = time.time()
    assert record_killed(str(run_dir), 1, (str(log), offset), started) == ""
    assert not (run_dir / KILLED_FILE).exists()
    with log.open("a") as f:
        f.write("[shardctl] node 1: running launch.sh\n" + killed_report)
    said = record_killed(str(run_dir), 1, (str(log), offset), started)
    assert said == "rank 1 was killed by SIGKILL on this node (n2)"
    marker = json.loads((run_dir / KILLED_FILE).read_text())
    assert {k: marker[k] for k in ("rank", "node", "host", "signal", "code")} == {
        "rank": 1, "node": 1, "host": "n2", "signal": "SIGKILL", "code": 137,
    }  # fmt: skip
    out = classify(Evidence.gather(run_dir, started, 1))
    assert out.pinned and (out.rank, out.node) == (1, 1)
    # Another node reporting later does not replace the first.
    assert record_killed(str(run_dir), 0, (str(log), offset), started) == ""
    assert json.loads((run_dir / KILLED_FILE).read_text())["node"] == 1
    # An earlier attempt's KILLED is replaced by this attempt's.
    os.utime(run_dir / KILLED_FILE, (started - 60, started - 60))
    assert record_killed(str(run_dir), 0, (str(log), offset), started)
    assert json.loads((run_dir / KILLED_FILE).read_text())["node"] == 0
    # No log to read (stderr not a file): nothing recorded, nothing raised.
    assert record_killed(str(run_dir), 0, None, started) == ""


def test_own_log_is_the_stderr_file_and_its_size(tmp_path: Path) -> None:
    err = tmp_path / "err.txt"
    err.write_text("before\n")
    code = (
        "from shardctl.orchestrator.clusters.slurm.killed_ranks import own_log;"
        "import sys; print(own_log())"
    )
    with err.open("a") as f:
        out = subprocess.run([sys.executable, "-c", code], stderr=f, capture_output=False,
                             stdout=subprocess.PIPE, text=True, timeout=60, check=True)  # fmt: skip
    assert out.stdout.strip() == repr((str(err), len("before\n")))
    piped = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=60, check=True)  # fmt: skip
    assert piped.stdout.strip() == "None"

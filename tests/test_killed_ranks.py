"""A rank killed on a node is pinned there from its launcher's own record (KILLED).

Real launchers (torchrun, and torchrun's agent under `accelerate launch`) run under
`launch_wrapper` with two CPU ranks; the test SIGKILLs rank 1 by its pid, found below
the launcher by its RANK environment as the node task finds ranks. The launcher's
text is never read: its ranks' output goes to files (`--redirects`) and its stderr to
a file nothing here parses. The requeue that leaves the node behind is
test_slurm_hang.py's."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from helpers.ckpt_run import free_port
from helpers.render_util import LAUNCH_WRAPPER, variant
from shardctl.orchestrator.clusters import get_cluster
from shardctl.orchestrator.clusters.slurm.killed_ranks import killed_rank, record_killed
from shardctl.orchestrator.launch_wrapper import read_record, record_path, write_once
from shardctl.orchestrator.outcome import Evidence, classify
from shardctl.orchestrator.proctree import descendants
from shardctl.orchestrator.rundir import KILLED_FILE

TOKEN = "slurm-77-0-0"
NODE = 1
# Both ranks say they are up; rank 0 then waits in a collective for rank 1, as a
# training rank would, and rank 1 sleeps until the test kills it.
SCRIPT = """
import os, sys, time
from pathlib import Path
import torch.distributed as dist
dist.init_process_group("gloo")
dist.barrier()
Path(sys.argv[1], f"ready-{dist.get_rank()}").write_text(str(os.getpid()))
if dist.get_rank() == 1:
    time.sleep(600)
dist.barrier()
"""
# What `launch.sh` renders for `launcher: accelerate` on cpu (FSDP, use_cpu), trimmed.
ACCELERATE_CONFIG = """\
compute_environment: LOCAL_MACHINE
distributed_type: FSDP
fsdp_config:
  fsdp_version: 2
mixed_precision: 'no'
num_machines: 1
num_processes: 2
machine_rank: 0
rdzv_backend: static
same_network: true
use_cpu: true
"""


@dataclass
class Killed:
    """What one launch left: its run dir, the killed rank's pid, the launcher's code."""

    run_dir: Path
    pid: int
    code: int
    stderr: Path

    def said(self) -> str:
        return self.stderr.read_text(errors="replace")[-3000:]


def _pid_of_rank(root: int, rank: int) -> int | None:
    """The first process below `root` whose environment says RANK=`rank`."""
    for proc in descendants(root):
        with contextlib.suppress(OSError):
            environ = Path(f"/proc/{proc.pid}/environ").read_bytes().split(b"\0")
            if f"RANK={rank}".encode() in environ:
                return proc.pid
    return None


def _launch_and_kill(folder: Path, launcher: list[str]) -> Killed:
    """Run `launcher` under the wrapper with the two-rank script, SIGKILL rank 1 once
    both ranks are up, and wait for the launcher's end (bounded; cleaned up by pid)."""
    script = folder / "kill_me.py"
    script.write_text(SCRIPT)
    run_dir, stderr = folder / "run", folder / "launcher.err"
    env = {
        **os.environ, "OMP_NUM_THREADS": "1", "SHARDCTL_RUN_DIR": str(run_dir),
        "SHARDCTL_ATTEMPT_TOKEN": TOKEN, "SHARDCTL_NODE_RANK": str(NODE),
        "SLURMD_NODENAME": "n2",
        # The launchers beside this interpreter, as the node task puts them first.
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }  # fmt: skip
    argv = [sys.executable, "-m", "shardctl.orchestrator.launch_wrapper", *launcher]
    with stderr.open("w") as err:
        proc = subprocess.Popen(
            [*argv, str(script), str(folder)], env=env, stdout=subprocess.DEVNULL, stderr=err,
            start_new_session=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while not all((folder / f"ready-{r}").exists() for r in (0, 1)):
            assert proc.poll() is None, stderr.read_text()[-3000:]
            assert time.monotonic() < deadline, "the ranks never came up"
            time.sleep(0.2)
        pid = _pid_of_rank(proc.pid, 1)
        assert pid is not None and str(pid) == (folder / "ready-1").read_text()
        os.kill(pid, signal.SIGKILL)
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:  # only what this test started, by its group
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    return Killed(run_dir, pid, code, stderr)


@pytest.fixture(scope="module")
def torchrun_killed(tmp_path_factory: pytest.TempPathFactory) -> Killed:
    folder = tmp_path_factory.mktemp("torchrun")
    return _launch_and_kill(
        folder,
        ["torchrun", "--standalone", "--nnodes", "1", "--nproc-per-node", "2",
         "--redirects", "3", "--log-dir", str(folder / "rank-logs")],
    )  # fmt: skip


@pytest.fixture(scope="module")
def accelerate_killed(tmp_path_factory: pytest.TempPathFactory) -> Killed:
    folder = tmp_path_factory.mktemp("accelerate")
    config = folder / "accelerate_config.yaml"
    config.write_text(ACCELERATE_CONFIG)
    return _launch_and_kill(
        folder,
        ["accelerate", "launch", "--config_file", str(config), "--machine_rank", "0",
         "--main_process_ip", "127.0.0.1", "--main_process_port", str(free_port())],
    )  # fmt: skip


@pytest.mark.parametrize("which", ["torchrun_killed", "accelerate_killed"])
def test_the_launchers_record_names_the_killed_rank_its_pid_and_signal(
    which: str, request: pytest.FixtureRequest
) -> None:
    killed: Killed = request.getfixturevalue(which)
    # The launcher's own exit code, as without the wrapper: 1 for a failed rank.
    assert killed.code == 1, killed.said()
    record = read_record(killed.run_dir, TOKEN, NODE)
    assert record is not None, killed.said()
    assert (record["first"], record["node"], record["host"], record["token"]) == (
        1, NODE, "n2", TOKEN,
    )  # fmt: skip
    (rank1,) = [f for f in record["failures"] if f["rank"] == 1]
    assert (rank1["local_rank"], rank1["pid"], rank1["exitcode"], rank1["signal"]) == (
        1, killed.pid, -9, "SIGKILL",
    )  # fmt: skip
    assert killed_rank(record) == (1, 9, killed.pid)


def test_the_killed_marker_comes_from_the_record_not_the_launchers_text(
    torchrun_killed: Killed,
) -> None:
    started = time.time() - 600
    run_dir = torchrun_killed.run_dir
    said = record_killed(str(run_dir), NODE, started, TOKEN)
    assert said == f"rank 1 (pid {torchrun_killed.pid}) was killed by SIGKILL on this node (n2)"
    marker = json.loads((run_dir / KILLED_FILE).read_text())
    assert {k: marker[k] for k in ("rank", "node", "host", "signal", "code", "token")} == {
        "rank": 1, "node": NODE, "host": "n2", "signal": "SIGKILL", "code": 137, "token": TOKEN,
    }  # fmt: skip
    out = classify(Evidence.gather(run_dir, started, 1, token=TOKEN))
    assert out.pinned and (out.rank, out.node) == (1, NODE)
    # The record is the only source: another node's or another attempt's is not read.
    assert record_killed(str(run_dir), 0, started, TOKEN) == ""
    assert record_killed(str(run_dir), NODE, started, "slurm-77-0-1") == ""


def _record(run_dir: Path, first_code: int, token: str = TOKEN, node: int = NODE) -> None:
    """A launcher's record written by hand: rank 5 ended first with `first_code`."""
    failures = [
        {"rank": 5, "local_rank": 1, "pid": 4321, "exitcode": first_code, "time": 1},
        {"rank": 4, "local_rank": 0, "pid": 4320, "exitcode": -15, "time": 1},
    ]
    record: dict[str, Any] = {"token": token, "node": node, "host": f"h{node}", "first": 5,
                              "failures": failures}  # fmt: skip
    assert write_once(record_path(run_dir, token, node), record)


def test_only_a_nodes_signal_on_the_first_failure_pins_it(tmp_path: Path) -> None:
    started = time.time()
    # An abort (gloo/NCCL on a healthy node), a TERM, an error exit: not pinned.
    for i, code in enumerate((-6, -15, 1, 42)):
        _record(tmp_path / str(i), code)
        assert record_killed(str(tmp_path / str(i)), NODE, started, TOKEN) == "", code
        assert not (tmp_path / str(i) / KILLED_FILE).exists()
    _record(tmp_path / "bus", -7)
    said = record_killed(str(tmp_path / "bus"), NODE, started, TOKEN)
    assert said == "rank 5 (pid 4321) was killed by SIGBUS on this node (h1)"
    # Without a token (an unfenced attempt), or without a record: nothing, nothing raised.
    assert record_killed(str(tmp_path / "bus"), NODE, started, None) == ""
    assert record_killed(str(tmp_path / "none"), NODE, started, TOKEN) == ""


def test_the_first_nodes_killed_marker_stays_and_an_earlier_attempts_goes(
    tmp_path: Path,
) -> None:
    started = time.time()
    for node in (0, 1):
        _record(tmp_path, -9, node=node)
    assert record_killed(str(tmp_path), 1, started, TOKEN)
    assert record_killed(str(tmp_path), 0, started, TOKEN) == ""  # node 1 was first
    assert json.loads((tmp_path / KILLED_FILE).read_text())["node"] == 1
    # The next attempt's (another token) replaces it.
    later = "slurm-77-1-0"
    _record(tmp_path, -9, token=later, node=0)
    assert record_killed(str(tmp_path), 0, time.time(), later)
    assert json.loads((tmp_path / KILLED_FILE).read_text())["node"] == 0


def test_a_record_is_written_once_and_never_replaced(tmp_path: Path) -> None:
    path = record_path(tmp_path, TOKEN, 3)
    assert write_once(path, {"first": 1, "failures": []})
    assert not write_once(path, {"first": 2, "failures": []})
    assert json.loads(path.read_text())["first"] == 1
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary left


def test_a_launcher_it_does_not_run_itself_is_executed_as_it_is(tmp_path: Path) -> None:
    """DeepSpeed's launcher, a test's stand-in on PATH: exec'd, its own exit code."""
    wrapper = [sys.executable, "-m", "shardctl.orchestrator.launch_wrapper"]
    done = subprocess.run([*wrapper, "sh", "-c", "exit 7"], timeout=60, check=False)
    assert done.returncode == 7
    stand_in = tmp_path / "bin" / "torchrun"
    stand_in.parent.mkdir()
    stand_in.write_text('#!/bin/sh\necho stand-in "$@"\n')
    stand_in.chmod(0o755)
    env = {**os.environ, "PATH": f"{stand_in.parent}{os.pathsep}{os.environ['PATH']}"}
    out = subprocess.run([*wrapper, "torchrun", "--x"], env=env, capture_output=True,
                         text=True, timeout=60, check=False)  # fmt: skip
    assert (out.returncode, out.stdout) == (0, "stand-in --x\n"), out.stderr
    usage = subprocess.run(wrapper, capture_output=True, text=True, timeout=60, check=False)
    assert usage.returncode == 2 and usage.stderr.count("\n") == 1, usage.stderr


@pytest.mark.parametrize(
    ("launcher", "wrapped"), [("torchrun", True), ("accelerate", True), ("deepspeed", False)]
)
def test_launch_sh_runs_torchrun_and_accelerate_under_the_wrapper(
    launcher: str, wrapped: bool
) -> None:
    patch: dict[str, Any] = {"launcher": launcher}
    if launcher == "deepspeed":
        patch["strategy"] = {"backend": "deepspeed"}
    text = get_cluster("local").launch_script(variant(patch), "job.yaml")
    assert (LAUNCH_WRAPPER + launcher in text) is wrapped, text

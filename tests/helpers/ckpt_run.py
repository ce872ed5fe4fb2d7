"""Run torchrun (or any multi-process command) from tests with a hard time limit.

The command gets its own session, so on a timeout (or a deliberate kill) the
whole process group — the launcher and every rank — is killed by its id.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "helpers" / "ckpt_worker.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def torchrun_argv(nproc: int, script: str | Path, *args: str) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", "1", "--nproc-per-node", str(nproc),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
        str(script), *args,
    ]  # fmt: skip


def run(
    argv: list[str], timeout: float, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env or child_env(),
        cwd=ROOT,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        out, _ = proc.communicate()
        raise AssertionError(f"timed out after {timeout}s: {argv}\n{out[-4000:]}") from None
    return subprocess.CompletedProcess(argv, proc.returncode, out, None)


def kill_group(proc: subprocess.Popen) -> list[int]:
    """SIGKILL the launcher and every process under it; returns the killed pids.

    torchrun starts each rank in a session of its own, so killing the launcher's
    process group alone would orphan the ranks: they are found and killed by pid.
    """
    import psutil

    if proc.poll() is not None:  # reaped: its pid may already belong to someone else
        return []
    try:
        children = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        children = []
    killed = [proc.pid]
    # The launcher first, so that it cannot start replacements; then every rank.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    for child in children:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child.pid, signal.SIGKILL)
            killed.append(child.pid)
    psutil.wait_procs(children, timeout=30)
    return killed


def worker(nproc: int, ckdir: Path, *args: str, timeout: float = 300) -> dict[str, Any]:
    """Run ckpt_worker.py; return its --out JSON (fails with the log otherwise). The
    timeout is sized for a loaded 2-core machine (seconds idle, minutes when busy)."""
    out = ckdir.parent / f"out-{os.urandom(4).hex()}.json"
    res = run(torchrun_argv(nproc, WORKER, "--dir", str(ckdir), "--out", str(out), *args), timeout)
    if res.returncode != 0 or not out.exists():
        raise AssertionError(f"worker failed (rc {res.returncode}):\n{res.stdout[-6000:]}")
    return json.loads(out.read_text())

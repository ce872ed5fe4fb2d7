"""The node's launcher run in this process, so how each rank ended is known, not parsed.

A rank the kernel kills (the OOM killer, a bad memory page: SIGKILL, SIGBUS) writes
nothing, and only its parent, the launcher, can `wait()` for its status: a process
above the launcher (the node agent, a hand run's watchdog) cannot wait for a grandchild.
torchrun and `accelerate launch` (which runs torchrun's agent) are Python, and their
elastic agent does wait: when a rank fails it raises `ChildFailedError`, whose
`failures` maps each failed global rank to a `ProcessFailure` (local rank, pid, exit
code, negative for a signal, the time torch saw it). So the rendered `launch.sh` starts
them through this module:

    python3 -m shardctl.orchestrator.launch_wrapper torchrun ARGS...

When the launcher `launch.sh` would have run (the one on PATH) is the console script
this interpreter's own distribution installed (torch's `torchrun`, accelerate's
`accelerate`; or none is on PATH), it calls that script's entry point in this process:
the same code, pid and signal handling as the script. When that raises
`ChildFailedError`, it writes the failures as one JSON record, then lets the exception
go on as it would have: the launcher's own report on stderr, its own exit code (1).
Any other launcher (another environment's, a test's stand-in) is executed as it is.

The record, one per node and attempt, written once (a hard link, never replaced) by
that node's launcher: `<run dir>/logs/rank-exits/<attempt token>/node<N>.json`

    {"token", "node", "host", "launcher", "launcher_pid", "first",
     "failures": [{"rank", "local_rank", "pid", "exitcode", "signal", "time"}, ...]}

`first` is the global rank torch names the first failure (its report's "Root Cause");
`signal` is the signal's name when `exitcode` is negative, else null. The run dir,
token and node come from the environment `launch.sh` runs in (`SHARDCTL_RUN_DIR`,
`SHARDCTL_ATTEMPT_TOKEN`, `SHARDCTL_NODE_RANK`); without a token (a launch outside
a fenced attempt) nothing is recorded, since no reader could tell which attempt it
belongs to. Slurm's node task reads its node's record after the launcher exits
(`clusters/slurm/killed_ranks`); so does a Kubernetes pod without a shared run dir,
for a save another pod's preemption asked for (`clusters/k8s/node_agent`).

Nothing here reads the launcher's text: torchrun can keep its ranks' output out of
its stderr (`--redirects`, `--tee`), and its report's wording is its own;
`launcher_output` only makes that text readable for a display.

Not wrapped: DeepSpeed's launcher (`deepspeed --no_ssh`) starts its ranks from a
second process of its own (`deepspeed.launcher.launch`), which says how a rank ended
only in its log text; `launch.sh` starts it as it is, and a rank killed under it is
not pinned on its node. A launcher executed as it is records nothing; where a record
was expected (a fenced attempt) one line says so.

Torch-free at import: the launcher is imported only when it runs, and the Slurm node
task imports this module for the record's path and reader.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import signal
import socket
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .rundir import ENV_ATTEMPT_TOKEN, ENV_RUN_DIR, LOGS_DIR

# The launchers run in this process, each the console script of this distribution.
ENTRY_POINTS = {"torchrun": "torch", "accelerate": "accelerate"}
ENV_NODE_RANK = "SHARDCTL_NODE_RANK"  # this node's index (launch.RUNTIME_VARS)
FOLDER = "rank-exits"


def record_path(run_dir: str | Path, token: str, node: int) -> Path:
    """Where node `node`'s launcher records its failed ranks of attempt `token`."""
    safe = token.replace(os.sep, "_").replace("\0", "_") or "_"
    return Path(run_dir) / LOGS_DIR / FOLDER / safe / f"node{node}.json"


def read_record(run_dir: str | Path, token: str, node: int) -> dict[str, Any] | None:
    """Node `node`'s record of attempt `token`; None when its launcher wrote none (no
    rank failed, or it was not wrapped) or the file is not a record."""
    try:
        data = json.loads(record_path(run_dir, token, node).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("failures"), list) else None


def _signal_name(exitcode: int) -> str | None:
    if exitcode >= 0:
        return None
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"


def failures_record(error: BaseException, launcher: str) -> dict[str, Any]:
    """The record of a `ChildFailedError` (read through its public fields only)."""
    first, _ = error.get_first_failure()  # type: ignore[attr-defined]
    failures = [
        {
            "rank": int(rank),
            "local_rank": failure.local_rank,
            "pid": failure.pid,
            "exitcode": failure.exitcode,
            "signal": _signal_name(failure.exitcode),
            "time": failure.timestamp,
        }
        for rank, failure in error.failures.items()  # type: ignore[attr-defined]
    ]
    return {
        "token": os.environ.get(ENV_ATTEMPT_TOKEN),
        "node": _node_index(),
        "host": node_host(),
        "launcher": launcher,
        "launcher_pid": os.getpid(),
        "first": int(first),
        "failures": failures,
    }


def node_host() -> str:
    """Slurm's name for this node (several emulated nodes can share one host)."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]


def _node_index() -> int:
    value = os.environ.get(ENV_NODE_RANK, "0")
    return int(value) if value.isdigit() else 0


def write_once(path: Path, record: dict[str, Any]) -> bool:
    """Write `record` at `path` whole or not at all, unless a record is there already
    (its one writer ran before: never replaced). False when it was there."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".record-")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")
        os.link(tmp, path)  # fails when `path` exists: the first record stays
        return True
    except FileExistsError:
        return False
    finally:
        os.unlink(tmp)


def record_failures(error: BaseException, launcher: str) -> None:
    """Record `error`'s failed ranks for this node's attempt; a failure to write is
    said in one line and is not the launcher's failure."""
    run_dir, token = os.environ.get(ENV_RUN_DIR), os.environ.get(ENV_ATTEMPT_TOKEN)
    if not run_dir or not token:
        return
    path = record_path(run_dir, token, _node_index())
    try:
        write_once(path, failures_record(error, launcher))
    except (OSError, AttributeError, TypeError, ValueError) as exc:
        print(f"[shardctl] could not record how the ranks ended in {path}: {exc}", file=sys.stderr)


def own_entry_point(launcher: str) -> Callable[[], Any] | None:
    """The console entry point of `launcher` when this interpreter's distribution
    installed the launcher found on PATH (or none is on PATH); else None."""
    if launcher not in ENTRY_POINTS:
        return None
    try:
        dist = importlib.metadata.distribution(ENTRY_POINTS[launcher])
    except importlib.metadata.PackageNotFoundError:
        return None
    scripts = [e for e in dist.entry_points if e.group == "console_scripts" and e.name == launcher]
    on_path = shutil.which(launcher)
    if not scripts or (on_path is not None and not _installed_by(dist, launcher, on_path)):
        return None
    try:
        return scripts[0].load()
    except (ImportError, AttributeError):
        return None


def _installed_by(dist: importlib.metadata.Distribution, launcher: str, path: str) -> bool:
    """Whether `path` is the script `launcher` that `dist` installed (its RECORD)."""
    for file in dist.files or []:
        if file.name != launcher:
            continue
        try:
            if os.path.samefile(Path(str(file.locate())), path):
                return True
        except OSError:
            continue
    return False


def run(argv: list[str]) -> Any:
    """Run launcher `argv[0]` with its arguments as its console script would."""
    launcher = argv[0]
    main = own_entry_point(launcher)
    if main is None:
        if launcher in ENTRY_POINTS and os.environ.get(ENV_ATTEMPT_TOKEN):
            print(
                f"[shardctl] {launcher} is not the one installed for {sys.executable}: started "
                "as it is; which of its ranks was killed is not recorded",
                file=sys.stderr,
            )
        os.execvp(launcher, argv)
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    sys.argv = list(argv)
    try:
        return main()
    except ChildFailedError as error:
        record_failures(error, launcher)
        raise


def _main() -> None:
    if len(sys.argv) < 2:
        print(
            "usage: python -m shardctl.orchestrator.launch_wrapper LAUNCHER [ARGS...] "
            f"(LAUNCHER: {' or '.join(ENTRY_POINTS)}; another is executed as it is)",
            file=sys.stderr,
        )
        sys.exit(2)
    sys.exit(run(sys.argv[1:]))


if __name__ == "__main__":
    _main()

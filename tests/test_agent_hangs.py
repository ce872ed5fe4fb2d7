"""The node agent applies the hang rule itself on this machine (and on Slurm, through the
same `NodeAgent(watch_hangs=True)`): `launch.sh` run under it runs no watchdog between
the agent and the launcher, yet a stopped rank is found, named on its node, and every
rank restarted in place. A `launch.sh` run by hand keeps the node watchdog."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers.local_run import (
    attempt_rows,
    ended,
    past_first_checkpoint,
    run_processes,
    submit_tiny,
    succeeded,
    wait_for,
)
from shardctl.orchestrator.agent.hangs import AgentHangs, environ_of
from shardctl.orchestrator.launch import AGENT_WATCHES, WATCHDOG_MODULE, hang_watch_lines
from shardctl.orchestrator.rundir import ENV_HANG_WATCHER, ENV_HEARTBEAT_DIR

HANG_TIMEOUT_S = 15
# Each node's launcher: torchrun, run in-process by the wrapper that records rank ends.
LAUNCHER = b"shardctl.orchestrator.launch_wrapper"
STEPS = 120


def _prelude(env: dict[str, str]) -> tuple[str, str]:
    """What `launch.sh`'s hang lines leave: the words before the launcher, and the
    answer the agent reads in the launcher's environment."""
    script = "\n".join([*hang_watch_lines(), f'echo "$*"; echo "${{{ENV_HANG_WATCHER}:-}}"'])
    done = subprocess.run(
        ["bash", "-euc", script, "launch.sh", "left", "over"],
        env={"PATH": os.environ["PATH"], **env}, capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    words, answer = done.stdout.splitlines()
    return words, answer


def test_launch_sh_under_the_agent_runs_no_watchdog_and_says_the_agent_watches() -> None:
    words, answer = _prelude({ENV_HEARTBEAT_DIR: "/tmp/beats"})
    assert (words, answer) == ("", AGENT_WATCHES)


def test_launch_sh_run_by_hand_keeps_the_watchdog() -> None:
    words, answer = _prelude({})
    assert words == f"python3 -m {WATCHDOG_MODULE} --" and answer == ""


def test_the_agent_watches_only_a_launcher_that_accepted_from_its_own_environment(
    tmp_path: Path,
) -> None:
    hangs = AgentHangs()
    env = {
        "PATH": os.environ["PATH"], "SHARDCTL_RUN_DIR": str(tmp_path),
        "SHARDCTL_NODE_RANK": "3", "SHARDCTL_ATTEMPT_TOKEN": "local-x-r1",
        "SHARDCTL_RESTART": "1", "SHARDCTL_HANG_TIMEOUT_S": "60",
    }  # fmt: skip
    hangs.offer(env)
    folder = Path(env[ENV_HEARTBEAT_DIR])
    # Declined: watchdog.enabled: false, or a launch.sh with its own watchdog.
    declined = subprocess.Popen(["sleep", "60"], env=env)
    accepted = subprocess.Popen(["sleep", "60"], env={**env, ENV_HANG_WATCHER: AGENT_WATCHES})
    try:
        # Popen returns inside the child's exec, before the kernel has set up the new
        # environment: /proc/PID/environ reads empty for a moment (the agent looks
        # again at its next poll; this test looks once, so it waits for it).
        deadline = time.monotonic() + 30
        while not all(environ_of(child.pid) for child in (declined, accepted)):
            assert time.monotonic() < deadline, "the stand-in launchers' environments"
            time.sleep(0.01)
        assert hangs.look(declined.pid) is False and not hangs.watches
        assert hangs.look(accepted.pid) is False  # no rank beat: nothing to judge
        (watch,) = hangs.watches.values()
        assert (watch.node, watch.restart, watch.token, watch.run_dir) == (
            3, 1, "local-x-r1", str(tmp_path),
        )  # fmt: skip
        assert watch.rule.explicit == 60
    finally:
        for child in (declined, accepted):
            child.kill()
            child.wait(timeout=30)
        hangs.close()
    assert not folder.exists()


def _rank_of_node(run_dir: Path, node: int, restart: int) -> int | None:
    """The pid of the rank that node `node` runs in restart `restart` (one per node)."""
    for pid, (env, module) in run_processes(run_dir).items():
        if (
            module == b"shardctl.train"
            and env.get("SHARDCTL_NODE_RANK") == str(node)
            and env.get("SHARDCTL_RESTART") == str(restart)
        ):
            return pid
    return None


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_agent_finds_a_hang_on_its_node_names_it_and_restarts_without_a_watchdog(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = submit_tiny(
        tmp_path, monkeypatch, "agenthang", steps=STEPS, hang_timeout_s=HANG_TIMEOUT_S,
        max_in_allocation=1,
        # Two nodes on this machine, one rank each: the hang is on node 1.
        resources={"nodes": 2, "procs_per_node": 1},
        strategy={"sharding": "hybrid_shard"},
    )  # fmt: skip
    run_dir = job.run_dir
    with past_first_checkpoint(job) as stopped:
        procs = run_processes(run_dir)
        # No watchdog process between the agent and the launchers; each launcher says
        # the agent watches it.
        assert not [p for p, (_, m) in procs.items() if m == WATCHDOG_MODULE.encode()], procs
        launchers = [env for env, m in procs.values() if m == LAUNCHER]
        answers = {env.get(ENV_HANG_WATCHER) for env in launchers}
        assert len(launchers) == 2, procs
        assert answers == {AGENT_WATCHES}, procs
        victim = _rank_of_node(run_dir, 1, 0)
        assert victim is not None, procs
        os.kill(victim, signal.SIGSTOP)
        stopped.append(victim)
        report = run_dir / "logs" / "hang-attempt0-node1.txt"
        wait_for("node 1's hang report", report.exists, HANG_TIMEOUT_S + 120)
        wait_for("the end", ended("agenthang"), 600)
    succeeded(job)
    attempts = attempt_rows(run_dir)
    assert [(a["restart"], a["kind"], a["decision"]) for a in attempts] == [
        (0, "hung", "restart"), (1, "done", "finish"),
    ], attempts  # fmt: skip
    # Named on its node: the stopped rank is node 1's, with its stack in the report.
    assert "(node 1's" in attempts[0]["summary"], attempts[0]
    text = report.read_text()
    assert "Python stack, most recent call first" in text and "stopped (SIGSTOP)" in text
    err = (run_dir / "logs" / "launcher.err").read_text()
    assert "the node agent watches the ranks" in err and "HUNG" in err
    assert "watching the ranks of" not in err  # the watchdog's own start line
    # The stopped rank was killed with its node's launcher (a zombie reaped at once).
    wait_for("the stopped rank's end", lambda: not Path(f"/proc/{stopped[0]}").exists(), 30)

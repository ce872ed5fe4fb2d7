"""The node agent (`orchestrator/agent/`): the loop every cluster's node runs, with a
cluster's adapter for what "go again" means.

- an adapter that is not Slurm's (a plugin cluster's, here a stand-in written in the
  test) gets the rounds of restarts in place, the claims of each round's token, the
  ledger and the verdicts from the agent alone;
- the local cluster's agent (`python -m shardctl.orchestrator.agent`) keeps the files
  `status` reads (`local.exit`, `local.outcome`) and restarts every node in place.

No Slurm, no torch: the launcher is a stand-in bash script."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from shardctl.orchestrator.agent import NodeAgent
from shardctl.orchestrator.fence import current_attempt
from shardctl.orchestrator.outcome import Evidence, Verdict
from shardctl.orchestrator.rundir import ENV_ATTEMPT_TOKEN

# Fails its first round (a crash, no marker), hangs its second (124), ends its third;
# each round appends its token and restart number to `seen` beside the script.
ROUNDS = r"""
here="$(dirname "$0")"
echo "${SHARDCTL_ATTEMPT_TOKEN:-none} ${SHARDCTL_RESTART}" >> "$here/seen"
case "$(wc -l < "$here/seen")" in
  1) exit 3 ;;
  2) exit 124 ;;
  *) exit 0 ;;
esac
"""


class PluginAdapter:
    """A plugin cluster's adapter: every method records what the agent asked."""

    cluster = "plugin"
    forwards_signals = True
    node = 0
    nodes = 1
    job_id = "p-1"
    allocation = 0
    retries = 0

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.claimed: list[int] = []
        self.verdicts: list[str] = []
        self.carried: list[str] = []

    def token(self, round_: int) -> str | None:
        return f"plugin-p-1-r{round_}"

    def claim(self, round_: int) -> None:
        from shardctl.orchestrator.fence import claim_attempt

        self.claimed.append(round_)
        claim_attempt(self.run_dir, self.token(round_), cluster="plugin", job=self.job_id)

    def prepare_env(self, env: dict[str, str]) -> None:
        env["PLUGIN_NODE"] = "yes"

    def outside_signal(self, signal_name: str) -> bool:
        return False

    def watch(self, round_: int) -> Callable[[int], None] | None:
        return None

    def pin_killed(self, round_: int, started: float) -> None:
        return None

    def judged(self, verdict: Verdict, rc: int, round_: int) -> None:
        self.verdicts.append(f"{round_}:{rc}:{verdict.decision.value}")

    def carry_out(self, verdict: Verdict, evidence: Evidence, rc: int, round_: int) -> str:
        self.carried.append(verdict.outcome.kind.value)
        return "plugin-finished"


def _script(folder: Path) -> Path:
    launch = folder / "launch.sh"
    launch.write_text(ROUNDS)
    return launch


def _run_rounds(tmp_path: Path, monkeypatch, max_restarts: int) -> PluginAdapter:
    """The node agent runs ROUNDS under a PluginAdapter (no token from outside) to its
    end; the adapter holds what it was told."""
    monkeypatch.delenv(ENV_ATTEMPT_TOKEN, raising=False)
    adapter = PluginAdapter(tmp_path)
    agent = NodeAgent(
        adapter, ["bash", str(_script(tmp_path))], str(tmp_path),
        max_restarts=max_restarts, marker_wait_s=0.0,
    )  # fmt: skip
    assert agent.run() == "plugin-finished"
    return adapter


def test_a_plugin_adapter_gets_restarts_in_place_claims_and_the_ledger(
    tmp_path: Path, monkeypatch
) -> None:
    adapter = _run_rounds(tmp_path, monkeypatch, max_restarts=2)
    # Every round ran with its own token, claimed before it started.
    rounds = (tmp_path / "seen").read_text().splitlines()
    assert rounds == ["plugin-p-1-r0 0", "plugin-p-1-r1 1", "plugin-p-1-r2 2"]
    assert adapter.claimed == [0, 1, 2]
    assert current_attempt(tmp_path)["token"] == "plugin-p-1-r2"
    # The crash and the hang were restarts in place; the adapter carried out the end.
    assert adapter.verdicts == ["0:3:restart", "1:124:restart", "2:0:finish"]
    assert adapter.carried == ["done"]
    ledger = [json.loads(line) for line in (tmp_path / "attempts.jsonl").read_text().splitlines()]
    assert [(e["job"], e["kind"], e["decision"]) for e in ledger] == [
        ("p-1", "failed", "restart"), ("p-1", "hung", "restart"), ("p-1", "done", "finish"),
    ]  # fmt: skip


def test_past_the_bound_the_adapter_carries_the_crash_out(tmp_path: Path, monkeypatch) -> None:
    adapter = _run_rounds(tmp_path, monkeypatch, max_restarts=0)
    assert adapter.verdicts == ["0:3:stop"]
    assert adapter.carried == ["failed"]
    assert len((tmp_path / "seen").read_text().splitlines()) == 1


def _local_agent(run_dir: Path, max_restarts: int, token: str | None) -> int:
    env = {k: v for k, v in os.environ.items() if k != ENV_ATTEMPT_TOKEN}
    if token is not None:
        env[ENV_ATTEMPT_TOKEN] = token
    argv = [
        sys.executable, "-m", "shardctl.orchestrator.agent", "--run-dir", str(run_dir),
        "--launch", str(_script(run_dir)), "--out", str(run_dir / "out"),
        "--err", str(run_dir / "err"), "--nodes", "1", "--job", "local-0",
        "--max-restarts", str(max_restarts),
    ]  # fmt: skip
    return subprocess.run(argv, env=env, timeout=120).returncode


def test_the_local_agent_restarts_in_place_and_keeps_the_files_status_reads(
    tmp_path: Path,
) -> None:
    assert _local_agent(tmp_path, 2, "local-run-0") == 0
    rounds = (tmp_path / "seen").read_text().splitlines()
    assert rounds == ["local-run-0 0", "local-run-0-r1 1", "local-run-0-r2 2"]
    claim = current_attempt(tmp_path)
    assert (claim["token"], claim["job"], claim["restart"]) == ("local-run-0-r2", "local-0", 2)
    assert (tmp_path / "local.exit").read_text() == "0\n"
    outcome = json.loads((tmp_path / "local.outcome").read_text())
    assert (outcome["decision"], outcome["outcome"]["kind"]) == ("finish", "done")
    err = (tmp_path / "err").read_text()
    assert "restarting every rank in this allocation (1 of at most 2)" in err
    assert "restarting every rank in this allocation (2 of at most 2)" in err


def test_the_local_agent_exits_with_the_launch_scripts_code_past_the_bound(
    tmp_path: Path,
) -> None:
    assert _local_agent(tmp_path, 0, None) == 3
    assert (tmp_path / "local.exit").read_text() == "3\n"
    outcome = json.loads((tmp_path / "local.outcome").read_text())
    assert outcome["outcome"]["kind"] == "failed"
    assert not (tmp_path / "CURRENT_ATTEMPT").exists() or current_attempt(tmp_path) is None
    assert (tmp_path / "seen").read_text().splitlines() == ["none 0"]


def test_the_agent_imports_no_cluster_and_no_torch() -> None:
    """DESIGN's import rule: each cluster imports the agent, never the reverse."""
    probe = (
        "import sys, shardctl.orchestrator.agent, shardctl.orchestrator.agent.local; "
        "print(sorted(m for m in sys.modules if m.startswith('shardctl.orchestrator.clusters') "
        "or m.split('.')[0] in ('torch', 'submitit', 'kubernetes')))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"

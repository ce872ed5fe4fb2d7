"""The node agent on this machine (`shardctl submit` on the local cluster).

One agent runs every node of a local run (`NODES`: one launch script per node rank,
all on this host, meeting at 127.0.0.1), so it is node 0 and decides each round
alone. "Go again" is a loop in this process: a crash or a hang with restarts left
(`restart.max_in_allocation`) starts every node again under a new attempt token
(`<first token>-r<round>`, claimed before the ranks start); anything else ends the
agent with the launch scripts' exit code. There is no requeue and no retry.

What `status` and `cancel` read stays as it was: the agent writes the launch
scripts' exit code (`local.exit`) and the verdict (`local.outcome`) after every
round, and a restart's summary into the launcher's error log. `cancel` signals the
agent's process group and every process below it, so the agent passes no signal on
itself (a second TERM would cut torchrun's orderly stop of the ranks short).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from ..durable import write_text_atomic
from ..fence import claim_attempt
from ..outcome import Decision, Evidence, Verdict

# In the run dir, read by the local cluster's `status`: the launch scripts' exit code
# and the agent's verdict, after every round.
EXIT_FILE = "local.exit"
OUTCOME_FILE = "local.outcome"

# Runs the launch script once per node (SHARDCTL_NODE_RANK=0..nodes-1) with its output
# appended to the launcher's logs, and exits with the first non-zero exit code of the
# nodes, in node order. A TERM or INT is not passed on to the launch scripts: whoever
# stops a local run (`LocalCluster.cancel`) signals every process itself, and a second
# TERM would land inside torchrun's handling of the first. The trap keeps the runner
# alive until the nodes' own statuses come back (a trap handler, not an ignored
# signal, keeps the children's default dispositions); `wait` returns early when a
# trapped signal arrives, so it is repeated. Each node's ranks beat into a folder of
# their own below the agent's (its hang rule watches each node's launcher alone:
# `hangs.py`).
NODES = r"""
launch="$1"; out="$2"; err="$3"; nnodes="$4"
beats="${SHARDCTL_HEARTBEAT_DIR:-}"
pids=(); got=0
trap 'got=1' TERM INT
for ((i = 0; i < nnodes; i++)); do
  [ -z "$beats" ] || mkdir -p "$beats/node$i"
  SHARDCTL_NODE_RANK="$i" SHARDCTL_HEARTBEAT_DIR="${beats:+$beats/node$i}" \
    bash "$launch" >>"$out" 2>>"$err" </dev/null &
  pids+=("$!")
done
rc=0
for pid in "${pids[@]}"; do
  while :; do
    got=0; node_rc=0
    wait "$pid" || node_rc=$?
    [ "$got" = 1 ] || break
  done
  if [ "$rc" = 0 ]; then rc="$node_rc"; fi
done
exit "$rc"
"""


def nodes_command(launch: str, out: str, err: str, nodes: int) -> list[str]:
    """The command the local agent runs each round: every node's launch script."""
    return ["bash", "-c", NODES, "shardctl-local", launch, out, err, str(nodes)]


class LocalAdapter:
    """This machine's part of the node agent (`agent.Adapter`)."""

    cluster = "local"
    forwards_signals = False
    node = 0
    nodes = 1  # one agent for every node of the run
    allocation = 0
    retries = 0

    def __init__(
        self, run_dir: str, job_id: str, first_token: str | None, *,
        exit_file: str, outcome_file: str, err_log: str,
    ) -> None:  # fmt: skip
        self.run_dir = run_dir
        self.job_id = job_id
        self.first_token = first_token or None
        self.exit_file = Path(exit_file)
        self.outcome_file = Path(outcome_file)
        self.err_log = Path(err_log)
        self.last_rc = 0

    def token(self, round_: int) -> str | None:
        if self.first_token is None or not round_:
            return self.first_token
        return f"{self.first_token}-r{round_}"

    def claim(self, round_: int) -> None:
        # `schedule` claimed the first round's token before it started the agent.
        token = self.token(round_)
        if round_ and token is not None:
            # `job`: the start's id in attempts.jsonl (goodput reads whose claim this is).
            claim_attempt(self.run_dir, token, cluster="local", restart=round_, job=self.job_id)

    def prepare_env(self, env: dict[str, str]) -> None:
        """Nothing of its own: `schedule` gave the agent the run's environment."""

    def outside_signal(self, signal_name: str) -> bool:
        return False

    def watch(self, round_: int) -> Callable[[int], None] | None:
        return None

    def pin_killed(self, round_: int, started: float) -> None:
        """A local run names a killed rank from its own markers only."""

    def judged(self, verdict: Verdict, rc: int, round_: int) -> None:
        self.last_rc = rc
        write_text_atomic(self.exit_file, f"{rc}\n", durable=False)
        write_text_atomic(self.outcome_file, json.dumps(verdict.to_json()) + "\n", durable=False)
        if verdict.decision is Decision.RESTART:
            with self.err_log.open("a") as err:
                err.write(f"shardctl: {verdict.summary()}\n")

    def carry_out(self, verdict: Verdict, evidence: Evidence, rc: int, round_: int) -> str:
        return verdict.decision.value

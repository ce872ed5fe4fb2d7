"""Hot spares on Slurm (`slurm.spare_nodes`): a fault pinned on a training node hands
the next restart in place to a spare, inside the same allocation and job id.

The lineup rules (`clusters/slurm/spares.py`) and the field's validation and rendering
run here without Slurm; three node tasks of one emulated allocation (no Slurm: the
launcher is a stand-in script) run the whole round protocol; the dev cluster runs a
2-node job with a spare whose rank is SIGKILLed on node 1 (marked `slurm`: on 3 nodes
or more, the session fixture `resize_cluster`; after test_slurm_scale.py it runs on
the 4 nodes that test left)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from shardctl.orchestrator.attempts import newest_memory_step
from shardctl.orchestrator.clusters.base import JobState
from shardctl.orchestrator.clusters.slurm import SlurmCluster
from shardctl.orchestrator.clusters.slurm.bad_nodes import left_behind_detail
from shardctl.orchestrator.clusters.slurm.refusals import refused
from shardctl.orchestrator.clusters.slurm.sbatch import submitit_parameters
from shardctl.orchestrator.clusters.slurm.spares import (
    FRESH_NODES_ENV,
    Lineup,
    Replacement,
    read_lineup,
    record_replacement,
    write_lineup,
)
from shardctl.orchestrator.errors import SpecError
from shardctl.orchestrator.spec import parse_spec
from shardctl.train.memory_tier import last_restore
from test_slurm_cluster import (  # the e2e helpers of the 2-node tests
    SHARDCTL,
    _finished,
    _last_checkpoint,
    _own_spec,
    _submitted,
    _wait,
)
from test_slurm_hang import _rank_of_node
from test_slurm_scale import PACED_SCRIPT

# ----------------------------------------------------------------- the lineup rules


def test_the_first_round_trains_on_the_first_nodes_and_the_rest_stand_by() -> None:
    lineup = Lineup.first(2, 4)
    assert lineup.ranks == (0, 1)
    assert [lineup.rank_of(n) for n in range(4)] == [0, 1, None, None]
    assert lineup.spares() == [2, 3]


def test_a_spare_takes_the_bad_nodes_rank_and_the_bad_node_is_benched() -> None:
    lineup = Lineup.first(3, 5).replace(1)
    assert lineup is not None
    assert lineup.ranks == (0, 3, 2) and lineup.benched == (1,)
    assert lineup.rank_of(1) is None and lineup.rank_of(3) == 1
    # The next fault on the spare itself takes the last spare; a benched node never
    # comes back as a spare.
    again = lineup.replace(1)
    assert again is not None and again.ranks == (0, 4, 2) and again.benched == (1, 3)
    assert again.spares() == []
    assert again.replace(2) is None  # no spare left: a restart as without spares


def test_the_ranks_a_spare_just_stood_in_for_are_fresh_for_the_memory_tier() -> None:
    first = Lineup.first(3, 4)
    replaced = first.replace(2)
    assert replaced is not None
    assert replaced.fresh_since(first) == [2]
    assert replaced.fresh_since(replaced) == []  # the next round: its own copies now
    assert first.fresh_since(first) == []


def test_the_fresh_nodes_variable_is_the_one_the_memory_tier_reads() -> None:
    partner = pytest.importorskip("shardctl.train.memory_partner")
    assert partner.FRESH_NODES_ENV == FRESH_NODES_ENV


def test_node_rank_0_and_a_rank_outside_the_round_are_never_replaced() -> None:
    lineup = Lineup.first(2, 3)
    assert lineup.replace(0) is None  # node 0 decides the rounds and hosts the rendezvous
    assert lineup.replace(2) is None and lineup.replace(-1) is None


def test_a_lineup_reads_back_and_one_that_does_not_read_keeps_the_current(
    tmp_path: Path,
) -> None:
    current = Lineup.first(2, 3)
    replaced = current.replace(1)
    assert replaced is not None
    write_lineup(str(tmp_path), "9", 0, 1, replaced)
    assert read_lineup(str(tmp_path), "9", 0, 1, current) == replaced
    assert read_lineup(str(tmp_path), "9", 1, 1, current) == current  # another allocation
    (tmp_path / "rounds" / "9-0-r2.lineup").write_text("{not json")
    assert read_lineup(str(tmp_path), "9", 0, 2, current) == current


def test_status_names_the_replaced_node_and_its_spare(tmp_path: Path) -> None:
    said = record_replacement(str(tmp_path), Replacement(
        job_id="9", requeue=0, round_=1, token="slurm-9-0", rank=1, node=1, spare=2,
        why="rank 3 was killed by SIGKILL on node 1",
    ), ["c1", "c2", "c3"])  # fmt: skip
    assert "spare node 2 (c3) trains as node rank 1 from restart 1" in said
    assert left_behind_detail(tmp_path, "9") == (
        "nodes: c2 replaced by spare c3 in restart 1 (rank 3 was killed by SIGKILL on node 1)"
    )
    entry = json.loads((tmp_path / "nodes-left-behind.jsonl").read_text())
    assert entry["token"] == "slurm-9-0" and entry["spare"] == {"node": 2, "host": "c3"}
    assert left_behind_detail(tmp_path, "10") == ""  # another job's


# ------------------------------------------------------- the field and what it renders


def _spec(**over: object) -> dict:
    spec: dict = {
        "name": "spares",
        "train": {"model": {"llama": {}}, "data": {"builtin": "python-stdlib"}, "steps": 10},
        "checkpoint": {"every_steps": 5},
        "resources": {"nodes": 2, "procs_per_node": 1, "device": "cpu"},
        "slurm": {"spare_nodes": 1},
    }
    for key, value in over.items():
        spec[key] = value
    return spec


@pytest.mark.parametrize(
    ("over", "said"),
    [
        ({"slurm": {"spare_nodes": -1}}, "slurm.spare_nodes: Input should be greater than"),
        ({"slurm": {"spare_nodes": "one"}}, "slurm.spare_nodes: Input should be a valid integer"),
        ({"slurm": {"spare_nodes": 1.5}}, "slurm.spare_nodes: Input should be a valid integer"),
        (
            {"slurm": {"spare_nodes": 99999}},
            "slurm.spare_nodes 99999 with resources.nodes 2 asks Slurm for 100001 nodes; "
            "accepted: at most 100000 in all (spare_nodes 0 to 99998)",
        ),
        (
            {"resources": {"nodes": 1}},
            "slurm.spare_nodes 1 with resources.nodes 1: a spare replaces a training node "
            "other than the first",
        ),
        (
            {"restart": {"max_in_allocation": 0}},
            "slurm.spare_nodes 1 with restart.max_in_allocation 0: a spare takes a bad node's "
            "place in a restart in place, and none would run",
        ),
    ],
)
def test_a_bad_spare_nodes_is_one_line_naming_the_field(over: dict, said: str) -> None:
    with pytest.raises(SpecError) as caught:
        parse_spec(_spec(**over))
    # One line naming the field among the spec's problems (no other problem here).
    assert [p for p in caught.value.problems if said in p] == caught.value.problems


def test_validate_says_the_spares(tmp_path: Path) -> None:
    from click.testing import CliRunner
    from shardctl.orchestrator.cli import cli

    path = tmp_path / "spares.yaml"
    path.write_text(json.dumps(_spec(slurm={"spare_nodes": 2})))  # JSON is YAML
    res = CliRunner().invoke(cli, ["validate", str(path), "--cluster", "slurm"])
    assert res.exit_code == 0, res.output
    assert "world size 2 (+ 2 spare node(s) standing by in the allocation)," in res.output
    path.write_text(json.dumps(_spec(slurm={})))
    res = CliRunner().invoke(cli, ["validate", str(path), "--cluster", "slurm"])
    assert res.exit_code == 0 and "spare node" not in res.output, res.output


def test_the_job_asks_for_the_spares_and_the_launcher_trains_on_the_others(
    tmp_path: Path,
) -> None:
    spec = parse_spec({**_spec(), "run_dir": str(tmp_path / "run")})
    assert submitit_parameters(spec)["nodes"] == 3
    files = SlurmCluster().dryrun(spec).artifacts
    env = files["env.sh"]
    # torchrun's --nnodes is the training nodes; the node rank comes from the node task.
    assert "export SHARDCTL_NNODES=2\n" in env
    assert 'export SHARDCTL_NODE_RANK="${SHARDCTL_NODE_RANK:?' in env
    assert "SLURM_JOB_NUM_NODES" not in env
    assert json.loads(files["submitit.json"])["task"]["spare_nodes"] == 1
    assert "--spare-nodes 1 -- bash" in files["job.sbatch"]
    assert "#SBATCH --nodes=3" in files["job.sbatch"]
    # Without spares, nothing of it is rendered.
    plain = parse_spec({**_spec(slurm={}), "run_dir": str(tmp_path / "run")})
    files = SlurmCluster().dryrun(plain).artifacts
    assert "spare_nodes" not in json.loads(files["submitit.json"])["task"]
    assert "--spare-nodes" not in files["job.sbatch"]
    assert "#SBATCH --nodes=2" in files["job.sbatch"]
    assert 'SHARDCTL_NNODES="${SLURM_JOB_NUM_NODES:?' in files["env.sh"]


def test_slurms_refusal_of_the_node_count_names_the_spares_too() -> None:
    spec = parse_spec(_spec())
    said = refused(spec, "Node count specification invalid", lambda argv: "")
    assert said.startswith(
        "resources.nodes 2 + slurm.spare_nodes 1 (3 nodes) was refused by Slurm "
        "(Node count specification invalid)"
    ), said


def test_doctors_network_probe_runs_on_the_spares_too(tmp_path: Path, monkeypatch) -> None:
    from shardctl.orchestrator.clusters.slurm.preflight import slurm_checks

    seen = tmp_path / "srun-args"
    srun = tmp_path / "bin" / "srun"
    srun.parent.mkdir()
    srun.write_text(f'#!/bin/sh\necho "$@" > {seen}\necho "no nodes here" >&2\nexit 1\n')
    srun.chmod(0o755)
    monkeypatch.setenv("PATH", f"{srun.parent}{os.pathsep}{os.environ['PATH']}")
    spec = parse_spec({**_spec(), "run_dir": str(tmp_path / "run")})
    checks, rows = slurm_checks(spec)
    assert rows == []
    assert "--nodes=3 " in seen.read_text()
    assert all("no allocation of 3 node(s)" in c.detail for c in checks), checks


# ------------------------------------------- three node tasks of one allocation, no Slurm

# Round 0: on node rank 1 a rank is killed (KILLED names node rank 1, exit 137) or
# stops (its watchdog's HUNG names rank 1 on node rank 1, exit 124); node rank 0's
# ranks then lose their peer. Later rounds end well. Every round appends what it ran as.
LAUNCH = """#!/usr/bin/env bash
echo "${SLURM_NODEID} ${SHARDCTL_NODE_RANK} ${SHARDCTL_RESTART}" >> "$OUT/ran"
echo "${SLURM_NODEID} ${SHARDCTL_RESTART} fresh=${SHARDCTL_MEMORY_FRESH_NODES:-}" >> "$OUT/fresh"
if [ "${SHARDCTL_RESTART}" = "0" ]; then
  if [ "${SHARDCTL_NODE_RANK}" = "1" ]; then
    "$PY" -c "$FAULT"
    exit "$CODE"
  fi
  for _ in $(seq 600); do [ -e "$RUN/$MARKER" ] && exit "$PEER_CODE"; sleep 0.1; done
  exit 2
fi
exit 0
"""

FAULT = """
import os, time
from shardctl.orchestrator.outcome import killed_marker
from shardctl.orchestrator.rundir import RunDir
rank = int(os.environ["SHARDCTL_NODE_RANK"])
marker = os.environ["MARKER"]
if marker == "KILLED":
    data = killed_marker(rank, rank, "host", 9)
else:  # what the watchdog of the node with the stopped rank writes
    data = {"kind": "hung", "step": 10, "rank": rank, "node": rank, "first": [rank]}
RunDir.of(os.environ["RUN"]).write_first_marker(
    marker, data, time.time() - 60, os.environ["SHARDCTL_ATTEMPT_TOKEN"]
)
"""
# (the marker, node rank 1's launcher code, node rank 0's, the round's kind, the why)
FAULTS = {
    "killed": ("KILLED", 137, 1, "failed", "rank 1 was killed by SIGKILL on node 1"),
    "hung": ("HUNG", 124, 124, "hung", "hung at step 10"),
}

TASK = """
import sys
from shardctl.orchestrator.clusters.slurm import NodeTask
task = NodeTask(command=["bash", sys.argv[1]], run_dir=sys.argv[2], max_restarts=2,
                spare_nodes=1)
print("RESULT", task(), flush=True)
"""


@pytest.mark.timeout(240)
@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_fault_pinned_on_node_1_hands_the_next_round_to_the_spare(
    tmp_path: Path, fault: str
) -> None:
    marker, code, peer_code, kind, why = FAULTS[fault]
    run_dir, out = tmp_path / "run", tmp_path / "out"
    run_dir.mkdir()
    out.mkdir()
    launch = tmp_path / "launch.sh"
    launch.write_text(LAUNCH)
    procs = []
    for node in range(3):
        env = {
            **os.environ, "OUT": str(out), "RUN": str(run_dir), "PY": sys.executable,
            "FAULT": FAULT, "MARKER": marker, "CODE": str(code), "PEER_CODE": str(peer_code),
            "SLURM_NODEID": str(node), "SLURM_JOB_ID": "7",
            "SLURM_RESTART_COUNT": "0", "SLURM_JOB_NUM_NODES": "3",
        }  # fmt: skip
        env.pop("SLURM_JOB_NODELIST", None)
        procs.append(subprocess.Popen(
            [sys.executable, "-c", TASK, str(launch), str(run_dir)], env=env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True,
        ))  # fmt: skip
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=200)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    node0, node1, spare = outputs
    assert "RESULT finished" in node0, node0
    assert "RESULT finished" in spare, spare
    assert "RESULT stood by" in node1, node1  # the bad node sat the restart out
    # Round 0 on nodes 0 and 1; round 1 on node 0 and the spare, as node rank 1.
    ran = sorted((out / "ran").read_text().splitlines())
    assert ran == ["0 0 0", "0 0 1", "1 1 0", "2 1 1"], ran
    # Both nodes of round 1 tell their ranks that node rank 1's memory is new.
    fresh = sorted((out / "fresh").read_text().splitlines())
    assert fresh == ["0 0 fresh=", "0 1 fresh=1", "1 0 fresh=", "2 1 fresh=1"], fresh
    assert "spare node 2 (node 2) trains as node rank 1 from restart 1" in node0, node0
    entry = json.loads((run_dir / "nodes-left-behind.jsonl").read_text())
    assert (entry["node"], entry["rank"], entry["spare"]["node"]) == (1, 1, 2)
    assert entry["token"] == "slurm-7-0" and entry["restart"] == 1
    assert entry["why"].startswith(why), entry
    ledger = [json.loads(x) for x in (run_dir / "attempts.jsonl").read_text().splitlines()]
    assert [(e["restart"], e["kind"], e["decision"]) for e in ledger] == [
        (0, kind, "restart"), (1, "done", "finish"),
    ]  # fmt: skip


# ------------------------------------------------------------------- the dev cluster

TIER_EVERY = 50
MEMORY_EVERY = 2
STEPS = 150


def _accounted_runs(job_id: str) -> list[str]:
    """The job's records in Slurm's accounting, one per start (`-D`: a requeued job
    keeps a record for each of its allocations)."""
    proc = subprocess.run(
        ["sacct", "-j", job_id, "-D", "-X", "-n", "-P", "-o", "JobID,State"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    return proc.stdout.split()


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_rank_killed_on_node_1_goes_on_on_the_spare_same_job_no_requeue(
    resize_cluster: Callable[..., None], tmp_path: Path
) -> None:
    resize_cluster(3, or_more=True)  # 2 nodes and the spare
    args = ["0.1", "fsdp2_script.py", "--steps", str(STEPS), "--log-every", "1"]
    spec = _own_spec("spares-kill", PACED_SCRIPT, args)
    spec["resources"] = {"nodes": 2, "procs_per_node": 1, "device": "cpu"}
    # The memory tier on (the script's Checkpointer gets it by configuration): the
    # spare's ranks restore node 1's slice from node 0's partner copy.
    # Durable every 50 steps, a memory copy every 2: the kill lands well past both.
    spec["checkpoint"] = {"every_steps": TIER_EVERY, "keep": 2, "consolidate_on_finish": False,
                          "memory_every_steps": MEMORY_EVERY}  # fmt: skip
    spec["restart"] = {"max_in_allocation": 2}
    spec["slurm"] = {**spec["slurm"], "time": "00:20:00", "max_requeues": 1, "spare_nodes": 1}
    ref = _submitted(tmp_path, spec)
    run_dir = Path(ref.run_dir)
    cluster = SlurmCluster()
    module = "shardctl.train.entry"
    try:
        _wait(ref, lambda: (_last_checkpoint(run_dir) or 0) > 0, 600, "the first checkpoint")
        # A memory copy two copies past the durable checkpoint: its partner's copy is in.
        _wait(ref, lambda: (newest_memory_step(run_dir) or 0) >= TIER_EVERY + 2 * MEMORY_EVERY,
              120, "a memory copy past the durable checkpoint")  # fmt: skip
        victim = _wait(ref, lambda: _rank_of_node(run_dir, 1, 0, 0, module), 120, "a rank")
        os.kill(int(victim[0]), signal.SIGKILL)
        # The next round runs on the spare (Slurm's node 2); node 1 trains no more.
        _wait(ref, lambda: _rank_of_node(run_dir, 2, 0, 1, module), 600, "the spare's rank")
        assert _rank_of_node(run_dir, 1, 0, 1, module) is None
        assert _finished(ref, timeout=900) is JobState.SUCCEEDED, cluster.logs(ref, tail=60)
    finally:
        if not cluster.status(ref).state.is_terminal:
            subprocess.run(["scancel", ref.job_id], timeout=60, check=False)
    status = cluster.status(ref)
    assert status.native_state == "COMPLETED", status
    assert "requeued" not in status.detail, status
    assert _accounted_runs(ref.job_id) == [f"{ref.job_id}|COMPLETED"]  # one start: no requeue
    # (The rendezvous numbers nodes by arrival: the killed rank is the one node 1 ran.)
    assert f"(rank {victim[1]} was killed by SIGKILL on node 1" in status.detail, status
    assert "replaced by spare" in status.detail, status
    ledger = [json.loads(x) for x in (run_dir / "attempts.jsonl").read_text().splitlines()]
    rounds = [(e["job"], e["attempt"], e["restart"], e["kind"], e["decision"]) for e in ledger]
    assert rounds == [
        (ref.job_id, 0, 0, "failed", "restart"), (ref.job_id, 0, 1, "done", "finish"),
    ], rounds  # fmt: skip
    entry = json.loads((run_dir / "nodes-left-behind.jsonl").read_text())
    assert (entry["node"], entry["spare"]["node"], entry["job"]) == (1, 2, ref.job_id)
    # The spare's round resumed from memory, past the durable checkpoint: node 1's
    # slice from its partner's copy (the spare's own folder is not asked).
    restore = last_restore(run_dir)
    assert restore is not None and restore["tier"] == "partner", restore
    assert restore["step"] % MEMORY_EVERY == 0 and restore["step"] > TIER_EVERY, restore
    assert (_last_checkpoint(run_dir) or 0) == STEPS
    # status -o json carries the same line.
    shown = subprocess.run(
        [*SHARDCTL, "status", spec["name"], "-o", "json"],
        capture_output=True, text=True, timeout=120, check=False, cwd=tmp_path,
    )  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    assert "replaced by spare" in json.loads(shown.stdout)["detail"], shown.stdout

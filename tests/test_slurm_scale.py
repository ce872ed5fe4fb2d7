"""Scale: a 32-node job (32 emulated nodes × 1 CPU rank) runs a user's own training
script end to end on the dev cluster, and a 16-node job the built-in loop (the tiny
Llama; each of its ranks also imports transformers, so 16 is what fits 24 GiB beside
the rest): it starts (rendezvous of 32 launchers), survives
a rank SIGKILLed and a rank SIGSTOPped inside its allocation (every node restarts in
place, same job id), refuses a second submit of the same run while it lives, is
preempted with USR2 (every rank saves the same step, node 0 requeues), resumes in
the requeued allocation and completes.

The script is examples/fsdp2_script.py: FSDP2 over all 32 ranks (gloo all-gathers and
reduce-scatters every step) with the checkpoint library (`shardctl.train.api`).

The same job on 4 nodes runs in every suite run (a few minutes: more nodes than the
other Slurm tests' 2, so a restart's round ends on nodes that are neither node 0 nor
the one that failed); its script is paced (tests/helpers/paced_script.py) so that on
any host the job is still stepping when the last fault lands. The wide cases are
marked `scale`: only `scripts/test-all --scale` (pytest --scale) runs them. The session
fixture `resize_cluster` (tests/conftest.py) brings the dev cluster up with each case's
node count and back to its default 2 nodes at the end; this file and
test_slurm_spares.py run last of the Slurm files, so the other Slurm tests find 2.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from shardctl.orchestrator.clusters.base import JobState
from shardctl.orchestrator.clusters.slurm import SlurmCluster
from test_slurm_cluster import (  # the e2e helpers of the 2-node tests
    _finished,
    _last_checkpoint,
    _own_spec,
    _spec,
    _submit,
    _submitted,
    _wait,
)
from test_slurm_hang import _rank_of_node

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(3600)]

SCALE_NODES = int(os.environ.get("SHARDCTL_SCALE_NODES", "32"))
# The built-in loop's job: half the nodes (its ranks are heavier than a script's).
LOOP_NODES = max(2, SCALE_NODES // 2)
# Every suite run's case: more nodes than 2, in a few minutes.
SMALL_NODES = 4
EVERY = 5
# The wide jobs: 32 ranks share 2 cores, a step takes seconds, and 60 steps outlast the
# faults. The 4-node job's steps are paced (at least 0.1 s, tests/helpers/paced_script.py):
# here it saved step 17 at the preemption; the test's own calls between faults leave
# the ranks a few seconds of stepping, well under 200 steps at 10 a second on any host.
STEPS = {"wide": 60, "small": 200}
# A stopped rank is found hung after this long without a step.
HANG_TIMEOUT_S = {"wide": 60, "small": 20}

# (what the ranks run, the job's node count); the wide ones are marked `scale`.
CASES = [
    pytest.param("script", SMALL_NODES, id=f"script-{SMALL_NODES}-nodes"),
    pytest.param("script", SCALE_NODES, marks=pytest.mark.scale, id=f"script-{SCALE_NODES}-nodes"),
    pytest.param("loop", LOOP_NODES, marks=pytest.mark.scale, id=f"loop-{LOOP_NODES}-nodes"),
]


# What the ranks run: `-m shardctl.train.entry script ...` (a user's script) or
# `-m shardctl.train` (the built-in loop).
MODULES = {"script": "shardctl.train.entry", "loop": "shardctl.train"}
PACED_SCRIPT = "tests/helpers/paced_script.py"


def _size(nodes: int) -> str:
    return "small" if nodes == SMALL_NODES else "wide"


def _job_spec(kind: str, nodes: int) -> dict:
    """The spec of the `kind` job on `nodes` nodes."""
    steps = STEPS[_size(nodes)]
    if kind == "script":
        args = ["--steps", str(steps), "--log-every", "1"]
        if _size(nodes) == "wide":
            spec = _own_spec("scale-own", "examples/fsdp2_script.py", args)
        else:  # each step at least 0.1 s
            spec = _own_spec("scale-own", PACED_SCRIPT, ["0.1", "fsdp2_script.py", *args])
    else:
        spec = _spec("scale-loop", train={"steps": steps})
    spec["resources"] = {"nodes": nodes, "procs_per_node": 1, "device": "cpu"}
    spec["checkpoint"] = {"every_steps": EVERY, "keep": 2, "consolidate_on_finish": False}
    spec["watchdog"] = {"hang_timeout_s": HANG_TIMEOUT_S[_size(nodes)]}
    spec["restart"] = {"max_in_allocation": 3}
    spec["slurm"] = {**spec["slurm"], "time": "01:00:00", "max_requeues": 3}
    return spec


def _rank(run_dir: Path, node: int, restart: int, kind: str) -> int | None:
    """The pid of the rank on node `node` in round `restart` of the first allocation."""
    found = _rank_of_node(run_dir, node, 0, restart=restart, module=MODULES[kind])
    return found[0] if found else None


def _attempts(run_dir: Path) -> list[dict]:
    try:
        lines = (run_dir / "attempts.jsonl").read_text().splitlines()
    except OSError:
        return []
    return [json.loads(line) for line in lines if line.strip()]


def _newer_checkpoint(run_dir: Path, than: int) -> bool:
    return (_last_checkpoint(run_dir) or 0) > than


@pytest.mark.parametrize(("kind", "nodes"), CASES)
def test_a_wide_job_recovers_in_place_is_preempted_requeues_and_completes(
    resize_cluster: Callable[[int], None], tmp_path: Path, kind: str, nodes: int
) -> None:
    resize_cluster(nodes)
    spec = _job_spec(kind, nodes)
    steps, hang_timeout_s = STEPS[_size(nodes)], HANG_TIMEOUT_S[_size(nodes)]
    started = time.monotonic()
    ref = _submitted(tmp_path, spec)
    run_dir = Path(ref.run_dir)
    cluster = SlurmCluster()
    stopped: list[int] = []
    marks: dict[str, float] = {}
    try:
        # Every rank takes part in a checkpoint: the rendezvous of all nodes worked.
        _wait(ref, lambda: _newer_checkpoint(run_dir, 0), 1200, "the first checkpoint")
        marks["submit -> first checkpoint"] = time.monotonic() - started

        # A second writer of the same run is refused while this job lives.
        again = _submit(tmp_path, spec)
        assert again.returncode == 1, again.stdout
        assert f"job id {ref.job_id}" in " ".join(again.stderr.split()), again.stderr

        # A crash inside the allocation: a rank in the middle of the job is killed.
        victim = _wait(ref, lambda: _rank(run_dir, nodes // 2, 0, kind), 120, "a rank")
        at = _last_checkpoint(run_dir) or 0
        fault = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        _wait(ref, lambda: _rank(run_dir, nodes // 2, 1, kind), 900, "the restarted rank")
        _wait(ref, lambda: _newer_checkpoint(run_dir, at), 900, "a checkpoint after the crash")
        marks["crash -> newer checkpoint"] = time.monotonic() - fault

        # A hang inside the allocation: another node's restarted rank stops.
        victim = _wait(ref, lambda: _rank(run_dir, nodes // 4, 1, kind), 120, "a rank")
        at = _last_checkpoint(run_dir) or 0
        fault = time.monotonic()
        os.kill(victim, signal.SIGSTOP)
        stopped.append(victim)
        _wait(ref, lambda: _rank(run_dir, nodes // 4, 2, kind), hang_timeout_s + 900,
              "the rank restarted after the hang")  # fmt: skip
        _wait(ref, lambda: _newer_checkpoint(run_dir, at), 900, "a checkpoint after the hang")
        marks["hang -> newer checkpoint"] = time.monotonic() - fault

        # A preemption: USR2 reaches every rank, they save one step, node 0 requeues.
        fault = time.monotonic()
        subprocess.run(["scancel", "--signal=USR2", ref.job_id], check=True, timeout=60)
        # Written once every rank saved the same step.
        _wait(ref, lambda: (run_dir / "PREEMPTED").exists(), 600, "the preemption save")
        marks["USR2 -> every rank saved"] = time.monotonic() - fault
        assert _finished(ref, timeout=2400) is JobState.SUCCEEDED, cluster.logs(ref, tail=80)
    finally:
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        if not cluster.status(ref).state.is_terminal:
            subprocess.run(["scancel", ref.job_id], timeout=60, check=False)
    print(f"{kind}, {nodes} nodes: " + ", ".join(f"{k} {v:.0f} s" for k, v in marks.items()))

    # The crash and the hang were restarts in place (one allocation, rounds r0 to r2);
    # the preemption alone requeued (the same job id, its second allocation).
    status = cluster.status(ref)
    assert status.native_state == "COMPLETED" and "requeued 1 time" in status.detail, status
    attempts = _attempts(run_dir)
    rounds = [(a["job"], a["attempt"], a["restart"], a["kind"], a["decision"]) for a in attempts]
    assert rounds == [
        (ref.job_id, 0, 0, "failed", "restart"), (ref.job_id, 0, 1, "hung", "restart"),
        (ref.job_id, 0, 2, "preempted", "retry"), (ref.job_id, 1, 0, "done", "finish"),
    ], rounds  # fmt: skip
    logs = cluster.logs(ref)
    for n in (1, 2):
        assert f"restarting every rank in this allocation ({n} of at most 3)" in logs, logs
    assert "node 0 restarts every node in place" in logs and f"requeueing job {ref.job_id}" in logs
    # The hung rank's stacks, named by the round and the node it hung on.
    assert (run_dir / "logs" / f"hang-attempt0-restart1-node{nodes // 4}.txt").is_file()
    # Each start after the first resumed from a checkpoint: after the crash and the hang
    # a periodic one; after the requeue the preemption's save (PREEMPTED is gone once
    # the run is DONE), the newest complete checkpoint when node 0 judged that round.
    saved = attempts[2]["checkpoint_step"]
    assert saved > EVERY, saved
    # (Rank 0 may be on another node each round, and the logs come node by node: the
    # steps, not the order of the lines, say which resume came first.)
    resumed = sorted(int(step) for step in re.findall(r"resumed at step (\d+)", logs))
    assert len(resumed) == 3 and resumed[-1] == saved, resumed
    assert all(step > 0 and step % EVERY == 0 for step in resumed[:2]), resumed
    # The last start's claim: the requeued allocation's first round (no "-r<N>").
    claimed = json.loads((run_dir / "CURRENT_ATTEMPT").read_text())
    assert claimed["token"] == f"slurm-{ref.job_id}-1", claimed
    assert (run_dir / "DONE").is_file() and (_last_checkpoint(run_dir) or 0) == steps

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

Marked `scale`: only `scripts/test-all --scale` (pytest --scale) runs it. The module
fixture brings the dev cluster up with SCALE_NODES nodes and back to its default 2
nodes afterwards, so the other Slurm tests find what they expect.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from shardctl.orchestrator.clusters.base import JobState
from shardctl.orchestrator.clusters.slurm import SlurmCluster
from test_slurm_cluster import (  # the e2e helpers of the 2-node tests
    ROOT,
    _finished,
    _last_checkpoint,
    _own_spec,
    _spec,
    _submit,
    _submitted,
    _wait,
)
from test_slurm_hang import _rank_of_node

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.scale, pytest.mark.timeout(3600)]

SCALE_NODES = int(os.environ.get("SHARDCTL_SCALE_NODES", "32"))
# The built-in loop's job: half the nodes (its ranks are heavier than a script's).
LOOP_NODES = max(2, SCALE_NODES // 2)
EVERY = 5
STEPS = 60
HANG_TIMEOUT_S = 60  # 32 ranks share 2 cores: a step takes seconds, not milliseconds
DEV_CLUSTER = ROOT / "scripts" / "slurm-dev-cluster"


def _dev_cluster(*args: str) -> None:
    proc = subprocess.run(
        ["bash", str(DEV_CLUSTER), "up", *args], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.fixture(scope="module")
def scale_cluster() -> Iterator[int]:
    """The dev cluster with SCALE_NODES nodes; its default 2 nodes again afterwards."""
    if os.geteuid() != 0:
        pytest.skip("bringing the dev cluster up needs root")
    _dev_cluster("--nodes", str(SCALE_NODES))
    try:
        yield SCALE_NODES
    finally:
        _dev_cluster()


# What the ranks run: `-m shardctl.train.entry script ...` (a user's script) or
# `-m shardctl.train` (the built-in loop).
MODULES = {"script": "shardctl.train.entry", "loop": "shardctl.train"}


def _job_spec(kind: str) -> tuple[dict, int]:
    """The spec of the `kind` job and its node count."""
    if kind == "script":
        args = ["--steps", str(STEPS), "--log-every", "1"]
        spec, nodes = _own_spec("scale-own", "examples/fsdp2_script.py", args), SCALE_NODES
    else:
        spec, nodes = _spec("scale-loop", train={"steps": STEPS}), LOOP_NODES
    spec["resources"] = {"nodes": nodes, "procs_per_node": 1, "device": "cpu"}
    spec["checkpoint"] = {"every_steps": EVERY, "keep": 2, "consolidate_on_finish": False}
    spec["watchdog"] = {"hang_timeout_s": HANG_TIMEOUT_S}
    spec["restart"] = {"max_in_allocation": 3}
    spec["slurm"] = {**spec["slurm"], "time": "01:00:00", "max_requeues": 3}
    return spec, nodes


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


@pytest.mark.parametrize("kind", ["script", "loop"])
def test_a_wide_job_recovers_in_place_is_preempted_requeues_and_completes(
    scale_cluster: int, tmp_path: Path, kind: str
) -> None:
    spec, nodes = _job_spec(kind)
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
        _wait(ref, lambda: _rank(run_dir, nodes // 4, 2, kind), HANG_TIMEOUT_S + 900,
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

    status = cluster.status(ref)
    assert status.native_state == "COMPLETED" and "requeued 1 time" in status.detail, status
    kinds = [(a["attempt"], a["kind"], a["decision"]) for a in _attempts(run_dir)]
    assert kinds == [
        (0, "failed", "restart"), (0, "hung", "restart"), (0, "preempted", "retry"),
        (1, "done", "finish"),
    ], kinds  # fmt: skip
    # The preemption's save (PREEMPTED is gone once the run is DONE): the newest
    # complete checkpoint when node 0 judged that attempt, where the requeue resumed.
    saved = _attempts(run_dir)[2]["checkpoint_step"]
    assert saved > 10, saved
    logs = cluster.logs(ref)
    assert f"resumed at step {saved} " in logs, logs[-3000:]
    assert (_last_checkpoint(run_dir) or 0) == STEPS

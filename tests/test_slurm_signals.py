"""A preemption signal on real Slurm, whichever process it reaches first: the batch
step's shell (`scancel --signal=USR2 --batch`, or a spec's `slurm.signal_to: batch`
rendered `--signal=B:USR2@N`), or a node task that is still starting. Each ends
requeued and then COMPLETED, never FAILED.

The ranks run a plain script without torch (`tests/data/usercode/no_handler_once.py`:
it says each rank is ready, then waits; run again after the requeue it ends at once),
so each job costs seconds, not a model's start-up; what is tested is the path of the
signal from Slurm to the node tasks. Every job is cancelled when its test fails.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
from shardctl.orchestrator.clusters.base import JobRef, JobState
from shardctl.orchestrator.clusters.slurm import SlurmCluster
from test_slurm_cluster import (  # the dev cluster's fixture and the e2e helpers
    _finished,
    _spec,
    _submitted,
    _wait,
    slurm_cluster,  # noqa: F401  (a fixture)
)

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parent.parent


def _plain_spec(name: str, folder: Path, **slurm: Any) -> dict[str, Any]:
    """2 nodes × 1 rank of the plain script, which marks `folder/ready-<rank>`."""
    spec = _spec(name, checkpoint={"every_steps": 5, "keep": 2, "consolidate_on_finish": False})
    del spec["train"]
    script = ROOT / "tests" / "data" / "usercode" / "no_handler_once.py"
    spec["entrypoint"] = {"script": str(script), "args": [str(folder)]}
    spec["slurm"].update(slurm)
    return spec


def _both_ranks_ready(ref: JobRef, folder: Path) -> None:
    _wait(ref, lambda: all((folder / f"ready-{r}").exists() for r in (0, 1)), 180,
          "both ranks to start")  # fmt: skip


def _requeued_and_completed(ref: JobRef) -> str:
    """Wait for the requeue, then for the job's end: SUCCEEDED. The node tasks' logs."""
    cluster = SlurmCluster()
    _wait(ref, lambda: "requeued 1 time" in cluster.status(ref).detail, 120, "the requeue")
    state = _finished(ref)
    logs = cluster.logs(ref)
    assert state is JobState.SUCCEEDED, logs
    return logs


def test_usr2_sent_to_the_batch_step_only_requeues(
    slurm_cluster: None,  # noqa: F811
    tmp_path: Path,
) -> None:
    """`scancel --signal=USR2 --batch`: only the batch shell gets it. It passes the
    signal on to the node tasks (srun forwards it), the ranks say nothing was saved,
    node 0 requeues; without the batch shell's trap it died of the signal and the job
    ended FAILED."""
    ref = _submitted(tmp_path, _plain_spec("sig-batch", tmp_path))
    _both_ranks_ready(ref, tmp_path)
    subprocess.run(["scancel", "--signal=USR2", "--batch", ref.job_id], check=True, timeout=30)
    logs = _requeued_and_completed(ref)
    assert logs.count("got SIGUSR2 (sent to the batch shell)") == 2, logs  # each node
    assert "nothing was saved" in logs, logs

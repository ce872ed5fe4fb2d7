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

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from shardctl.orchestrator.clusters.base import JobRef, JobState
from shardctl.orchestrator.clusters.slurm import SlurmCluster
from test_slurm_cluster import (  # the dev cluster's fixture and the e2e helpers
    SHARDCTL,
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
    # The script never installs a handler: the warning is held 3 s, not the default 30.
    spec["env"] = {"SHARDCTL_WARNING_HOLD_S": "3"}
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


# The batch shell's setup holds the job's start until the batch shell has written the
# warning down (its trap's file, `batch_signal.py`), at most 120 s; a requeued start
# (SLURM_RESTART_COUNT > 0) is not held.
HOLD_UNTIL_WARNED = (
    '[ "${SLURM_RESTART_COUNT:-0}" != 0 ] || for _ in $(seq 600); do '
    '[ -e "${shardctl_warning}" ] && break; sleep 0.2; done'
)


def test_time_limit_signal_to_the_batch_shell_while_starting_requeues(
    slurm_cluster: None,  # noqa: F811
    tmp_path: Path,
) -> None:
    """`slurm.signal_batch: true` renders `--signal=B:USR2@590`: the time-limit warning
    (due 10 s after the start, sent by ~40 s: Slurm's timer checks every 30 s) reaches
    the batch shell alone, while it is still in `slurm.setup` (held there until then),
    before any node task or rank exists. Both node tasks take it when they start, the
    ranks say nothing was saved yet, and the job is requeued, then COMPLETED; without
    the trap the batch shell died of it and the job ended FAILED."""
    spec = _plain_spec(
        "sig-b-start", tmp_path, time="10", signal_delay_s=590, signal_batch=True,
        setup=[HOLD_UNTIL_WARNED],
    )  # fmt: skip
    ref = _submitted(tmp_path, spec)
    assert "#SBATCH --signal=B:USR2@590\n" in (Path(ref.run_dir) / "sbatch.sh").read_text()
    cluster = SlurmCluster()
    _wait(ref, lambda: "requeued 1 time" in cluster.status(ref).detail, 180, "the requeue")
    # The requeued start's own warning 50 min away: it finishes.
    subprocess.run(
        ["scontrol", "update", f"jobid={ref.job_id}", "TimeLimit=60"], check=True, timeout=30
    )
    state = _finished(ref)
    logs = cluster.logs(ref)
    assert state is JobState.SUCCEEDED, logs
    assert logs.count("got SIGUSR2 (sent to the batch shell)") == 2, logs
    assert "nothing was saved" in logs, logs
    assert all((tmp_path / f"ready-{r}").exists() for r in (0, 1))


def test_job_sbatch_by_hand_runs_the_node_task_fenced_and_requeues(
    slurm_cluster: None,  # noqa: F811
    tmp_path: Path,
) -> None:
    """`shardctl render --cluster slurm`, then plain `sbatch rendered/job.sbatch`: every
    node runs shardctl's node task (the one submitit runs), so node 0 claims the
    attempt's token (fenced: `CURRENT_ATTEMPT`), records the attempt, and a USR2 sent
    to the batch shell alone is taken by both nodes and requeues the job, which resumes
    under the next token and COMPLETES."""
    spec = _plain_spec("sig-by-hand", tmp_path)
    spec["run_dir"] = str(tmp_path / "runs" / "sig-by-hand")
    path = tmp_path / "sig-by-hand.yaml"
    path.write_text(yaml.safe_dump(spec))
    rendered = tmp_path / "rendered"
    subprocess.run(
        [*SHARDCTL, "render", str(path), "--cluster", "slurm", "--out", str(rendered)],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    submitted = subprocess.run(
        ["sbatch", "--parsable", f"--export=ALL,SHARDCTL_PYTHON={sys.executable}",
         str(rendered / "job.sbatch")],
        cwd=tmp_path, check=True, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    job_id = submitted.stdout.strip().split(";")[0]
    run_dir = Path(spec["run_dir"])
    ref = JobRef("slurm", job_id, "sig-by-hand", str(run_dir))
    log = tmp_path / f"slurm-{job_id}.out"
    try:
        _both_ranks_ready(ref, tmp_path)
        token = json.loads((run_dir / "CURRENT_ATTEMPT").read_text())["token"]
        assert token == f"slurm-{job_id}-0"
        subprocess.run(["scancel", "--signal=USR2", "--batch", job_id], check=True, timeout=30)
        cluster = SlurmCluster()
        _wait(ref, lambda: "requeued 1 time" in cluster.status(ref).detail, 120, "the requeue")
        state = _finished(ref)
    finally:
        subprocess.run(["scancel", job_id], timeout=30, check=False)
    said = log.read_text(errors="replace")
    assert state is JobState.SUCCEEDED, said
    assert said.count("got SIGUSR2 (sent to the batch shell)") == 2, said
    assert f"requeueing job {job_id}" in said, said
    assert json.loads((run_dir / "CURRENT_ATTEMPT").read_text())["token"] == f"slurm-{job_id}-1"
    attempts = [json.loads(x) for x in (run_dir / "attempts.jsonl").read_text().splitlines()]
    assert [(a["attempt"], a["decision"]) for a in attempts] == [(0, "retry"), (1, "finish")]

""" "run complete" on a real Slurm: a user's script that finished, submitted again with
the same command, starts nothing (the rule every cluster shares,
`clusters.base.FinishedRun`; tests/test_run_complete.py has its cases and Kubernetes').

2 nodes × 1 rank of the dev cluster (`scripts/slurm-dev-cluster up`; the session
fixture of tests/test_slurm_cluster.py brings it up): one short job.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from shardctl.orchestrator.clusters.base import JobState
from shardctl.orchestrator.clusters.records import recall
from shardctl.orchestrator.clusters.slurm import SlurmCluster
from test_slurm_cluster import (  # the dev cluster's fixture and the e2e helpers
    _finished,
    _own_spec,
    _submit,
    _submitted,
    slurm_cluster,  # noqa: F401  (a fixture)
)

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(600)]


def test_a_finished_script_submitted_again_is_complete_and_queues_nothing(
    slurm_cluster: None,  # noqa: F811
    tmp_path: Path,
) -> None:
    spec = _own_spec("own-done-twice", "tests/data/usercode/exit_with.py", ["0"])
    ref = _submitted(tmp_path, spec)
    assert _finished(ref) is JobState.SUCCEEDED, SlurmCluster().logs(ref, tail=40)
    again = _submit(tmp_path, spec)
    assert again.returncode == 0, again.stderr
    assert f"own-done-twice: run complete (DONE in {ref.run_dir})" in again.stdout, again.stdout
    assert "nothing to do" in again.stdout
    # Nothing was queued: the record still names the first job, and submitit wrote
    # no second submission script.
    assert recall("own-done-twice").job_id == ref.job_id
    assert [p.name for p in Path(ref.extra["folder"]).glob("*_submission.sh")] == [
        f"{ref.job_id}_submission.sh"
    ]

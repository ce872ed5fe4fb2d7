""" "run complete" on every cluster: a second `submit` of work that already finished
starts nothing. One rule (`clusters.base.FinishedRun.completes`): the built-in loop's
DONE reached `train.steps`; a script's DONE ran the same command and its attempt left
no FAILED, HUNG or KILLED. Where the run dir is here (local, Slurm) DONE is read from
it; on Kubernetes a job of the same name that succeeded and the job.yaml it ran say it.

The local cluster's end-to-end runs are in test_local_cluster.py, test_one_writer.py and
test_unmodified_scripts.py; Slurm's in test_slurm_run_complete.py.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import kmock
import yaml
from helpers.kmock_server import PYTORCHJOBS, KMockServer
from shardctl.orchestrator.clusters.base import FinishedRun, finished_in
from shardctl.orchestrator.outcome import done_marker, failed_marker, killed_marker
from shardctl.orchestrator.rundir import DONE_FILE, FAILED_FILE, KILLED_FILE, RunDir, stamped
from shardctl.orchestrator.spec import parse_spec
from test_k8s_client import NAME, NS, set_conditions, shardctl
from test_k8s_client import server as kmock_api
from test_k8s_render import BASE

server = kmock_api  # the fixture: a kmock API server, the kubeconfig pointed at it
SCRIPT_WORDS = ["script", "/code/train.py", "--lr", "1e-3"]


def _marker(run_dir: Path, name: str, data: dict[str, Any], token: str) -> None:
    """A marker as the ranks and node tasks write it (`outcome`'s helpers), by `token`'s
    attempt."""
    RunDir(run_dir).write_marker(name, stamped(data, token))


def _script_spec(args: list[str]) -> Any:
    data = {k: v for k, v in BASE.items() if k not in ("train", "k8s")}
    return parse_spec({**data, "entrypoint": {"script": "/code/train.py", "args": args}})


# ------------------------------------------------------------------ the rule


def test_the_loop_is_complete_once_its_done_step_reaches_train_steps() -> None:
    loop = parse_spec(BASE)  # train.steps: 4
    assert FinishedRun("x", step=4).completes(loop)
    assert FinishedRun("x", step=9).completes(loop)
    assert not FinishedRun("x", step=3).completes(loop)
    assert not FinishedRun("x", step=None, command=SCRIPT_WORDS).completes(loop)


def test_a_script_is_complete_only_for_the_same_command() -> None:
    done = FinishedRun("x", step=None, command=SCRIPT_WORDS)
    assert done.completes(_script_spec(["--lr", "1e-3"]))
    assert not done.completes(_script_spec(["--lr", "2e-3"]))
    assert not FinishedRun("x", step=100).completes(_script_spec(["--lr", "1e-3"]))


def test_a_scripts_done_counts_only_when_no_rank_of_its_attempt_failed(tmp_path: Path) -> None:
    run = tmp_path / "run"
    assert finished_in(run) is None
    _marker(run, DONE_FILE, {**done_marker(None), "command": SCRIPT_WORDS}, "a-1")
    found = finished_in(run)
    assert found is not None and found.command == SCRIPT_WORDS
    assert found.where == f"DONE in {run.resolve()}"
    # Rank 1 of the same attempt exited 3 after rank 0 wrote DONE: not a success.
    _marker(run, FAILED_FILE, failed_marker(3, 1), "a-1")
    assert finished_in(run) is None
    # An earlier attempt's FAILED is not evidence against this attempt's DONE.
    _marker(run, FAILED_FILE, failed_marker(3, 1), "a-0")
    assert finished_in(run) is not None
    # A rank of DONE's attempt killed (its node task's KILLED): not a success either.
    _marker(run, KILLED_FILE, killed_marker(1, 1, "node-1", signal.SIGKILL), "a-1")
    assert finished_in(run) is None


def test_a_scripts_done_is_judged_by_its_token_not_by_times(tmp_path: Path) -> None:
    """DONE's attempt is its token's: a FAILED of that attempt written by a node whose
    clock is an hour behind still counts against it; a tokenless FAILED (a launch.sh
    run by hand) in DONE's second is not its attempt's. A DONE without a token (an
    older version's) keeps the time rule."""
    run = tmp_path / "run"
    _marker(run, DONE_FILE, {**done_marker(None), "command": SCRIPT_WORDS}, "a-1")
    _marker(run, FAILED_FILE, failed_marker(3, 1), "a-1")
    os.utime(run / FAILED_FILE, (time.time() - 3600,) * 2)
    assert finished_in(run) is None
    RunDir(run).write_marker(FAILED_FILE, failed_marker(3, 1))  # no token
    done_at = (run / DONE_FILE).stat().st_mtime
    os.utime(run / FAILED_FILE, (done_at, done_at))
    assert finished_in(run) is not None
    (run / DONE_FILE).write_text(json.dumps({**done_marker(None), "command": SCRIPT_WORDS}))
    os.utime(run / DONE_FILE, (done_at, done_at))
    assert finished_in(run) is None  # tokenless both: the same second is one attempt
    os.utime(run / FAILED_FILE, (done_at - 3600, done_at - 3600))
    assert finished_in(run) is not None


def test_the_loops_done_is_its_step(tmp_path: Path) -> None:
    _marker(tmp_path, DONE_FILE, done_marker(4), "a-1")
    found = finished_in(tmp_path)
    assert found is not None and (found.step, found.command) == (4, None)


# ------------------------------------------------------------------ Kubernetes (kmock)


def _write(tmp_path: Path, name: str, **train: Any) -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump({**BASE, "train": {**BASE["train"], **train}}))
    return path


def _changes(api: KMockServer) -> list[str]:
    """The API calls that create or delete anything, as 'METHOD plural'."""
    writes = (kmock.method.POST, kmock.method.DELETE, kmock.method.PUT, kmock.method.PATCH)
    return [f"{r.method} {r.resource.plural}" for r in api.requests() if r.method in writes]


def test_a_k8s_run_that_succeeded_is_complete_and_starts_nothing(
    server: KMockServer,
    tmp_path: Path,
) -> None:
    spec = _write(tmp_path, "job.yaml")
    shardctl("submit", str(spec), "--cluster", "k8s")
    # Still running: the usual refusal of a job of the same name.
    set_conditions(server, ("Created", "True"), ("Running", "True"))
    running = shardctl("submit", str(spec), "--cluster", "k8s", check=False)
    assert running.exit_code == 1 and "--replace" in running.stderr, running.output
    set_conditions(server, ("Running", "False"), ("Succeeded", "True"))
    created = _changes(server)
    for extra in ([], ["--replace"]):
        again = shardctl("submit", str(spec), "--cluster", "k8s", *extra)
        assert f"{NAME}: run complete (PyTorchJob {NS}/{NAME} succeeded" in again.output
        assert "nothing to do" in again.output and "submitted" not in again.output
        assert _changes(server) == created  # nothing created, nothing deleted
    # More steps are more work: the usual conflict, and --replace starts it.
    longer = _write(tmp_path, "longer.yaml", steps=6)
    refused = shardctl("submit", str(longer), "--cluster", "k8s", check=False)
    assert refused.exit_code == 1 and "--replace" in refused.stderr, refused.output
    replaced = shardctl("submit", str(longer), "--cluster", "k8s", "--replace")
    assert "run complete" not in replaced.output and f"as {NS}/{NAME}" in replaced.output
    assert "steps: 6" in server.objects("v1/configmaps")[(NS, f"{NAME}-spec")]["data"]["job.yaml"]


def test_a_k8s_script_is_complete_for_the_same_command_only(
    server: KMockServer,
    tmp_path: Path,
) -> None:
    (tmp_path / "train.py").write_text("print('hello')\n")
    spec = _write(tmp_path, "job.yaml")
    script = str(tmp_path / "train.py")
    shardctl("submit", str(spec), "--cluster", "k8s", "--", script, "--lr", "1e-3")
    set_conditions(server, ("Running", "False"), ("Succeeded", "True"))
    again = shardctl("submit", str(spec), "--cluster", "k8s", "--", script, "--lr", "1e-3")
    assert "run complete" in again.output, again.output
    other = shardctl(
        "submit", str(spec), "--cluster", "k8s", "--replace", "--", script, "--lr", "2e-3"
    )
    assert "run complete" not in other.output and f"as {NS}/{NAME}" in other.output
    assert (NS, NAME) in server.objects(PYTORCHJOBS)


def test_a_failed_k8s_job_is_not_complete(server: KMockServer, tmp_path: Path) -> None:
    spec = _write(tmp_path, "job.yaml")
    shardctl("submit", str(spec), "--cluster", "k8s")
    set_conditions(server, ("Running", "False"), ("Failed", "True"))
    again = shardctl("submit", str(spec), "--cluster", "k8s", "--replace")
    assert "run complete" not in again.output and f"as {NS}/{NAME}" in again.output


def test_a_role_that_cannot_read_configmaps_submits_as_before(
    server: KMockServer, tmp_path: Path
) -> None:
    """An older manifests/rbac.yaml grants no `get` on ConfigMaps: nothing is known
    finished, and a job of the same name is refused as it always was (no 403 error)."""
    spec = _write(tmp_path, "job.yaml")
    shardctl("submit", str(spec), "--cluster", "k8s")
    set_conditions(server, ("Running", "False"), ("Succeeded", "True"))
    server.fail("get", "v1/configmaps", 403, 'configmaps is forbidden: User "dev" cannot get')
    again = shardctl("submit", str(spec), "--cluster", "k8s", check=False)
    assert again.exit_code == 1 and "already exists" in again.stderr, again.output
    assert "forbidden" not in again.output


# ------------------------------------------------------------------ local


def test_the_local_exit_code_is_evidence_of_its_own_attempt_only(tmp_path: Path) -> None:
    """The supervisor's exit code belongs to the run's current attempt: 0 there says
    nothing of an earlier start whose DONE a failed rank of its own contradicts."""
    from shardctl.orchestrator.clusters.local import EXIT_FILE, LocalCluster
    from shardctl.orchestrator.fence import claim_attempt

    script = tmp_path / "train.py"
    script.write_text("print('hello')\n")
    spec = parse_spec(
        {"name": "here", "run_dir": str(tmp_path / "run"), "entrypoint": {"script": str(script)}}
    )
    run = tmp_path / "run"
    words = ["script", str(script)]
    _marker(run, DONE_FILE, {**done_marker(None), "command": words}, "local-1")
    _marker(run, FAILED_FILE, failed_marker(3, 1), "local-1")
    (run / EXIT_FILE).write_text("0\n")
    local = LocalCluster()
    plan = local.dryrun(spec)
    claim_attempt(run, "local-2", cluster="local", attempt=2)  # a later start's
    assert local.complete_run(plan) is None
    # Where DONE is the current attempt's, its exit code 0 is that attempt's word.
    claim_attempt(run, "local-1", cluster="local", attempt=1)
    assert local.complete_run(plan) == f"DONE in {run.resolve()}"

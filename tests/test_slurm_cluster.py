"""shardctl on a real Slurm: two emulated nodes × 2 CPU ranks (gloo), through submitit.

The cluster is the project's own (`scripts/slurm-dev-cluster up`, which CI runs
before the tests; the session fixture runs it too, idempotently). Every job is
submitted through the CLI and followed through the backend's status, as a user
would. Total time on 2 cores: about 9 minutes.

The uninterrupted FSDP/torchrun run is the reference: a run preempted with
`scancel --signal=USR2`, one preempted by a job of a higher-priority partition,
and one whose node died (then resubmitted) must end with bit-identical weights;
the preempted ones log every step exactly once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers.train_run import assert_bit_equal
from shardctl.orchestrator.clusters.base import JobRef, JobState
from shardctl.orchestrator.clusters.records import recall, remember
from shardctl.orchestrator.clusters.slurm import SlurmCluster
from shardctl.orchestrator.errors import ClusterError
from shardctl.orchestrator.spec import parse_spec

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parent.parent
SHARDCTL = [sys.executable, "-m", "shardctl.orchestrator.cli"]
STEPS = 100
EVERY = 20


# ------------------------------------------------------------------ fixtures


def _slurm_up() -> bool:
    if shutil.which("sinfo") is None:
        return False
    proc = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], capture_output=True, text=True)
    states = dict(line.split() for line in proc.stdout.splitlines() if line.strip())
    return proc.returncode == 0 and all(
        states.get(n, "").startswith(("idle", "mixed", "alloc")) for n in ("n1", "n2")
    )


@pytest.fixture(scope="session")
def slurm_cluster() -> None:
    """The dev cluster, brought up by the project's script when it is not up."""
    if _slurm_up():
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        pytest.skip(
            "no dev Slurm cluster is up and this user cannot start one (needs root and apt); "
            "run: sudo scripts/slurm-dev-cluster up"
        )
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "slurm-dev-cluster"), "up"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    assert _slurm_up()


def _spec(name: str, **overrides: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "name": name,
        # One rank per node: what these tests prove is the plumbing between nodes; two
        # ranks per node on real Slurm are the DeepSpeed test's (and the launcher's
        # own local tests'). Each rank is a torch import and its share of two cores.
        "resources": {"nodes": 2, "procs_per_node": 1, "device": "cpu"},
        "launcher": "torchrun",
        "strategy": {"backend": "fsdp", "sharding": "full_shard", "precision": "fp32"},
        "train": {
            "model": {
                "llama": {
                    "vocab_size": 256,
                    "hidden_size": 64,
                    "intermediate_size": 172,
                    "num_hidden_layers": 2,
                    "num_attention_heads": 4,
                    "num_key_value_heads": 4,
                    "max_position_embeddings": 128,
                }
            },
            "data": {"builtin": "python-stdlib"},
            "steps": STEPS,
            "micro_batch_size": 4,
            "seq_len": 64,
            "lr": 1.0e-3,
            "warmup_steps": 5,
            "seed": 1234,
        },
        "checkpoint": {"every_steps": EVERY, "keep": 2, "consolidate_on_finish": True},
        # A port per job: a job's rendezvous must never meet a dying earlier one.
        "slurm": {"time": "00:10:00", "master_port": 29600 + sum(map(ord, name)) % 300},
        # One start per allocation, as these tests judge it (test_slurm_scale.py
        # tests restarts inside the allocation).
        "restart": {"max_in_allocation": 0},
    }
    for key, value in overrides.items():
        section = spec.setdefault(key, {})
        if isinstance(value, dict) and isinstance(section, dict):
            section.update(value)
        else:
            spec[key] = value
    return spec


def _submit(tmp_path: Path, spec: dict[str, Any], *extra: str) -> subprocess.CompletedProcess:
    path = tmp_path / f"{spec['name']}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return subprocess.run(
        [*SHARDCTL, "submit", str(path), "--cluster", "slurm", "-o", "json", *extra],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _submitted(tmp_path: Path, spec: dict[str, Any]) -> JobRef:
    proc = _submit(tmp_path, spec)
    assert proc.returncode == 0, proc.stderr
    ref = JobRef(**json.loads(proc.stdout))
    # sbatch received exactly the script a dry run of the same spec shows, and the one
    # written beside the run (run_dir/sbatch.sh).
    submitted = (Path(ref.extra["folder"]) / f"{ref.job_id}_submission.sh").read_bytes()
    assert submitted == (Path(ref.run_dir) / "sbatch.sh").read_bytes()
    dry = _submit(tmp_path, spec, "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert submitted == json.loads(dry.stdout)["artifacts"]["sbatch.sh"].encode()
    assert recall(spec["name"]).job_id == ref.job_id
    return ref


def _wait(ref: JobRef, until: Any, timeout: float, what: str) -> Any:
    """Poll every 0.5 s until `until()` is truthy; on time-out cancel the job and fail."""
    deadline = time.monotonic() + timeout
    problem = f"timed out after {timeout:.0f}s waiting for {what}"
    while time.monotonic() < deadline:
        try:
            found = until()
        except AssertionError as wrong:  # what was found can never become what is waited for
            problem = f"waiting for {what}: {wrong}"
            break
        if found:
            return found
        time.sleep(0.5)
    logs = SlurmCluster().logs(ref, tail=30)
    SlurmCluster().cancel(ref)
    pytest.fail(f"{problem}\n{logs}")


def _finished(ref: JobRef, timeout: float = 240) -> JobState:
    cluster = SlurmCluster()
    status = _wait(
        ref,
        lambda: (st := cluster.status(ref)).state.is_terminal and st,
        timeout,
        f"job {ref.job_id} to end",
    )
    return status.state


def _requeued_then_finished(ref: JobRef) -> str:
    """After a time-limit save: wait for the requeue, give the requeued job a longer limit
    (its warning 50 min away) so it can finish, and return the logs once it SUCCEEDED.
    The signal came once per node."""
    cluster = SlurmCluster()
    _wait(ref, lambda: "requeued 1 time" in cluster.status(ref).detail, 60, "the requeue")
    subprocess.run(
        ["scontrol", "update", f"jobid={ref.job_id}", "TimeLimit=60"], check=True, timeout=30
    )
    assert _finished(ref, timeout=400) is JobState.SUCCEEDED, cluster.logs(ref, tail=40)
    logs = cluster.logs(ref)
    assert logs.count("got SIGUSR2") == 2, logs  # the time-limit signal, on each node
    return logs


def _steps(run_dir: Path) -> list[int]:
    path = run_dir / "logs" / "metrics.jsonl"
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if "step" in record and "loss" in record:
            out.append(record["step"])
    return out


def _losses(run_dir: Path) -> dict[int, float]:
    path = run_dir / "logs" / "metrics.jsonl"
    records = [json.loads(x) for x in path.read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def _model(run_dir: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    tensors: dict[str, Any] = {}
    for file in sorted((run_dir / "model").glob("*.safetensors")):
        tensors.update(load_file(file))
    assert tensors, f"no consolidated model in {run_dir / 'model'}"
    return tensors


def _assert_loads_in_transformers(run_dir: Path) -> dict[str, Any]:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(run_dir / "model")
    loaded = {k: v for k, v in model.state_dict().items()}
    saved = _model(run_dir)
    for key, tensor in saved.items():
        assert key in loaded, f"{key} not in the transformers model"
        assert loaded[key].equal(tensor.to(loaded[key].dtype)), key
    return saved


def _marker_step(run_dir: Path) -> int | None:
    """The step rank 0 saved on preemption (its PREEMPTED marker), once written; an
    AssertionError when the marker says a rank stopped with nothing saved."""
    try:
        marker = json.loads((run_dir / "PREEMPTED").read_text())
    except (OSError, ValueError):
        return None
    assert marker.get("saved", True), f"PREEMPTED says nothing was saved: {marker}"
    return int(marker["step"])


def _last_checkpoint(run_dir: Path) -> int | None:
    from shardctl.train.checkpoint import list_checkpoints

    done = [c.step for c in list_checkpoints(run_dir / "checkpoints") if c.complete]
    return max(done) if done else None


# ------------------------------------------------------------------ reference


@pytest.fixture(scope="module")
def reference_job(slurm_cluster: None, tmp_path_factory: pytest.TempPathFactory) -> JobRef:
    """2 nodes × 1 rank, FSDP2, torchrun: submitted, finished, consolidated."""
    tmp = tmp_path_factory.mktemp("reference")
    ref = _submitted(tmp, _spec("ref-fsdp"))
    assert _finished(ref) is JobState.SUCCEEDED, SlurmCluster().logs(ref, tail=40)
    return ref


@pytest.fixture
def reference(reference_job: JobRef) -> Path:
    return Path(reference_job.run_dir)


def test_fsdp_torchrun_two_nodes_finishes_and_consolidates(reference: Path) -> None:
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    assert _steps(reference) == list(range(1, STEPS + 1))
    saved = _assert_loads_in_transformers(reference)
    # The consolidated model is the final sharded checkpoint, read by torch's own DCP tools.
    full = reference / "full.pt"
    dcp_to_torch_save(reference / "checkpoints" / f"step-{STEPS:08d}" / "dcp", full)
    state = torch.load(full, weights_only=False)["model"]
    for key, tensor in saved.items():
        assert torch.equal(state[key], tensor), key
    manifest = json.loads(
        (reference / "checkpoints" / f"step-{STEPS:08d}" / "manifest.json").read_text()
    )
    assert manifest["world_size"] == 2


def test_logs_of_every_node_and_status(reference_job: JobRef) -> None:
    ref = reference_job
    remember(ref)  # job records are per test (conftest); the CLI finds it by name
    status = SlurmCluster().status(ref)
    assert status.state is JobState.SUCCEEDED and status.native_state == "COMPLETED"
    logs = subprocess.run(
        [*SHARDCTL, "logs", "ref-fsdp"], capture_output=True, text=True, timeout=60
    ).stdout
    for node in (0, 1):
        assert f"==> node {node} stdout" in logs and f"==> node {node} stderr" in logs
        assert f"[shardctl] node {node} of job {ref.job_id}" in logs
    assert f"finished {STEPS} steps" in logs


def test_accelerate_launch_two_nodes_matches_torchrun(reference: Path, tmp_path: Path) -> None:
    ref = _submitted(tmp_path, _spec("acc-fsdp", launcher="accelerate"))
    assert _finished(ref) is JobState.SUCCEEDED, SlurmCluster().logs(ref, tail=40)
    run_dir = Path(ref.run_dir)
    assert _steps(run_dir) == list(range(1, STEPS + 1))
    _assert_loads_in_transformers(run_dir)
    # Same spec, same world size, other launcher: the same training, bit for bit.
    assert_bit_equal(_model(run_dir), _model(reference))


def test_deepspeed_zero3_two_nodes(slurm_cluster: None, tmp_path: Path) -> None:
    import torch

    spec = _spec(
        "ds-zero3",
        resources={"procs_per_node": 2},  # the one real-Slurm test of 2 ranks per node
        strategy={"backend": "deepspeed", "zero_stage": 3, "sharding": None, "precision": "fp32"},
        train={"steps": 40},
        checkpoint={"every_steps": 20},
    )
    spec["strategy"].pop("sharding")
    ref = _submitted(tmp_path, spec)
    assert _finished(ref) is JobState.SUCCEEDED, SlurmCluster().logs(ref, tail=40)
    run_dir = Path(ref.run_dir)
    assert _steps(run_dir) == list(range(1, 41))
    saved = _assert_loads_in_transformers(run_dir)
    # DeepSpeed's own reader of the same ZeRO-3 checkpoint agrees with the consolidated model.
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    state = get_fp32_state_dict_from_zero_checkpoint(
        str(run_dir / "checkpoints" / "step-00000040"), tag="deepspeed"
    )
    for key, tensor in saved.items():
        assert torch.equal(state[key], tensor), key
    manifest = json.loads((run_dir / "checkpoints" / "step-00000040" / "manifest.json").read_text())
    assert manifest["world_size"] == 4


# ------------------------------------------------------------------ preemption


def test_usr2_preemption_checkpoints_requeues_and_resumes(reference: Path, tmp_path: Path):
    ref = _submitted(tmp_path, _spec("preempt-usr2"))
    run_dir = Path(ref.run_dir)
    _wait(ref, lambda: len(_steps(run_dir)) >= 5, 180, "step 5")
    subprocess.run(["scancel", "--signal=USR2", ref.job_id], check=True, timeout=30)
    saved_at = _wait(ref, lambda: _marker_step(run_dir), 120, "the preemption save")
    assert saved_at < STEPS and _last_checkpoint(run_dir) == saved_at
    assert _finished(ref, timeout=300) is JobState.SUCCEEDED, SlurmCluster().logs(ref, tail=40)
    logs = SlurmCluster().logs(ref)
    # Every node's task got the signal; node 0 requeued; the next run resumed.
    assert logs.count("got SIGUSR2") == 2, logs
    assert f"requeueing job {ref.job_id}" in logs
    assert f"resumed at step {saved_at}" in logs
    assert "requeued 1 time(s)" in SlurmCluster().status(ref).detail
    # No step lost or repeated; the resumed run is the uninterrupted one, bit for bit.
    assert _steps(run_dir) == list(range(1, STEPS + 1))
    assert _losses(run_dir) == _losses(reference)
    assert_bit_equal(_model(run_dir), _model(reference))


def test_higher_priority_job_preempts_then_the_run_resumes(slurm_cluster: None, tmp_path: Path):
    # Partition `urgent` outranks `debug` (PreemptMode=REQUEUE): Slurm sends the
    # job's signal (preempt_send_user_signal), the ranks save, the job is requeued
    # and resumes once the urgent job is done. Two ranks per node take every CPU of
    # the dev nodes, so the urgent job cannot run beside it: it must preempt
    # (bit-exactness against the reference is the USR2 test's).
    steps = STEPS
    ref = _submitted(
        tmp_path,
        _spec(
            "preempt-prio",
            resources={"procs_per_node": 2},
            checkpoint={"consolidate_on_finish": False},
        ),
    )
    run_dir = Path(ref.run_dir)
    _wait(ref, lambda: len(_steps(run_dir)) >= 5, 180, "step 5")
    urgent = subprocess.run(
        ["sbatch", "--parsable", "-p", "urgent", "-N2", "-o", "/dev/null", "--wrap", "sleep 5"],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout.strip()
    try:
        saved_at = _wait(ref, lambda: _marker_step(run_dir), 120, "the preemption save")
        assert _finished(ref, timeout=300) is JobState.SUCCEEDED, SlurmCluster().logs(ref)
    finally:
        subprocess.run(["scancel", urgent], timeout=30, check=False)
    assert saved_at < steps and f"resumed at step {saved_at}" in SlurmCluster().logs(ref)
    assert _steps(run_dir) == list(range(1, steps + 1))


def test_time_limit_signal_checkpoints_requeues_and_resumes(slurm_cluster: None, tmp_path):
    # A 10-minute limit whose warning signal is due 10 s after the start (the node
    # tasks' own handlers are in place by then). Slurm's timer checks limits every
    # 30 s, so USR2 comes between ~10 and ~40 s: during start-up or early training,
    # never after it. A signal that comes before the ranks' handlers exist is passed
    # on once they do. 1,000 steps of the tiny model last about 60 s after a 10 s
    # start on a quiet 2-core host (500 steps could end before a late signal came).
    steps = 1000
    spec = _spec(
        "preempt-time",
        train={"steps": steps},
        checkpoint={"every_steps": 100, "consolidate_on_finish": False},
        slurm={"time": "10", "signal_delay_s": 590},
    )
    ref = _submitted(tmp_path, spec)
    run_dir = Path(ref.run_dir)
    saved_at = _wait(ref, lambda: _marker_step(run_dir), 150, "the time-limit save")
    assert 0 < saved_at < steps
    # Once requeued, a longer limit (its warning 50 min away) lets the resumed run
    # finish; the path under test — limit → signal → save → requeue — was taken.
    logs = _requeued_then_finished(ref)
    assert f"resumed at step {saved_at}" in logs
    assert _steps(run_dir) == list(range(1, steps + 1))


# ------------------------------------------------------------------ a node dies


def _node_processes(job_id: str, node: int) -> list[int]:
    """PIDs of the job's processes on one emulated node (task, launcher, ranks)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if (
            f"SLURM_JOB_ID={job_id}".encode() in environ
            and f"SLURM_NODEID={node}".encode() in environ
            and b"SLURM_STEP_ID=0" in environ
        ):
            pids.append(int(entry))
    return pids


def test_node_death_fails_cleanly_and_resubmit_resumes(reference: Path, tmp_path: Path):
    spec = _spec("node-dies")
    ref = _submitted(tmp_path, spec)
    run_dir = Path(ref.run_dir)
    _wait(ref, lambda: (_last_checkpoint(run_dir) or 0) >= EVERY, 180, "a checkpoint")
    pids = _node_processes(ref.job_id, 1)
    assert len(pids) >= 3, pids  # the node's task, its launcher and its 2 ranks
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert _finished(ref, timeout=180) is JobState.FAILED
    last = _last_checkpoint(run_dir)
    assert last is not None and last >= EVERY and not (run_dir / "DONE").exists()
    logged = _steps(run_dir)
    # Resubmitting resumes from the newest complete checkpoint and finishes the run.
    again = _submitted(tmp_path, spec)
    assert again.job_id != ref.job_id
    assert _finished(again) is JobState.SUCCEEDED, SlurmCluster().logs(again, tail=40)
    assert f"resumed at step {last}" in SlurmCluster().logs(again)
    # Steps after the checkpoint ran twice (the first time on a dying job), steps up to
    # it once; the final model is the uninterrupted run's.
    steps = _steps(run_dir)
    assert steps == logged + list(range(last + 1, STEPS + 1))
    assert_bit_equal(_model(run_dir), _model(reference))


def test_cancel_stops_every_node_and_never_requeues(slurm_cluster: None, tmp_path: Path):
    ref = _submitted(tmp_path, _spec("cancel-me"))
    run_dir = Path(ref.run_dir)
    _wait(ref, lambda: len(_steps(run_dir)) >= 5, 180, "step 5")
    proc = subprocess.run(
        [*SHARDCTL, "cancel", "cancel-me"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert _finished(ref, timeout=60) is JobState.CANCELLED
    # Every process of the job, on both nodes, is gone (SIGTERM, then SIGKILL).
    _wait(
        ref,
        lambda: not (_node_processes(ref.job_id, 0) or _node_processes(ref.job_id, 1)),
        90,
        "the job's processes to end",
    )
    status = SlurmCluster().status(ref)
    assert status.state is JobState.CANCELLED and "requeued" not in status.detail
    assert not (run_dir / "DONE").exists()
    # Cancelling it again says what happened instead of "cancelled".
    again = subprocess.run(
        [*SHARDCTL, "cancel", "cancel-me"], capture_output=True, text=True, timeout=60
    )
    assert again.returncode == 1
    assert "is not running: CANCELLED" in again.stderr and "nothing to cancel" in again.stderr


def test_cancel_of_a_job_slurm_does_not_know(slurm_cluster: None, tmp_path: Path) -> None:
    remember(JobRef(cluster="slurm", job_id="987654321", name="forgotten", run_dir=str(tmp_path)))
    proc = subprocess.run(
        [*SHARDCTL, "cancel", "forgotten"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 1, proc.stdout
    assert "cancelled" not in proc.stdout
    assert "Slurm job 987654321) is not running: UNKNOWN" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_extra_sbatch_options_take_effect(slurm_cluster: None, tmp_path: Path) -> None:
    """slurm.sbatch_options on the real cluster: Slurm keeps the comment and the nice
    value, and `hold` holds the job, so it never takes the nodes; then it is cancelled."""
    comment = "shardctl options test #1"
    options = {"comment": comment, "nice": 10, "hold": True}
    ref = _submitted(tmp_path, _spec("with-options", slurm={"sbatch_options": options}))
    try:
        shown = subprocess.run(
            ["scontrol", "show", "job", "-o", ref.job_id],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
        assert f" Comment={comment} " in shown, shown
        assert " Nice=10 " in shown, shown
        assert " JobState=PENDING Reason=JobHeldUser " in shown, shown
    finally:
        subprocess.run(["scancel", ref.job_id], timeout=30, check=False)
    assert _finished(ref, timeout=60) is JobState.CANCELLED


# ------------------------------------------------------------------ bad input


# What the dev cluster's default partition offers, as a refusal names it.
DEBUG_OFFERS = "partition 'debug' has 2 node(s) (n1, n2), 2 CPUs and 8192M memory each"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"slurm": {"partition": "nope"}}, "slurm.partition 'nope' was refused by Slurm"),
        ({"slurm": {"time": "10:00:00"}}, "slurm.time '10:00:00' was refused by Slurm"),
        # Slurm's own reasons name no field: the refusal names the spec's, and what
        # the partition offers.
        (
            {"resources": {"nodes": 3}},
            "resources.nodes 3 was refused by Slurm (allocation failure: Node count "
            f"specification invalid); {DEBUG_OFFERS}",
        ),
        (
            {"resources": {"memory": "1000G"}},
            "resources.memory '1000G' was refused by Slurm (allocation failure: Requested "
            f"node configuration is not available): more than any node has; {DEBUG_OFFERS}",
        ),
        (
            {"slurm": {"sbatch_options": {"exclude": "nosuchnode"}}},
            "slurm.sbatch_options.exclude 'nosuchnode' was refused by Slurm (allocation "
            f"failure: Invalid node name specified); {DEBUG_OFFERS}",
        ),
        (
            {"slurm": {"sbatch_options": {"exclude": "n1"}}},
            "slurm.sbatch_options.exclude 'n1' was refused by Slurm (allocation failure: "
            "Requested node configuration is not available): it leaves 1 node(s) (n2) and "
            f"resources.nodes asks for 2; {DEBUG_OFFERS}",
        ),
        (
            {"slurm": {"constraint": "fast"}},
            "slurm.constraint 'fast' was refused by Slurm (allocation failure: Invalid "
            f"feature specification); {DEBUG_OFFERS}, features: none",
        ),
    ],
)
def test_bad_slurm_request_is_refused_naming_its_field_before_anything_is_written(
    slurm_cluster: None, tmp_path: Path, overrides: dict[str, Any], message: str
) -> None:
    spec = _spec("bad-input", **overrides)
    before = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True).stdout
    proc = _submit(tmp_path, spec)
    assert proc.returncode == 1
    assert message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "runs").exists()
    after = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True).stdout
    assert after == before


def test_a_dry_run_changed_after_it_was_shown_is_refused_before_queueing(
    slurm_cluster: None, tmp_path: Path
) -> None:
    """A dry run whose sbatch.sh was changed after it was shown: shardctl renders the
    script again from the request (submitit submits that text as it is), the
    difference is named, and nothing is written or queued."""
    name = "shown-differs"
    spec = parse_spec({**_spec(name), "run_dir": str(tmp_path / "runs" / name)})
    cluster = SlurmCluster()
    plan = cluster.dryrun(spec)
    shown = plan.artifacts["sbatch.sh"]
    assert "#SBATCH --nodes=2\n" in shown
    altered = dataclasses.replace(
        plan,
        artifacts={**plan.artifacts, "sbatch.sh": shown.replace("--nodes=2\n", "--nodes=1\n")},
    )
    with pytest.raises(ClusterError) as refused:
        cluster.schedule(altered)
    message = str(refused.value)
    assert "differs from the one the dry run showed; nothing was queued" in message
    assert "\n-#SBATCH --nodes=1\n+#SBATCH --nodes=2\n" in message, message
    assert not (tmp_path / "runs").exists()
    queued = subprocess.run(
        ["squeue", "-h", "-n", name, "-o", "%i"], capture_output=True, text=True, timeout=30
    )
    assert queued.returncode == 0 and queued.stdout.strip() == "", queued.stdout


# --------------------------------------------------------- your own training script


def _own_spec(name: str, script: str, args: list[str]) -> dict[str, Any]:
    spec = _spec(name, checkpoint={"every_steps": 5, "keep": 2, "consolidate_on_finish": False})
    del spec["train"]
    spec["entrypoint"] = {"script": str(ROOT / script), "args": args}
    return spec


def test_your_script_exiting_3_fails_and_is_never_requeued(slurm_cluster: None, tmp_path: Path):
    ref = _submitted(tmp_path, _own_spec("own-exit3", "tests/data/usercode/exit_with.py", ["3"]))
    assert _finished(ref) is JobState.FAILED
    status = SlurmCluster().status(ref)
    assert "requeued" not in status.detail
    logs = SlurmCluster().logs(ref)
    assert "a rank exited with code 3" in logs, logs
    assert json.loads((Path(ref.run_dir) / "FAILED").read_text())["code"] == 3


def test_your_hf_trainer_script_gets_the_time_limit_signal_and_resumes(
    slurm_cluster: None, tmp_path: Path
) -> None:
    """examples/hf_trainer_script.py (a Trainer, two added lines) on 2 nodes: the
    time-limit warning signal → every rank saves checkpoint-N → requeued → resumes
    from checkpoint-N → COMPLETED. The warning is due 50 s after the job's start and
    comes by ~80 s (Slurm's timer checks limits every 30 s): by then every rank has
    imported the Trainer on a loaded host too, and a warning before the training is
    held for the callback. Slurm counts from the allocation, not from the ranks' start:
    on a loaded CI host the batch step took ~16 s to start the node tasks, and a
    warning due at 20 s reached the ranks 4 s after they started, before the script
    imported the Trainer (nothing saved). A later loaded run had the warning 24 s
    after the ranks started, still before the import: the ranks now hold a warning
    for the script's handler for half of `signal_delay_s` (275 s here), and the
    Trainer imported within it takes it. The script's steps are paced
    (tests/helpers/paced_script.py: at least 0.15 s each, 75 s for 500 steps after
    the start-up), so on any host it is still stepping then: unpaced, a quiet host
    once finished 400 steps in 29 s, before the signal came."""
    steps = 500
    args = ["0.15", "hf_trainer_script.py", "--max-steps", str(steps), "--save-steps", "1000"]
    spec = _own_spec("own-hf-time", "tests/helpers/paced_script.py", args)
    spec["slurm"].update({"time": "10", "signal_delay_s": 550})
    ref = _submitted(tmp_path, spec)
    run_dir = Path(ref.run_dir)
    saved_at = _wait(ref, lambda: _marker_step(run_dir), 180, "the time-limit save")
    assert 0 < saved_at < steps
    assert (run_dir / "checkpoints" / f"checkpoint-{saved_at}" / "trainer_state.json").is_file()
    logs = _requeued_then_finished(ref)
    assert f"resuming from {run_dir / 'checkpoints' / f'checkpoint-{saved_at}'}" in logs, logs
    assert f"finished at step {steps}" in logs
    assert (run_dir / "DONE").is_file()


def test_your_script_on_a_killed_node_fails_and_resubmit_resumes(
    slurm_cluster: None, tmp_path: Path
) -> None:
    """examples/fsdp2_script.py: SIGKILL of every process on node 1 (no chance to
    save) → the job FAILED, no DONE; submitting again resumes from the newest
    complete checkpoint and finishes."""
    args = ["--steps", "200", "--log-every", "1"]
    spec = _own_spec("own-node-dies", "examples/fsdp2_script.py", args)
    ref = _submitted(tmp_path, spec)
    run_dir = Path(ref.run_dir)
    _wait(ref, lambda: (_last_checkpoint(run_dir) or 0) >= 5, 240, "a checkpoint")
    pids = _node_processes(ref.job_id, 1)
    assert len(pids) >= 3, pids  # the node's task, its launcher and its 2 ranks
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert _finished(ref, timeout=180) is JobState.FAILED
    last = _last_checkpoint(run_dir)
    assert last is not None and last >= 5 and not (run_dir / "DONE").exists()
    again = _submitted(tmp_path, spec)
    assert again.job_id != ref.job_id
    assert _finished(again) is JobState.SUCCEEDED, SlurmCluster().logs(again, tail=40)
    assert f"resumed at step {last}" in SlurmCluster().logs(again)
    assert (run_dir / "DONE").is_file()


HOLD = """
import sys, time
from pathlib import Path
ready, go = Path(sys.argv[1]), Path(sys.argv[2])
ready.write_text("started\\n")
deadline = time.monotonic() + 600
while not go.exists() and time.monotonic() < deadline:
    time.sleep(0.1)
"""


def test_a_second_submit_of_a_live_run_is_refused_naming_the_slurm_job(
    slurm_cluster: None, tmp_path: Path
) -> None:
    """One writer per run (`clusters/owner.py`): the same spec submitted twice while the
    first job runs is refused, naming the job; its node 0 claimed the run's attempt."""
    script, ready, go = tmp_path / "hold.py", tmp_path / "ready", tmp_path / "go"
    script.write_text(HOLD)
    spec = _spec("one-writer", resources={"procs_per_node": 1})
    del spec["train"]
    spec["entrypoint"] = {"script": str(script), "args": [str(ready), str(go)]}
    ref = _submitted(tmp_path, spec)
    try:
        _wait(ref, ready.exists, 240, "the job to start")
        again = _submit(tmp_path, spec)
        assert again.returncode == 1, again.stdout
        text = " ".join(again.stderr.split())
        assert f"'one-writer' on slurm, job id {ref.job_id}, RUNNING" in text, text
        assert "--replace" in text
        assert recall("one-writer").job_id == ref.job_id
        claimed = json.loads((Path(ref.run_dir) / "CURRENT_ATTEMPT").read_text())
        assert claimed["token"] == f"slurm-{ref.job_id}-0"
    finally:
        go.write_text("go\n")
    assert _finished(ref) is JobState.SUCCEEDED, SlurmCluster().logs(ref, tail=40)


def test_a_script_without_a_usr2_handler_says_nothing_was_saved_and_requeues(
    slurm_cluster: None, tmp_path: Path
) -> None:
    """A plain script with no handler and no resume code on 2 nodes, preempted with
    `scancel --signal=USR2`: its ranks do not keep an ignored SIGUSR2, each says that
    nothing was saved, and the job is a preemption — requeued, run again, COMPLETED."""
    spec = _own_spec("own-nohandler", "tests/data/usercode/no_handler_once.py", [str(tmp_path)])
    spec["env"] = {"SHARDCTL_WARNING_HOLD_S": "3"}  # it never installs one: held 3 s, not 30
    ref = _submitted(tmp_path, spec)
    _wait(ref, lambda: all((tmp_path / f"ready-{r}").exists() for r in (0, 1)), 180,
          "both ranks to start")  # fmt: skip
    subprocess.run(["scancel", "--signal=USR2", ref.job_id], check=True, timeout=30)
    cluster = SlurmCluster()
    _wait(ref, lambda: "requeued 1 time" in cluster.status(ref).detail, 120, "the requeue")
    assert _finished(ref) is JobState.SUCCEEDED, cluster.logs(ref, tail=40)
    logs = cluster.logs(ref)
    assert "nothing was saved" in logs, logs
    assert (Path(ref.run_dir) / "DONE").is_file()

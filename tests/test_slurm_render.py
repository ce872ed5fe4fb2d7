"""The Slurm submission without a cluster: rendering, state mapping, the node task.

The sbatch text shardctl shows (render, --dry-run) is shardctl's own; what
submitit needs of it (its entry point, its folder) is checked against submitit's
executor, and submitit accepts the parameters it is given. The node
task's signal handling runs for real: a launcher in its own session, a rank
process that catches USR2, the signal sent to the task process.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from shardctl.orchestrator.clusters import render_artifacts
from shardctl.orchestrator.clusters import slurm as backend
from shardctl.orchestrator.clusters.base import JobState
from shardctl.orchestrator.clusters.slurm import sbatch as rs
from shardctl.orchestrator.spec import load_spec, parse_spec
from shardctl.orchestrator.yamlio import read_yaml_file

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


def _spec(**slurm: object) -> object:
    data = {
        "name": "job-1",
        "resources": {"nodes": 2, "procs_per_node": 4, "cpus_per_proc": 3},
        "train": {"model": {"llama": {}}, "data": {"builtin": "python-stdlib"}, "steps": 10},
        "checkpoint": {"every_steps": 5},
        "slurm": slurm,
    }
    return parse_spec(data)


# Extra #SBATCH options (sorted among submitit's own flags, quoted by it) and a pyxis
# container (words of submitit's srun line, setup lines before it).
WITH_OPTIONS = {
    "name": "with-options",
    "run_dir": "/shared/runs/with-options",
    "resources": {"nodes": 2, "procs_per_node": 4, "device": "cuda", "memory": "64G"},
    "train": {"model": {"llama": {}}, "data": {"builtin": "python-stdlib"}, "steps": 10},
    "checkpoint": {"every_steps": 5, "dir": "/scratch/with-options"},
    "slurm": {
        "signal": "USR1",
        "setup": ["module load cuda"],
        "srun_args": ["--cpu-bind=none"],
        "sbatch_options": {
            "reservation": "maint",
            "exclude": "node[01-03]",
            "mail-type": "END,FAIL",
            "mail-user": "a@b.c",
            "comment": "it's #1 $(x)",
            "nice": 10,
            "hold": True,
            "gpus-per-task": 4,
            "wckey": "team-a",
        },
        "container": {
            "image": "nvcr.io#nvidia/pytorch:24.05-py3",
            "mounts": ["/data:/data:ro"],
            "mount_home": False,
        },
    },
}


@pytest.mark.parametrize(
    "source", [*EXAMPLES, WITH_OPTIONS], ids=lambda p: p.stem if isinstance(p, Path) else p["name"]
)
def test_sbatch_text_runs_the_entry_point_submitit_dispatches(source: Path | dict) -> None:
    """submitit's executor, given the request, dispatches the task with a command the
    script runs (on every node, the signal held until the node task's handler exists),
    and accepts every parameter; the user's options are written as given."""
    import submitit

    spec = load_spec(source) if isinstance(source, Path) else parse_spec(source)
    sub = rs.submission(spec, python="/opt/py/bin/python3", run_dir="/shared/runs/x")
    ours = rs.sbatch_text(spec, sub)
    folder = sub["executor"]["folder"]
    executor = submitit.SlurmExecutor(folder=folder, python="/opt/py/bin/python3")
    executor.update_parameters(**sub["parameters"])
    held = f" env --block-signal={spec.slurm.signal} {executor._submitit_command_str} &\n"
    assert held in ours
    backend._runs(ours, executor._submitit_command_str)
    if not isinstance(source, Path):  # the case is what it claims to be
        for line in ("#SBATCH --hold", "#SBATCH --wckey=team-a", "#SBATCH --nice=10"):
            assert f"{line}\n" in ours, line
        assert " --no-container-mount-home --cpu-bind=none env --block-signal=USR1 " in ours


def test_every_option_reaches_sbatch_and_submitit_accepts_them(tmp_path: Path) -> None:
    import submitit

    spec = parse_spec(
        {
            "name": "big-job",
            "resources": {"nodes": 4, "procs_per_node": 8, "device": "cuda", "memory": "500Gi"},
            "train": {"model": {"llama": {}}, "data": {"builtin": "python-stdlib"}, "steps": 10},
            "run_dir": "/shared/runs/big",
            "checkpoint": {"every_steps": 5, "dir": "/scratch/big/checkpoints"},
            "slurm": {
                "partition": "gpu",
                "account": "proj-1",
                "qos": "high",
                "time": "1-12:30:00",
                "signal": "USR1",
                "signal_delay_s": 300,
                "constraint": "h100",
                "exclusive": True,
                "setup": ["module load cuda/12.4", "source /shared/venv/bin/activate"],
                "srun_args": ["--cpu-bind=none", "--label"],
            },
        }
    )
    files = rs.slurm_artifacts(spec)
    params = json.loads(files["submitit.json"])["parameters"]
    assert params["time"] == 36 * 60 + 30
    assert params["gpus_per_node"] == 8
    assert params["cpus_per_task"] == 8
    assert params["mem"] == "500G"
    text = files["sbatch.sh"]
    for flag in (
        "--partition=gpu", "--account=proj-1", "--qos=high", "--constraint=h100",
        "--exclusive", "--gpus-per-node=8", "--nodes=4", "--ntasks-per-node=1",
        "--signal=USR1@300", "--time=2190", "--mem=500G", "--requeue", "--job-name=big-job",
        "--output=/shared/runs/big/submitit/%j/%j_0_log.out",
    ):  # fmt: skip
        assert f"#SBATCH {flag}\n" in text, flag
    # Each setup line, then its check (a failed line stops the job, naming itself).
    assert (
        "module load cuda/12.4\nshardctl_setup_check 1 'module load cuda/12.4'\n"
        "source /shared/venv/bin/activate\n"
        "shardctl_setup_check 2 'source /shared/venv/bin/activate'\n"
    ) in text
    assert " --cpu-bind=none --label env --block-signal=USR1 python3 -u -m submitit" in text
    # submitit's executor validates the parameters it is given.
    sub = json.loads(files["submitit.json"])
    submitit.SlurmExecutor(folder=str(tmp_path)).update_parameters(**sub["parameters"])
    assert sub["task"]["command"] == ["bash", "/shared/runs/big/launch.sh"]


def test_gres_replaces_gpus_per_node_and_cpu_jobs_ask_no_gpus() -> None:
    cpu = rs.submitit_parameters(_spec())
    assert "gpus_per_node" not in cpu and "gres" not in cpu
    assert cpu["cpus_per_task"] == 12  # 4 procs × 3 cpus, one task per node
    gres = rs.submitit_parameters(_spec(gres="gpu:a100:4"))
    assert gres["gres"] == "gpu:a100:4" and "gpus_per_node" not in gres


def test_hostile_values_stay_inert_in_sbatch() -> None:
    spec = _spec(partition="p$(touch_x)", srun_args=["--comment=$(reboot); `id`"])
    text = rs.slurm_artifacts(spec)["sbatch.sh"]
    assert "#SBATCH --partition='p$(touch_x)'" in text
    assert "'--comment=$(reboot); `id`'" in text


@pytest.mark.parametrize(
    ("given", "mem"), [("64G", "64G"), ("2048", "2048"), ("16Gi", "16G"), ("1.5Gi", "1536M")]
)
def test_memory_reaches_sbatch_in_slurm_units(given: str, mem: str) -> None:
    """Sizes are parsed once by the spec; `1.5Gi` validated but failed at render before."""
    spec = _spec()
    spec = parse_spec({**spec.to_yaml_dict(), "resources": {"memory": given}})
    assert f"#SBATCH --mem={mem}\n" in rs.slurm_artifacts(spec)["sbatch.sh"]


def test_render_artifacts_include_the_submission() -> None:
    # The portable render: the spec as built in code keeps its relative run dir.
    spec = parse_spec(read_yaml_file(ROOT / "examples" / "slurm-2node.yaml"))
    files = render_artifacts(spec, "slurm")
    assert {"submitit.json", "sbatch.sh", "launch.sh", "job.yaml"} <= set(files)
    task = json.loads(files["submitit.json"])["task"]
    assert task["callable"] == "shardctl.orchestrator.clusters.slurm:NodeTask"
    assert task["command"] == ["bash", "runs/slurm-2node/launch.sh"]
    assert render_artifacts(spec, "slurm") == files  # deterministic


def test_a_warning_waits_for_a_handler_half_the_signal_delay_unless_the_spec_says() -> None:
    """The ranks hold a warning that comes before the script's handler for half of
    `slurm.signal_delay_s` (the other half is the save's); the spec's `env:` wins."""
    env = render_artifacts(_spec(signal_delay_s=300), "slurm")["env.sh"]
    assert "\nexport SHARDCTL_WARNING_HOLD_S=150\n" in env
    default = render_artifacts(_spec(), "slurm")["env.sh"]
    assert "\nexport SHARDCTL_WARNING_HOLD_S=60\n" in default
    data = _spec().model_dump(mode="json", exclude_defaults=True)
    own = parse_spec({**data, "env": {"SHARDCTL_WARNING_HOLD_S": "5"}})
    own_env = render_artifacts(own, "slurm")["env.sh"]
    lines = [x for x in own_env.splitlines() if "WARNING_HOLD" in x]
    assert lines == ["export SHARDCTL_WARNING_HOLD_S=5"]


def test_rendered_sbatch_passes_shellcheck(tmp_path: Path) -> None:
    import shutil

    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck (Debian package) is not installed")
    spec = _spec(setup=["echo ready"], srun_args=["--label"])
    path = tmp_path / "sbatch.sh"
    path.write_text(rs.slurm_artifacts(spec)["sbatch.sh"])
    proc = subprocess.run(["shellcheck", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


def test_dryrun_is_pure_and_imports_no_submitit(tmp_path: Path) -> None:
    # A fresh interpreter with no Slurm on PATH: dry-run still works, contacts
    # nothing, and never imports submitit.
    shutil.copy(ROOT / "examples" / "slurm-2node.yaml", tmp_path)
    code = textwrap.dedent(
        f"""
        import json, subprocess, sys
        def forbidden(*a, **k):
            raise AssertionError(f"dry-run started a process: {{a}}")
        subprocess.run = subprocess.Popen = subprocess.check_output = forbidden
        from shardctl.orchestrator.clusters import get_cluster
        from shardctl.orchestrator.spec import load_spec
        plan = get_cluster("slurm").dryrun(load_spec({str(tmp_path / "slurm-2node.yaml")!r}))
        heavy = [m for m in ("submitit", "torch") if m in sys.modules]
        print(json.dumps({{"heavy": heavy, "text": plan.text, "files": sorted(plan.artifacts)}}))
        """
    )
    env = {**os.environ, "PATH": "/nonexistent"}
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["heavy"] == []
    run_dir = str(tmp_path.resolve() / "runs" / "slurm-2node")
    assert f'"folder": "{run_dir}/submitit/%j"' in out["text"]
    assert f"#SBATCH --output={run_dir}/submitit/%j/%j_0_log.out" in out["text"]
    assert {"job.yaml", "launch.sh", "sbatch.sh", "submitit.json"} <= set(out["files"])
    assert not (tmp_path / "runs").exists()  # nothing written


def test_dryrun_job_yaml_has_the_absolute_run_dir(tmp_path: Path, monkeypatch) -> None:
    # The default run dir is beside the spec file, whatever the current directory.
    shutil.copy(ROOT / "examples" / "slurm-2node.yaml", tmp_path)
    monkeypatch.chdir("/")
    plan = backend.SlurmCluster().dryrun(load_spec(tmp_path / "slurm-2node.yaml"))
    node_spec = parse_spec(__import__("yaml").safe_load(plan.artifacts["job.yaml"]))
    assert node_spec.run_dir == str(tmp_path.resolve() / "runs" / "slurm-2node")
    assert plan.request["executor"]["python"] == shlex.quote(sys.executable)


def test_dryrun_computes_the_submitit_parameters_once_and_renders_from_its_request(
    tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.chdir(tmp_path)
    calls = []
    real = rs.submitit_parameters

    def counted(spec):
        calls.append(spec.name)
        return real(spec)

    monkeypatch.setattr(rs, "submitit_parameters", counted)
    plan = backend.SlurmCluster().dryrun(load_spec(ROOT / "examples" / "slurm-2node.yaml"))
    assert calls == ["slurm-2node"]
    # submitit.json is the request schedule hands to submitit, and sbatch.sh its script.
    assert json.loads(plan.artifacts["submitit.json"]) == plan.request
    rendered = rs.sbatch_text(plan.spec, plan.request)
    assert plan.artifacts["sbatch.sh"] == rendered
    assert plan.text.endswith(plan.artifacts["sbatch.sh"])


# ----------------------------------------------------------------- state mapping


@pytest.mark.parametrize(
    ("native", "state"),
    [
        ("PENDING", JobState.PENDING),
        ("REQUEUE_HOLD", JobState.PENDING),
        ("RUNNING", JobState.RUNNING),
        ("COMPLETING", JobState.RUNNING),
        ("COMPLETED", JobState.SUCCEEDED),
        ("FAILED", JobState.FAILED),
        ("NODE_FAIL", JobState.FAILED),
        ("TIMEOUT", JobState.FAILED),
        ("OUT_OF_MEMORY", JobState.FAILED),
        ("CANCELLED by 0", JobState.CANCELLED),
        ("CANCELLED+", JobState.CANCELLED),
        ("REQUEUED", JobState.PREEMPTED),
        ("PREEMPTED", JobState.PREEMPTED),
        ("SUSPENDED", JobState.PREEMPTED),
        ("", JobState.UNKNOWN),
        ("SOMETHING_NEW", JobState.UNKNOWN),
    ],
)
def test_state_table(native: str, state: JobState) -> None:
    assert backend.map_state(native) is state


def test_standalone_batch_script_has_the_same_resources_and_requeues(tmp_path: Path) -> None:
    """job.sbatch: sbatch-able by hand: the same flags as sbatch.sh, one srun of shardctl's
    node task (the one submitit runs) on every node, running launch.sh."""
    spec = load_spec(ROOT / "examples" / "slurm-2node.yaml")
    files = rs.slurm_artifacts(spec)
    standalone, submitit_text = files[rs.STANDALONE_FILE], files["sbatch.sh"]
    for flag in ("--nodes=2", "--ntasks-per-node=1", "--requeue", "--time=", "--cpus-per-task="):
        line = next(x for x in submitit_text.splitlines() if x.startswith(f"#SBATCH {flag}"))
        assert line in standalone.splitlines(), flag
    assert "_submit" not in standalone and "SUBMITIT" not in standalone
    assert "-m shardctl.orchestrator.clusters.slurm --run-dir " in standalone
    assert f"--max-requeues {spec.slurm.max_requeues} " in standalone
    assert '-- bash "${here}/launch.sh" &\n' in standalone
    # The policy is the node task's, not a bash copy of it.
    assert "scontrol requeue" not in standalone and "PREEMPTED" not in standalone


STANDALONE_SCONTROL = """#!/bin/bash
case "$1" in
  show) echo "JobId=7 JobName=x Command=${FAKE_SCRIPT} WorkDir=/tmp" ;;
  requeue) echo "requeue $2" >> "${FAKE_OUT}" ;;
  *) exit 1 ;;
esac
"""
# The ranks' side of an attempt: a node watchdog writes HUNG and srun ends with 124,
# or the ranks save (PREEMPTED: on the warning; written before typed markers; on a
# TERM alone, i.e. `scancel --signal=TERM`), or a plain failure.
# srun runs the node task here, on this machine, as node 0: its own words end at the
# first that is not an option.
STANDALONE_SRUN = """#!/bin/bash
while [ "${1#--}" != "$1" ]; do shift; done
exec "$@"
"""
STANDALONE_LAUNCH = """#!/bin/bash
case "${FAKE_END}" in
  hung) echo '{"kind": "hung", "step": 20, "node": 1}' > "${FAKE_RUN}/HUNG"; exit 124 ;;
  preempted) echo '{"kind": "preempted", "step": 20, "signal": "SIGUSR2"}' \\
      > "${FAKE_RUN}/PREEMPTED"; exit 1 ;;
  old-preempted) echo '{"step": 20, "reason": "signal SIGUSR2"}' \\
      > "${FAKE_RUN}/PREEMPTED"; exit 1 ;;
  term) echo '{"kind": "preempted", "step": 20, "signal": "SIGTERM"}' \\
      > "${FAKE_RUN}/PREEMPTED"; exit 1 ;;
  *) exit 3 ;;
esac
"""


@pytest.mark.parametrize(
    ("end", "restarts", "code", "requeued", "said"),
    [
        ("hung", "0", 0, True, "hung at step 20 (node 1's watchdog); requeueing job 7 (1 of"),
        ("hung", "3", 1, False, "after 3 requeue(s), which is slurm.max_requeues (3); not"),
        ("preempted", "0", 0, True, "node 0: preempted (saved step 20); requeueing job 7"),
        ("old-preempted", "0", 0, True, "node 0: preempted (saved step 20); requeueing job 7"),
        # A save on TERM alone is a cancel: never requeued.
        ("term", "0", 0, False, "node 0: stopped by SIGTERM (cancel)"),
        ("failed", "0", 1, False, "the launcher exited with code 3; the job failed"),
    ],
)
def test_standalone_batch_script_requeues_a_hung_or_preempted_attempt(
    tmp_path: Path, end: str, restarts: str, code: int, requeued: bool, said: str
) -> None:
    """job.sbatch's shell, with stand-ins for srun (it runs the node task here, as node
    0) and scontrol, and a launch.sh beside the script that ends each way: the node task
    judges the attempt and fences it (its attempt token is the run's current one)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "HUNG").write_text("{}")  # an earlier attempt's: older than this one
    os.utime(run_dir / "HUNG", (1, 1))
    data = load_spec(ROOT / "examples" / "slurm-2node.yaml").to_yaml_dict()
    data["run_dir"] = str(run_dir)
    data["restart"] = {"max_in_allocation": 0}  # each end as the allocation's last
    script = tmp_path / rs.STANDALONE_FILE
    script.write_text(rs.slurm_artifacts(parse_spec(data))[rs.STANDALONE_FILE])
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("scontrol", STANDALONE_SCONTROL), ("srun", STANDALONE_SRUN)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    (tmp_path / "launch.sh").write_text(STANDALONE_LAUNCH)
    out = tmp_path / "calls"
    env = {
        "PATH": f"{bin_dir}{os.pathsep}/usr/bin:/bin",
        "SLURM_JOB_ID": "7",
        "SLURM_RESTART_COUNT": restarts,
        "FAKE_SCRIPT": str(script),
        "FAKE_OUT": str(out),
        "FAKE_RUN": str(run_dir),
        "FAKE_END": end,
        # The node task's interpreter (this machine's python3 would lack shardctl).
        "SHARDCTL_PYTHON": sys.executable,
    }
    proc = subprocess.run(
        ["bash", str(script)], env=env, capture_output=True, text=True, timeout=60
    )
    told = proc.stdout + proc.stderr
    assert proc.returncode == code, told
    assert (out.exists() and out.read_text() == "requeue 7\n") is requeued
    assert said in told
    token = json.loads((run_dir / "CURRENT_ATTEMPT").read_text())["token"]
    assert token == f"slurm-7-{restarts}"


def test_sbatch_error_message_is_parsed() -> None:
    stderr = (
        "sbatch: error: invalid partition specified: nope\n"
        "sbatch: error: Batch job submission failed: Invalid partition name specified\n"
    )
    assert (
        backend._slurm_message(stderr)
        == "Batch job submission failed: Invalid partition name specified"
    )


# ----------------------------------------------------------------- the node task

RANK = """
import os, signal, sys, time
out = sys.argv[1]
def on(sig, frame):
    open(out, "a").write(f"rank got {signal.Signals(sig).name}\\n")
    sys.exit(42)
open(out, "a").write("rank ready\\n")
signal.signal(signal.SIGUSR2, on)
time.sleep(60)
sys.exit(3)
"""

TASK = """
import json, sys
from shardctl.orchestrator.clusters.slurm import NodeTask
task = NodeTask(
    command=json.loads(sys.argv[1]), run_dir=sys.argv[2], signal_name=sys.argv[3], max_requeues=2
)
try:
    print("RESULT", task(), flush=True)
except RuntimeError as exc:
    print("ERROR", exc, flush=True)
"""


def _run_task(
    tmp_path: Path, launcher: str, node: int, restarts: int = 0, signal_after=None, sig="USR2"
):
    rank = tmp_path / "rank.py"
    rank.write_text(RANK)
    script = tmp_path / "launch.sh"
    script.write_text(
        launcher.format(py=shlex.quote(sys.executable), rank=rank, out=tmp_path / "o")
    )
    env = {
        **os.environ,
        "SLURM_NODEID": str(node),
        "SLURM_JOB_ID": "123",
        "SLURM_RESTART_COUNT": str(restarts),
    }
    proc = subprocess.Popen(
        [sys.executable, "-c", TASK, json.dumps(["bash", str(script)]), str(tmp_path), sig],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        if signal_after is not None:
            deadline = time.monotonic() + 30
            out = tmp_path / "o"
            while not (out.exists() and "ready" in out.read_text()):
                assert time.monotonic() < deadline, "the rank never started"
                time.sleep(0.1)
            proc.send_signal(signal.Signals[f"SIG{sig}"])
        stdout, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return stdout


LAUNCHER = "{py} {rank} {out}\n"  # a launcher process (bash) with one rank below it


def test_node_task_forwards_the_signal_to_the_ranks_and_the_launcher_survives(tmp_path):
    # Node 1 of a preempted job: the rank gets USR2 through the task (the launcher
    # ignores it), exits 42; the task reports "preempted" and leaves requeueing to node 0.
    out = _run_task(tmp_path, LAUNCHER, node=1, signal_after=True)
    assert "RESULT preempted" in out, out
    assert (tmp_path / "o").read_text().count("rank got SIGUSR2") == 1


def test_node_task_passes_another_slurm_signal_on_as_usr2(tmp_path):
    # slurm.signal USR1: the ranks (which stop on USR2) are told with USR2.
    out = _run_task(tmp_path, LAUNCHER, node=1, signal_after=True, sig="USR1")
    assert "RESULT preempted" in out, out
    assert "rank got SIGUSR2" in (tmp_path / "o").read_text()


def test_node_task_stops_requeueing_at_max_requeues(tmp_path):
    out = _run_task(tmp_path, LAUNCHER, node=0, restarts=2, signal_after=True)
    assert "ERROR job 123 was preempted" in out and "slurm.max_requeues (2)" in out, out


def test_node_task_success_and_failure(tmp_path, monkeypatch):
    assert "RESULT finished" in _run_task(tmp_path, "exit 0\n", node=0)
    out = _run_task(tmp_path, "exit 7\n", node=1)
    assert "ERROR node 1 of job 123: the launcher exited with code 7" in out, out


def test_node_task_requeues_after_the_ranks_saved_without_a_signal(tmp_path):
    # The ranks stopped and saved by themselves (SHARDCTL_STOP_AFTER_STEP, or a signal
    # only they saw): rank 0's PREEMPTED marker written during this attempt counts.
    marker = '{{"kind": "preempted", "step": 7, "signal": "SIGUSR2", "reason": "signal SIGUSR2"}}'
    launcher = f"echo '{marker}' > {{out}}/../PREEMPTED\nexit 1\n"
    out = _run_task(tmp_path, launcher.replace("{out}/..", str(tmp_path)), node=1)
    assert "RESULT preempted" in out, out
    # A marker from a save caused by SIGTERM alone (a cancel) never requeues: read from
    # the typed field; the human reason says nothing to the decision.
    term = launcher.replace('"signal": "SIGUSR2"', '"signal": "SIGTERM"')
    assert "RESULT terminated" in _run_task(
        tmp_path, term.replace("{out}/..", str(tmp_path)), node=0
    )
    # A marker written before the typed fields (no `signal`) counts as a preemption.
    old = 'echo \'{{"step": 7, "reason": "signal SIGTERM"}}\' > {out}/../PREEMPTED\nexit 1\n'
    out = _run_task(tmp_path, old.replace("{out}/..", str(tmp_path)), node=1)
    assert "RESULT preempted" in out, out


# A node task whose start is slow (its interpreter, submitit's unpickling): it says it
# is starting and waits for `go` before `NodeTask` exists.
SLOW_START = (
    """
import sys, time
from pathlib import Path
folder = Path(sys.argv[2])
(folder / "starting").write_text("yes")
deadline = time.monotonic() + 60
while not (folder / "go").exists() and time.monotonic() < deadline:
    time.sleep(0.05)
"""
    + TASK
)


def test_a_signal_sent_while_the_node_task_starts_waits_for_its_handler(tmp_path):
    """The srun line of sbatch.sh starts the node task with the warning held: one that
    lands before `NodeTask` has its handler is taken once it has, passed on to the
    rank, and the node is preempted; without the hold the task died of it (the job
    FAILED), and without `NodeTask` releasing it the rank never got it."""
    spec = load_spec(ROOT / "examples" / "slurm-2node.yaml")
    sub = rs.submission(spec, run_dir=str(tmp_path))
    srun_line = next(x for x in rs.sbatch_text(spec, sub).splitlines() if x.startswith("srun "))
    words = shlex.split(srun_line)
    hold = words[words.index("--error") + 2 : words.index("python3")]
    (tmp_path / "rank.py").write_text(RANK)
    (tmp_path / "launch.sh").write_text(
        LAUNCHER.format(
            py=shlex.quote(sys.executable), rank=tmp_path / "rank.py", out=tmp_path / "o"
        )
    )
    env = {**os.environ, "SLURM_NODEID": "1", "SLURM_JOB_ID": "123", "SLURM_RESTART_COUNT": "0"}
    command = json.dumps(["bash", str(tmp_path / "launch.sh")])
    proc = subprocess.Popen(
        [*hold, sys.executable, "-c", SLOW_START, command, str(tmp_path), "USR2"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "starting").exists():
            assert time.monotonic() < deadline and proc.poll() is None, "the task never started"
            time.sleep(0.05)
        proc.send_signal(signal.SIGUSR2)
        (tmp_path / "go").write_text("go")
        stdout, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0 and "RESULT preempted" in stdout, (proc.returncode, stdout)
    assert "node 1: got SIGUSR2" in stdout
    assert (tmp_path / "o").read_text().count("rank got SIGUSR2") == 1


HUNG = {"step": 9, "node": 1, "attempt": 0, "first": [1], "ranks": [{"rank": 1, "step": 9}]}


def test_node_task_counts_a_hang_as_a_retryable_fault(tmp_path):
    # The node's watchdog exited 124: node 1 leaves the requeue to node 0 and does not
    # fail; node 0 out of requeues fails naming the step the HUNG marker names. The
    # marker is written during the attempt, as a watchdog does (a marker written before
    # the task started is an earlier attempt's on a slow machine).
    (tmp_path / "hung.json").write_text(json.dumps(HUNG))
    write_hung = (
        f"cp {shlex.quote(str(tmp_path / 'hung.json'))} {shlex.quote(str(tmp_path / 'HUNG'))}"
    )
    assert "RESULT hung" in _run_task(tmp_path, f"{write_hung}; exit 124\n", node=1)
    out = _run_task(tmp_path, f"{write_hung}; exit 124\n", node=0, restarts=2)
    assert "ERROR job 123 hung at step 9 (node 1's watchdog) after 2 requeue(s)" in out, out
    assert "slurm.max_requeues (2); not requeued. Resubmit" in out, out
    # Another node's fresh HUNG makes any failure of this node a hang, not a failure.
    assert "RESULT hung" in _run_task(tmp_path, f"{write_hung}; sleep 0.2; exit 1\n", node=1)
    # A HUNG of an earlier attempt does not.
    os.utime(tmp_path / "HUNG", (time.time() - 3600,) * 2)
    out = _run_task(tmp_path, "exit 7\n", node=1)
    assert "ERROR node 1 of job 123: the launcher exited with code 7" in out, out


def test_status_says_the_last_attempt_hung(tmp_path, monkeypatch):
    from shardctl.orchestrator.clusters.base import JobRef

    info = {"JobState": "RUNNING", "Restarts": "1", "NodeList": "n[1-2]", "Reason": "None"}
    monkeypatch.setattr(backend, "_require_slurm", lambda: None)
    monkeypatch.setattr(backend, "scontrol_job", lambda job_id: info)
    ref = JobRef("slurm", "5", "hangs", str(tmp_path))
    report = tmp_path / "logs" / "hang-attempt0-node1.txt"
    (tmp_path / "HUNG").write_text(json.dumps({**HUNG, "report": str(report)}))
    st = backend.SlurmCluster().status(ref)
    assert st.state is JobState.RUNNING
    assert st.detail == (
        "requeued 1 time(s), nodes n[1-2], "
        "last attempt hung at step 9 (see logs/hang-attempt0-node1.txt)"
    )
    # Out of requeues: the job FAILED and the attempt that failed is the one that hung.
    info.update(JobState="FAILED", Restarts="0")
    st = backend.SlurmCluster().status(ref)
    assert st.state is JobState.FAILED and "hung: no rank advanced" in st.detail
    assert "rank 1 at step 9" in st.detail
    # A hang of an earlier attempt says nothing about a later failure or a plain run.
    info.update(Restarts="1")
    assert "hung" not in backend.SlurmCluster().status(ref).detail
    info.update(JobState="RUNNING", Restarts="2")
    assert "hung" not in backend.SlurmCluster().status(ref).detail


def test_without_slurm_submit_and_status_say_how_to_get_one(tmp_path, monkeypatch) -> None:
    from shardctl.orchestrator.clusters.base import JobRef
    from shardctl.orchestrator.errors import ClusterError

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path))
    cluster = backend.SlurmCluster()
    plan = cluster.dryrun(load_spec(ROOT / "examples" / "slurm-2node.yaml"))
    with pytest.raises(ClusterError, match=r"no Slurm client \(sbatch\).*slurm-dev-cluster up"):
        cluster.schedule(plan)
    assert not (tmp_path / "runs").exists()
    with pytest.raises(ClusterError, match="no Slurm client"):
        cluster.status(JobRef("slurm", "1", "x", str(tmp_path)))

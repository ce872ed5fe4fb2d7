"""`slurm.sbatch_options` and `slurm.container` (pyxis) without a cluster.

Extra `#SBATCH` options are checked by name against sbatch's own list (typos get a
did-you-mean, options the spec owns name the field to use) and by value; they reach
both batch scripts and submitit. A container becomes `--container-*` words of the one
srun line; the run and checkpoint directories are mounted at their own paths. pyxis
is not installed here (srun refuses `--container-image`), so only the rendering and
the batch shell around srun are run, with stand-ins for srun and scontrol.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from shardctl.orchestrator.clusters.slurm import SlurmCluster
from shardctl.orchestrator.clusters.slurm import sbatch as rs
from shardctl.orchestrator.errors import SpecError
from shardctl.orchestrator.spec import parse_spec

SHARDCTL = [sys.executable, "-m", "shardctl.orchestrator.cli"]
IMAGE = "nvcr.io#nvidia/pytorch:24.05-py3"


def _data(slurm: dict[str, Any], **top: Any) -> dict[str, Any]:
    return {
        "name": "opt-job",
        "run_dir": "/shared/runs/opt-job",
        "resources": {"nodes": 2, "procs_per_node": 4, "device": "cuda"},
        "train": {"model": {"llama": {}}, "data": {"builtin": "python-stdlib"}, "steps": 10},
        "checkpoint": {"every_steps": 5},
        "slurm": slurm,
        **top,
    }


def _spec(slurm: dict[str, Any], **top: Any):
    return parse_spec(_data(slurm, **top))


def _problems(slurm: dict[str, Any]) -> list[str]:
    with pytest.raises(SpecError) as err:
        _spec(slurm)
    return err.value.problems


OPTIONS = {
    "reservation": "maint",
    "exclude": "node[01-03]",
    "nodelist": "gpu[01-02]",
    "dependency": "afterok:1234",
    "mail-type": "END,FAIL",
    "mail-user": "a@b.c",
    "gpus-per-task": 4,
    "comment": "it's #1 $(reboot)",
    "nice": 10,
    "begin": "now+1hour",
    "hold": True,
}


# ------------------------------------------------------------------ rendering


def test_options_reach_both_scripts_and_submitit_as_written() -> None:
    files = rs.slurm_artifacts(_spec({"sbatch_options": OPTIONS}))
    expected = [
        "#SBATCH --begin=now+1hour",
        # A quote, '#' (a comment to sbatch's parser) and $(...) stay inert.
        "#SBATCH --comment='it'\"'\"'s #1 $(reboot)'",
        "#SBATCH --dependency=afterok:1234",
        "#SBATCH --exclude='node[01-03]'",
        "#SBATCH --gpus-per-task=4",
        "#SBATCH --hold",
        "#SBATCH --mail-type=END,FAIL",
        "#SBATCH --mail-user=a@b.c",
        "#SBATCH --nice=10",
        "#SBATCH --nodelist='gpu[01-02]'",
        "#SBATCH --reservation=maint",
    ]
    for name in (rs.SBATCH_FILE, rs.STANDALONE_FILE):
        lines = files[name].splitlines()
        for line in expected:
            assert lines.count(line) == 1, (name, line)
    params = json.loads(files[rs.SUBMITIT_FILE])["parameters"]
    # submitit's own spelling, beside shardctl's own additional parameters.
    assert params["additional_parameters"] == {
        "requeue": True,
        **{k.replace("-", "_"): v for k, v in OPTIONS.items()},
    }


def test_options_survive_job_yaml_round_trip() -> None:
    """The nodes parse job.yaml again: the validated options must validate twice."""
    spec = _spec({"sbatch_options": OPTIONS, "container": {"image": IMAGE}})
    again = parse_spec(spec.to_yaml_dict())
    assert again.slurm == spec.slurm
    assert again.slurm.sbatch_options == OPTIONS


def test_container_renders_into_the_one_srun_line_of_both_scripts() -> None:
    spec = _spec(
        {
            "container": {
                "image": IMAGE,
                "mounts": ["/data:/data:ro", "/models:/opt/models:ro+rprivate"],
                "workdir": "/shared",
                "mount_home": False,
                "writable": True,
                "env": ["NCCL_DEBUG"],
            },
            "srun_args": ["--cpu-bind=none"],
        },
        checkpoint={"every_steps": 5, "dir": "/scratch/opt-job/ckpt"},
    )
    files = rs.slurm_artifacts(spec)
    words = (
        f"'--container-image={IMAGE}' "
        "--container-mounts=/data:/data:ro,/models:/opt/models:ro+rprivate,"
        "/shared/runs/opt-job,/scratch/opt-job/ckpt "
        "--container-workdir=/shared --no-container-mount-home --container-writable "
        "--container-env=NCCL_DEBUG --cpu-bind=none "
    )
    sbatch = files[rs.SBATCH_FILE]
    assert (
        "srun --unbuffered --output /shared/runs/opt-job/submitit/%j/%j_%t_log.out "
        "--error /shared/runs/opt-job/submitit/%j/%j_%t_log.err "
        + words
        + "env --block-signal=USR2 python3 -u -m submitit.core._submit "
        "/shared/runs/opt-job/submitit/%j &\n"
    ) in sbatch
    # job.sbatch: the same words, plus the script's own folder, expanded by the shell.
    standalone = files[rs.STANDALONE_FILE]
    mounts = (
        "'--container-mounts=/data:/data:ro,/models:/opt/models:ro+rprivate,"
        "/shared/runs/opt-job,/scratch/opt-job/ckpt,'\"${here}\"':'\"${here}\"'' "
    )
    mine = words.split(" ", 2)[2]  # after the image and the mounts
    assert f"srun --unbuffered '--container-image={IMAGE}' {mounts}{mine}env " in standalone
    for text in (sbatch, standalone):
        assert (
            f"# pyxis runs every node's launcher in {IMAGE}; mounted at their own paths by "
            "shardctl: /shared/runs/opt-job, /scratch/opt-job/ckpt\n"
        ) in text
        assert 'export SHARDCTL_MASTER_ADDR="${SHARDCTL_MASTER_ADDR%%[[:space:]]*}"\n' in text


def test_a_mount_that_covers_the_run_dir_is_not_doubled() -> None:
    spec = _spec({"container": {"image": IMAGE, "mounts": ["/shared"]}})
    words = rs.srun_args(spec)
    # The checkpoint dir lies in the run dir, which lies in /shared: nothing added.
    assert words == [f"--container-image={IMAGE}", "--container-mounts=/shared"]
    assert "mounted at their own paths" not in rs.container_setup(spec)[0]


def test_a_bucket_checkpoint_dir_is_not_mounted() -> None:
    """checkpoint.dir on S3: the ranks reach it over the network; only the run dir (and
    its s3-cache) is mounted, never a folder named after the URL."""
    spec = _spec({"container": {"image": IMAGE}}, checkpoint={"every_steps": 5,
                 "dir": "s3://ckpts/opt-job"})  # fmt: skip
    words = rs.srun_args(spec)
    assert words == [f"--container-image={IMAGE}", "--container-mounts=/shared/runs/opt-job"]


def test_without_container_srun_words_are_the_users_alone() -> None:
    spec = _spec({"srun_args": ["--label"]})
    assert rs.srun_args(spec) == ["--label"]
    assert rs.container_setup(spec) == []
    assert "scontrol show hostnames" in SlurmCluster().artifacts(spec)["launch.sh"]


def test_container_launch_reads_the_master_from_the_batch_shell(monkeypatch, tmp_path) -> None:
    monkeypatch.chdir(tmp_path)
    data = _data({"container": {"image": IMAGE}})
    data["run_dir"] = "runs/opt-job"
    plan = SlurmCluster().dryrun(parse_spec(data))
    launch = plan.artifacts["launch.sh"]
    assert "$(scontrol" not in launch  # the image has no Slurm client
    assert 'export MASTER_ADDR="${SHARDCTL_MASTER_ADDR:?' in launch
    # submitit's entry point runs in the image: its python3, not this interpreter.
    assert plan.request["executor"]["python"] == "python3"
    run_dir = str(tmp_path.resolve() / "runs" / "opt-job")
    assert f"--container-mounts={run_dir}" in plan.artifacts[rs.SBATCH_FILE]


@pytest.mark.parametrize(
    ("slurm", "message"),
    [
        (
            {"mounts": ["/elsewhere:/shared"]},
            "slurm.container.mounts '/elsewhere:/shared' puts /elsewhere at /shared, so the "
            "run directory '/shared/runs/opt-job' inside the container is another folder",
        ),
        (
            {"mounts": ["/shared:/shared:ro"]},
            "slurm.container.mounts '/shared:/shared:ro' is read-only, but the ranks write "
            "the run directory '/shared/runs/opt-job' beneath it",
        ),
    ],
)
def test_a_mount_that_hides_the_run_dir_is_refused_at_render(slurm, message) -> None:
    spec = _spec({"container": {"image": IMAGE, **slurm}})
    with pytest.raises(SpecError) as err:
        rs.slurm_artifacts(spec)
    assert any(p.startswith(message) for p in err.value.problems), err.value.problems


@pytest.mark.parametrize(
    ("options", "resources", "message"),
    [
        (
            {"mem-per-gpu": "40G"},
            {"memory": "512G"},
            "slurm.sbatch_options.mem-per-gpu '40G' and resources.memory '512G' both size",
        ),
        (
            {"gpus-per-task": 1},
            {},
            "slurm.sbatch_options.gpus-per-task 1: shardctl runs one task per node, whose "
            "launcher starts resources.procs_per_node (4) ranks",
        ),
    ],
)
def test_options_that_contradict_the_spec_are_refused_at_render(options, resources, message):
    data = _data({"sbatch_options": options})
    data["resources"].update(resources)
    with pytest.raises(SpecError) as err:
        rs.slurm_artifacts(parse_spec(data))
    assert err.value.problems[0].startswith(message), err.value.problems


def test_rendered_scripts_with_options_and_container_pass_shellcheck(tmp_path: Path) -> None:
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck (Debian package) is not installed")
    spec = _spec({"sbatch_options": OPTIONS, "container": {"image": IMAGE, "mounts": ["/d"]}})
    for name, text in rs.slurm_artifacts(spec).items():
        if name == rs.SUBMITIT_FILE:
            continue
        path = tmp_path / name
        path.write_text(text)
        proc = subprocess.run(["shellcheck", str(path)], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, (name, proc.stdout)


FAKE_SCONTROL = """#!/bin/bash
case "$1 $2" in
  "show job") echo "JobId=7 JobName=opt-job Command=${FAKE_SCRIPT} WorkDir=/tmp" ;;
  "show hostnames") printf 'gpu17\\ngpu18\\n' ;;
  *) exit 1 ;;
esac
"""
FAKE_SRUN = """#!/bin/bash
printf '%s\\n' "MASTER=${SHARDCTL_MASTER_ADDR}" "$@" > "${FAKE_OUT}"
"""


def test_job_sbatch_mounts_its_own_folder_as_the_shell_sees_it(tmp_path: Path) -> None:
    """Runs job.sbatch's shell with stand-ins for srun and scontrol: the srun line gets
    the container words, the script's folder (a quote and `$` in its path stay inert)
    as one more mount, and the master address found on the host."""
    folder = tmp_path / "it's-$HOME"
    folder.mkdir()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("scontrol", FAKE_SCONTROL), ("srun", FAKE_SRUN)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(stat.S_IRWXU)
    spec = _spec({"container": {"image": IMAGE}})
    script = folder / rs.STANDALONE_FILE
    script.write_text(rs.slurm_artifacts(spec)[rs.STANDALONE_FILE])
    out = tmp_path / "srun-args"
    env = {
        "PATH": f"{bin_dir}{os.pathsep}/usr/bin:/bin",
        "SLURM_JOB_ID": "7",
        "SLURM_JOB_NODELIST": "gpu[17-18]",
        "FAKE_SCRIPT": str(script),
        "FAKE_OUT": str(out),
    }
    proc = subprocess.run(
        ["bash", str(script)], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    args = out.read_text().splitlines()
    assert args[:4] == [
        "MASTER=gpu17",
        "--unbuffered",
        f"--container-image={IMAGE}",
        f"--container-mounts=/shared/runs/opt-job,{folder}:{folder}",
    ]
    assert args[-1] == f"{folder}/launch.sh"


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    ("options", "problem"),
    [
        (
            {"exlude": "n1"},
            "slurm.sbatch_options.exlude: not an sbatch option; did you mean 'exclude'?",
        ),
        (
            {"mail_type": "END"},
            "slurm.sbatch_options.mail_type: not an sbatch option; did you mean 'mail-type'?",
        ),
        (
            {"reservaton": "maint"},
            "slurm.sbatch_options.reservaton: not an sbatch option; did you mean 'reservation'?",
        ),
        ({"--reservation": "m"}, "write the option name without dashes: 'reservation'"),
        (
            {"nodes": 4},
            "slurm.sbatch_options.nodes: --nodes is shardctl's to set; use resources.nodes",
        ),
        ({"time": "1:00:00"}, "--time is shardctl's to set; use slurm.time"),
        ({"partition": "gpu"}, "--partition is shardctl's to set; use slurm.partition"),
        ({"mem": "4G"}, "--mem is shardctl's to set; use resources.memory"),
        ({"job-name": "x"}, "--job-name is shardctl's to set; use name"),
        ({"cpus-per-task": 8}, "use resources.cpus_per_proc"),
        ({"ntasks-per-node": 8}, "use resources.procs_per_node"),
        ({"signal": "USR1@60"}, "use slurm.signal and slurm.signal_delay_s"),
        ({"requeue": True}, "use slurm.max_requeues"),
        ({"exclusive": True}, "use slurm.exclusive"),
        ({"array": "0-3"}, "--array is shardctl's to set"),
        ({"parsable": True}, "shardctl reads the job id"),
        (
            {"container-image": "x"},
            "a pyxis option for the ranks' srun, not sbatch; use slurm.container",
        ),
        (
            {"comment": "a\nb"},
            "slurm.sbatch_options.comment: 'a\\nb' is not one line of printable text",
        ),
        ({"comment": "x\x1b[31m"}, "is not one line of printable text"),
        ({"comment": ""}, "is not one line of printable text"),
        ({"comment": "x" * 5000}, "is longer than 4096 characters"),
        ({"hold": "yes"}, "slurm.sbatch_options.hold: 'yes': --hold is a switch without a value"),
        ({"reservation": True}, "slurm.sbatch_options.reservation: true: --reservation needs"),
        ({"begin": False}, "False: leave the key out to leave --begin out"),
        ({"begin": None}, "None: leave the key out"),
        ({"nice": 1.5}, "1.5 is a number; accepted: a string or an integer, or true"),
        ({"exclude": ["n1"]}, "['n1'] is a list; accepted: a string or an integer"),
        ({"nice": "ten"}, "'ten' is not a nice adjustment; accepted: an integer"),
        ({"mail-type": "END,FAL"}, "'FAL' is no mail type; accepted: a comma-separated list"),
    ],
)
def test_bad_sbatch_options_are_refused_with_field_value_and_what_is_accepted(
    options: dict[str, Any], problem: str
) -> None:
    problems = _problems({"sbatch_options": options})
    assert len(problems) == 1 and problem in problems[0], problems


def test_every_bad_option_is_reported_at_once() -> None:
    problems = _problems({"sbatch_options": {"exlude": "n", "nodes": 2, "hold": "x", "ok": 1}})
    assert [p.split(":")[0] for p in problems] == [
        f"slurm.sbatch_options.{n}" for n in ("exlude", "nodes", "hold", "ok")
    ]


def test_unknown_option_lists_what_is_accepted_and_not_what_is_owned() -> None:
    (problem,) = _problems({"sbatch_options": {"frobnicate": 1}})
    accepted = problem.split("without '--': ", 1)[1]
    assert "reservation" in accepted and "mem-per-gpu" in accepted
    assert "nodes" not in accepted.split(", ") and "time" not in accepted.split(", ")
    assert "did you mean" not in problem


@pytest.mark.parametrize(
    ("container", "problem"),
    [
        (
            {"image": "nvcr.io/nvidia/pytorch:24.05-py3"},
            "slurm.container.image: 'nvcr.io/nvidia/pytorch:24.05-py3': enroot separates the "
            "registry with '#'; accepted: 'nvcr.io#nvidia/pytorch:24.05-py3'",
        ),
        ({"image": "torch 2.4"}, "slurm.container.image: 'torch 2.4' is not an image reference"),
        ({"image": "a\nb"}, "is not an image reference"),
        ({}, "slurm.container.image: required but missing"),
        ({"image": IMAGE, "mounts": ["data:/data"]}, "'data' is not an absolute path"),
        ({"image": IMAGE, "mounts": ["/a:/b,/c:/d"]}, "is not a pyxis mount"),
        ({"image": IMAGE, "mounts": ["/a b:/c"]}, "is not a pyxis mount"),
        ({"image": IMAGE, "mounts": ["/a:/b:rx"]}, "unknown mount flag ['rx']"),
        ({"image": IMAGE, "mounts": ["/a:/b:"]}, "unknown mount flag ['']"),
        ({"image": IMAGE, "mounts": ["/a:/b", "/c:/b/"]}, "mount the same path '/b'"),
        ({"image": IMAGE, "workdir": "work"}, "slurm.container.workdir: 'work' is not an abs"),
        ({"image": IMAGE, "env": ["NCCL-DEBUG"]}, "'NCCL-DEBUG' is not an environment variable"),
        ({"image": IMAGE, "gpus": 8}, "unknown key 'slurm.container.gpus'"),
    ],
)
def test_bad_container_settings_are_refused(container: dict[str, Any], problem: str) -> None:
    problems = _problems({"container": container})
    assert len(problems) == 1 and problem in problems[0], problems


def test_pyxis_words_in_srun_args_beside_a_container_are_refused() -> None:
    (problem,) = _problems(
        {"container": {"image": IMAGE}, "srun_args": ["--container-image=other"]}
    )
    assert "srun_args '--container-image=other' and container both set pyxis options" in problem


def test_cli_validate_says_which_option_is_wrong_without_a_traceback(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(_data({"sbatch_options": {"exlude": "n1", "nodes": 2}})))
    proc = subprocess.run(
        [*SHARDCTL, "validate", str(path)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2, proc.stdout
    assert "slurm.sbatch_options.exlude: not an sbatch option; did you mean 'exclude'?" in (
        proc.stderr
    )
    assert "slurm.sbatch_options.nodes: --nodes is shardctl's to set" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_cli_render_refuses_a_contradiction_without_a_traceback(tmp_path: Path) -> None:
    data = _data({"sbatch_options": {"mem-per-gpu": "40G"}})
    data["resources"]["memory"] = "64G"
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(data))
    proc = subprocess.run(
        [*SHARDCTL, "render", str(path), "--cluster", "slurm", "--out", str(tmp_path / "r")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stdout
    assert "slurm.sbatch_options.mem-per-gpu '40G' and resources.memory '64G'" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "r").exists()


# ------------------------------------------------------- logs --rank: the node that ran it


def _rank_nodes(run_dir: Path, job: str, requeue: int, node: int, ranks: list[int]) -> None:
    """A node task's record of its ranks, as `rank_nodes.RankRecorder` writes it."""
    folder = run_dir / "logs" / "rank-nodes"
    folder.mkdir(parents=True, exist_ok=True)
    record = {"job": job, "requeue": requeue, "restart": 0, "node": node,
              "host": f"n{node + 1}", "ranks": ranks, "time": 1000.0 + requeue}  # fmt: skip
    (folder / f"{job}-node{node}.json").write_text(json.dumps(record))


def test_the_node_of_a_rank_is_the_one_its_node_task_recorded(tmp_path: Path) -> None:
    from shardctl.orchestrator.clusters.slurm.rank_nodes import node_of_rank

    # The rendezvous put node 1 first: ranks 0 and 1 ran there.
    _rank_nodes(tmp_path, "7", 0, 0, [2, 3])
    _rank_nodes(tmp_path, "7", 0, 1, [0, 1])
    _rank_nodes(tmp_path, "8", 0, 0, [0, 1])  # another job of the same run dir
    assert node_of_rank(tmp_path, "7", 0) == (1, "n2")
    assert node_of_rank(tmp_path, "7", 3) == (0, "n1")
    assert node_of_rank(tmp_path, "8", 0) == (0, "n1")
    assert node_of_rank(tmp_path, "7", 4) is None  # recorded by no node
    # After a requeue node 0 came first: the newest attempt that recorded the rank.
    _rank_nodes(tmp_path, "7", 1, 0, [0, 1])
    assert node_of_rank(tmp_path, "7", 0) == (0, "n1")


def test_logs_rank_follows_the_node_that_ran_the_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from click.testing import CliRunner
    from shardctl.orchestrator.cli import cli
    from shardctl.orchestrator.clusters.base import JobRef
    from shardctl.orchestrator.clusters.records import remember

    (tmp_path / "job.yaml").write_text(yaml.safe_dump(_data({})))  # 2 nodes × 4 processes
    # Node 1 came first to the rendezvous: ranks 0..3 ran there, not on node 0.
    _rank_nodes(tmp_path, "7", 0, 0, [4, 5, 6, 7])
    _rank_nodes(tmp_path, "7", 0, 1, [0, 1, 2, 3])
    remember(JobRef(cluster="slurm", job_id="7", name="ranked", run_dir=str(tmp_path),
                    extra={"nodes": 2}))  # fmt: skip
    followed: list[int | None] = []
    monkeypatch.setattr(
        SlurmCluster, "follow_logs", lambda self, ref, write, **kw: followed.append(kw["node"])
    )
    res = CliRunner().invoke(cli, ["logs", "ranked", "-f", "--rank", "0"])
    assert res.exit_code == 0, res.output
    assert followed == [1]
    assert "rank 0 ran on node 1 (n2); showing that node" in res.output


def test_a_node_task_records_the_ranks_below_its_launcher(tmp_path: Path) -> None:
    from shardctl.orchestrator.clusters.slurm.rank_nodes import RankRecorder, node_of_rank

    # A launcher (this test's process) with one rank below it, global rank 5.
    rank = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], env={**os.environ, "RANK": "5"}
    )
    try:
        recorder = RankRecorder(str(tmp_path), "9", 2, 1, node=1, per_node=1)
        recorder.poll(os.getpid())
        assert recorder.ranks == {5}
        assert node_of_rank(tmp_path, "9", 5) == (1, recorder.fields["host"])
        record = json.loads((tmp_path / "logs" / "rank-nodes" / "9-node1.json").read_text())
        assert (record["requeue"], record["restart"], record["ranks"]) == (2, 1, [5])
    finally:
        rank.kill()
        rank.wait(timeout=30)

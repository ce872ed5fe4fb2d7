"""Hostile values come out of the rendered shell inert, and every shell file passes shellcheck.

The scripts are executed, not just read: stub launchers on PATH record the argv
and environment they were started with, and the test compares them exactly to
what the spec said — with quotes, `$(...)`, backticks, newlines and unicode in
env values, in the spec path and in the folder the scripts are rendered into.
A side effect (a file created by an injected command) fails the test.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import yaml
from helpers.render_util import (
    EXAMPLES,
    read_records,
    run_script,
    run_shellcheck,
    shellcheck,
    stub_launchers,
    variant,
    write_files,
)
from shardctl.orchestrator.clusters import get_cluster, render_artifacts
from shardctl.orchestrator.errors import SpecError
from shardctl.orchestrator.spec import load_spec, parse_spec, read_job_yaml

PWNED = "PWNED"
HOSTILE_VALUES = {
    "H_QUOTES": """it's "double" and 'single'""",
    "H_SUBST": f"$(touch {PWNED}-subst)",
    "H_BACKTICK": f"`touch {PWNED}-backtick`",
    "H_NEWLINE": f"first line\nsecond; touch {PWNED}-newline",
    "H_UNICODE": "ünïcødé ☃ — 日本語",
    "H_VARS": "$HOME ${PATH} $0 $1 $@ $$ ~",
    "H_GLOB": "* ? [a-z] {a,b}",
    "H_SEMI": f"x; touch {PWNED}-semi && echo",
    "H_EMPTY": "",
    "H_DASH": "-e -n --help",
    "H_BACKSLASH": "a\\b\\\\c\\n\\",
    "H_BANG": "!! !$ ${!x}",
    "H_SPACES": "  padded  ",
}
HOSTILE_DIR = "we ird $(touch PWNED-dir) `x` 'q\" ü\nline"
CASES = [("torchrun", "fsdp"), ("accelerate", "fsdp"), ("accelerate", "deepspeed"),
         ("deepspeed", "deepspeed")]  # fmt: skip


def _hostile_spec(launcher: str, backend: str):
    return variant(
        {
            "launcher": launcher,
            "strategy": {"backend": backend},
            "env": HOSTILE_VALUES,
            "checkpoint": {"dir": "runs/$(touch PWNED-ckpt)/'x\"/ckpt"},
        }
    )


def _assert_inert(*roots: Path) -> None:
    for root in roots:
        hits = [p for p in root.rglob(f"{PWNED}*")]
        assert not hits, f"injected commands ran: {hits}"


def _expected_argv(launcher: str, backend: str, folder: str, spec_path: str) -> list[str]:
    spec = spec_path
    if launcher == "torchrun":
        return ["--standalone", "--nnodes", "1", "--nproc-per-node", "2",
                "-m", "shardctl.train", spec]  # fmt: skip
    if launcher == "accelerate":
        ds = (
            ["--deepspeed_config_file", f"{folder}/ds_config.json"]
            if backend == "deepspeed"
            else []
        )
        return ["launch", "--config_file", f"{folder}/accelerate_config.yaml", *ds,
                "--machine_rank", "0", "--main_process_ip", "127.0.0.1",
                "--main_process_port", "29500", "-m", "shardctl.train", spec]  # fmt: skip
    return ["--hostfile", f"{folder}/hostfile", "--no_ssh", "--node_rank", "0",
            "--master_addr", "127.0.0.1", "--master_port", "29500", "--no_local_rank",
            "--module", "shardctl.train", spec]  # fmt: skip


@pytest.mark.parametrize(("launcher", "backend"), CASES)
def test_hostile_values_reach_the_launcher_verbatim(
    tmp_path: Path, launcher: str, backend: str
) -> None:
    spec = _hostile_spec(launcher, backend)
    folder = write_files(render_artifacts(spec, "local"), tmp_path / HOSTILE_DIR)
    record = tmp_path / "record.jsonl"
    env = stub_launchers(tmp_path / "bin", record)
    env["STUB_EXTRA_ENV"] = " ".join(HOSTILE_VALUES)
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    done = run_script(folder / "launch.sh", env, cwd=elsewhere)
    assert done.returncode == 0, done.stderr
    [entry] = read_records(record)
    assert entry["prog"] == launcher
    assert entry["argv"] == _expected_argv(launcher, backend, str(folder), f"{folder}/job.yaml")
    for key, value in HOSTILE_VALUES.items():
        assert entry["env"][key] == value, key
    assert entry["env"]["SHARDCTL_RENDER_DIR"] == str(folder)
    _assert_inert(tmp_path)


def test_hostile_absolute_spec_path_stays_one_word(tmp_path: Path) -> None:
    spec = variant()
    spec_path = str(tmp_path / "a b" / "$(touch PWNED-path)" / "it's `x`\n.yaml")
    folder = write_files(
        {"launch.sh": get_cluster("local").launch_script(spec, spec_path)}, tmp_path / "r"
    )
    record = tmp_path / "record.jsonl"
    done = run_script(folder / "launch.sh", stub_launchers(tmp_path / "bin", record))
    assert done.returncode == 0, done.stderr
    assert read_records(record)[0]["argv"][-1] == spec_path
    _assert_inert(tmp_path)


@pytest.mark.parametrize("cluster", ["slurm", "k8s"])
def test_hostile_cluster_variables_are_not_re_evaluated(tmp_path: Path, cluster: str) -> None:
    """Values the cluster injects are expanded once, as data, never run as code."""
    spec = variant({"resources": {"nodes": 2}, "env": {"H_SUBST": HOSTILE_VALUES["H_SUBST"]}})
    folder = write_files(
        {"launch.sh": get_cluster(cluster).launch_script(spec, "job.yaml")}, tmp_path / "r"
    )
    record = tmp_path / "record.jsonl"
    env = stub_launchers(tmp_path / "bin", record)
    evil = "$(touch PWNED-cluster)`touch PWNED-tick`"
    if cluster == "slurm":
        if not shutil.which("scontrol"):
            pytest.skip("Slurm's scontrol is not installed (apt-get install slurm-client)")
        env.update(SLURM_JOB_NUM_NODES="2", SLURM_NODEID="1", SLURM_JOB_NODELIST="n[1-2]")
        addr = "n1"
    else:
        env.update(PET_NNODES="2", PET_NODE_RANK="1", PET_NPROC_PER_NODE="2",
                   MASTER_ADDR=evil, MASTER_PORT="23456")  # fmt: skip
        addr = evil
    done = run_script(folder / "launch.sh", env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    [entry] = read_records(record)
    assert entry["argv"][entry["argv"].index("--rdzv-endpoint") + 1] == f"{addr}:" + (
        "29500" if cluster == "slurm" else "23456"
    )
    _assert_inert(tmp_path)


def test_job_yaml_round_trips_hostile_values(tmp_path: Path) -> None:
    spec = _hostile_spec("torchrun", "fsdp")
    folder = write_files(render_artifacts(spec, "local"), tmp_path / "r")
    assert read_job_yaml(folder / "job.yaml") == spec


@pytest.mark.parametrize(
    "name", ["a$(touch x)", "it's", "x`y`", "a b", "new\nline", "ünï", "-dash", "UPPER"]
)
def test_hostile_job_names_are_refused_before_rendering(name: str) -> None:
    with pytest.raises(SpecError, match="name"):
        parse_spec({**yaml.safe_load((EXAMPLES / "tiny-llama.yaml").read_text()), "name": name})


def test_user_env_values_are_literal_not_expanded(tmp_path: Path) -> None:
    text = get_cluster("local").env_file(variant({"env": {"H_VARS": "$HOME"}}))
    assert "export H_VARS='$HOME'" in text


# ------------------------------------------------------------------ shellcheck


def _shell_files(folder: Path) -> list[Path]:
    out = []
    for path in sorted(folder.iterdir()):
        head = path.read_text(encoding="utf-8", errors="replace")[:200]
        first = head.splitlines()[0] if head else ""
        if path.suffix == ".sh" or (first.startswith("#!") and "sh" in first.split("/")[-1]):
            out.append(path)
    return out


def _need_shellcheck() -> None:
    if shellcheck() is None:
        pytest.skip("shellcheck is not installed (apt-get install -y shellcheck; CI installs it)")


INTENDED_NOTES = ("SC2016", "SC1003")
EXAMPLE_NAMES = sorted(p.stem for p in EXAMPLES.glob("*.yaml"))


@pytest.mark.parametrize("cluster", ["local", "slurm", "k8s"])
@pytest.mark.parametrize("example", EXAMPLE_NAMES)
def test_shellcheck_every_rendered_shell_file(tmp_path: Path, example: str, cluster: str) -> None:
    _need_shellcheck()
    spec = load_spec(EXAMPLES / f"{example}.yaml")
    if cluster == "k8s" and spec.k8s.image is None:
        # A local example names no image or PVC (k8s refuses it so); the scripts of
        # its launcher on Kubernetes are still checked, with both filled in.
        data = spec.to_yaml_dict()
        data["k8s"].update(image="registry.example/shardctl:1", pvc="runs")
        spec = parse_spec(data)
    files = render_artifacts(spec, cluster)  # a renderer missing from the install fails here
    folder = write_files(files, tmp_path / "r")
    shells = _shell_files(folder)
    assert any(p.name == "launch.sh" for p in shells)
    done = run_shellcheck(shells)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize(("launcher", "backend"), CASES)
@pytest.mark.parametrize("cluster", ["local", "slurm", "k8s"])
def test_shellcheck_hostile_renderings(
    tmp_path: Path, launcher: str, backend: str, cluster: str
) -> None:
    _need_shellcheck()
    spec = _hostile_spec(launcher, backend)
    folder = tmp_path / "r"
    folder.mkdir()
    (folder / "launch.sh").write_text(get_cluster(cluster).launch_script(spec, "job.yaml"))
    (folder / "env.sh").write_text(get_cluster(cluster).env_file(spec))
    # SC2016/SC1003 are notes that a single-quoted '$(...)' or '\\' will not be
    # expanded — exactly the point of quoting user values; everything else counts.
    done = run_shellcheck([folder / "launch.sh", folder / "env.sh"], exclude=INTENDED_NOTES)
    assert done.returncode == 0, done.stdout + done.stderr


def test_render_dir_discovery_survives_a_symlinked_cwd(tmp_path: Path) -> None:
    """launch.sh finds its folder from its own path, not from where it is started."""
    spec = variant()
    folder = write_files(render_artifacts(spec, "local"), tmp_path / "real")
    link = tmp_path / "link"
    os.symlink(folder, link)
    record = tmp_path / "record.jsonl"
    done = run_script(link / "launch.sh", stub_launchers(tmp_path / "bin", record), cwd="/")
    assert done.returncode == 0, done.stderr
    assert read_records(record)[0]["argv"][-1] == f"{link}/job.yaml"

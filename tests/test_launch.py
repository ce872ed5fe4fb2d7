"""Launch rendering: launcher words, per-node env, runtime variables, real launchers.

The runtime-variable tests execute the rendered bash: the Slurm env must keep
`${SLURM_NODEID}` unexpanded in the file and turn into node rank 1 on the node
whose SLURM_NODEID is 1 (the classic bug renders it at submit time: every node 0).
The slow tests start the real torchrun / accelerate / deepspeed launchers with
the rendered scripts and a probe module in place of the trainer.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.render_util import (
    LAUNCH_WRAPPER,
    ROOT,
    run_script,
    stub_launchers,
    variant,
    write_files,
)
from shardctl.orchestrator.clusters import get_cluster, render_artifacts
from shardctl.orchestrator.errors import SpecError, UsageError
from shardctl.orchestrator.launch import (
    RUNTIME_VARS,
    hostfile,
    launch_argv,
)
from shardctl.orchestrator.spec import load_spec

SPEC = "job.yaml"


# ------------------------------------------------------------------ argv


def test_torchrun_one_node_is_standalone() -> None:
    assert launch_argv(variant(), SPEC) == [
        "torchrun", "--standalone", "--nnodes", "1",
        "--nproc-per-node", "${SHARDCTL_NPROC_PER_NODE}",
        "-m", "shardctl.train", SPEC,
    ]  # fmt: skip


def test_torchrun_multi_node_uses_c10d_rendezvous_on_runtime_vars() -> None:
    spec = load_spec(ROOT / "examples" / "slurm-2node.yaml")
    assert launch_argv(spec, SPEC) == [
        "torchrun", "--nnodes", "${SHARDCTL_NNODES}",
        "--nproc-per-node", "${SHARDCTL_NPROC_PER_NODE}",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", "${MASTER_ADDR}:${MASTER_PORT}",
        "--rdzv-id", "slurm-2node",
        "-m", "shardctl.train", SPEC,
    ]  # fmt: skip


def test_torchrun_elastic_passes_max_restarts() -> None:
    spec = variant({"k8s": {"elastic": {"min_nodes": 1, "max_nodes": 3, "max_restarts": 5}}})
    argv = launch_argv(spec, SPEC)
    assert "--standalone" not in argv
    assert argv[argv.index("--max-restarts") + 1] == "5"
    assert argv[argv.index("--nnodes") + 1] == "${SHARDCTL_NNODES}"


@pytest.mark.parametrize("backend", ["fsdp", "deepspeed"])
def test_accelerate_passes_per_node_values_as_flags(backend: str) -> None:
    spec = variant({"launcher": "accelerate", "strategy": {"backend": backend}})
    extra = (
        ["--deepspeed_config_file", "${SHARDCTL_RENDER_DIR}/ds_config.json"]
        if backend == "deepspeed"
        else []
    )
    assert launch_argv(spec, SPEC) == [
        "accelerate", "launch", "--config_file", "${SHARDCTL_RENDER_DIR}/accelerate_config.yaml",
        *extra,
        "--machine_rank", "${SHARDCTL_NODE_RANK}",
        "--main_process_ip", "${MASTER_ADDR}", "--main_process_port", "${MASTER_PORT}",
        "-m", "shardctl.train", SPEC,
    ]  # fmt: skip


def test_deepspeed_launcher_uses_hostfile_without_ssh() -> None:
    spec = variant({"launcher": "deepspeed", "strategy": {"backend": "deepspeed"}})
    assert launch_argv(spec, SPEC) == [
        "deepspeed", "--hostfile", "${SHARDCTL_RENDER_DIR}/hostfile", "--no_ssh",
        "--node_rank", "${SHARDCTL_NODE_RANK}",
        "--master_addr", "${MASTER_ADDR}", "--master_port", "${MASTER_PORT}",
        "--no_local_rank", "--module", "shardctl.train", SPEC,
    ]  # fmt: skip


def test_hostfile_has_one_line_per_node() -> None:
    spec = variant(
        {
            "launcher": "deepspeed",
            "strategy": {"backend": "deepspeed"},
            "resources": {"nodes": 3, "procs_per_node": 4, "device": "cuda"},
        }
    )
    lines = [ln for ln in hostfile(spec).splitlines() if ln and not ln.startswith("#")]
    assert lines == ["node-0 slots=4", "node-1 slots=4", "node-2 slots=4"]


def test_every_launcher_refers_to_runtime_vars_only_by_name() -> None:
    for launcher, backend in [
        ("torchrun", "fsdp"), ("accelerate", "fsdp"), ("deepspeed", "deepspeed")
    ]:  # fmt: skip
        spec = variant(
            {"launcher": launcher, "strategy": {"backend": backend}, "resources": {"nodes": 1}}
        )
        words = " ".join(launch_argv(spec, SPEC))
        assert "127.0.0.1" not in words and "29500" not in words
        assert any(f"${{{v}}}" in words for v in RUNTIME_VARS)


def test_unknown_cluster_is_refused() -> None:
    with pytest.raises(UsageError, match="accepted: local, slurm, k8s"):
        get_cluster("aws").launch_script(variant(), SPEC)


# -------------------------------------------------------------- env file


def _env_after_sourcing(text: str, env: dict[str, str], tmp_path: Path) -> dict[str, str]:
    """Source an env file in a clean bash and read back every runtime variable."""
    path = tmp_path / "env.sh"
    path.write_text(text)
    names = " ".join((*RUNTIME_VARS, "OMP_NUM_THREADS"))
    code = (
        f'set -euo pipefail; source "$1"; '
        f'for v in {names}; do printf "%s=%s\\n" "$v" "${{!v}}"; done'
    )
    base = {"PATH": os.environ["PATH"], "SHARDCTL_PYTHON": sys.executable}
    done = subprocess.run(
        ["bash", "-c", code, "bash", str(path)],
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return dict(line.split("=", 1) for line in done.stdout.splitlines())


def test_local_env_is_literal(tmp_path: Path) -> None:
    spec = variant({"local": {"master_port": 29611}, "resources": {"cpus_per_proc": 3}})
    got = _env_after_sourcing(get_cluster("local").env_file(spec), {}, tmp_path)
    assert got == {
        "SHARDCTL_NNODES": "1", "SHARDCTL_NODE_RANK": "0", "SHARDCTL_NPROC_PER_NODE": "2",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29611", "OMP_NUM_THREADS": "3",
    }  # fmt: skip


def test_local_node_rank_can_be_preset_to_emulate_another_node(tmp_path: Path) -> None:
    spec = load_spec(ROOT / "examples" / "slurm-2node.yaml")
    got = _env_after_sourcing(
        get_cluster("local").env_file(spec), {"SHARDCTL_NODE_RANK": "1"}, tmp_path
    )
    assert got["SHARDCTL_NODE_RANK"] == "1" and got["SHARDCTL_NNODES"] == "2"


def _scontrol_on_path(tmp_path: Path, path: str) -> dict[str, str]:
    """`path` (which may hold stub launchers) with Slurm's scontrol on it: a stand-in that
    expands a comma list when Slurm is absent. Prepends to `path`, never replaces it, so
    the stubs stay what runs."""
    if shutil.which("scontrol"):
        return {"PATH": path}
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "scontrol"
    fake.write_text('#!/usr/bin/env bash\n[ "$1 $2" = "show hostnames" ] && tr , "\\n" <<<"$3"\n')
    fake.chmod(0o755)
    return {"PATH": f"{bin_dir}{os.pathsep}{path}"}


def test_slurm_env_keeps_slurm_variables_until_the_node_runs_it(tmp_path: Path) -> None:
    spec = load_spec(ROOT / "examples" / "slurm-2node.yaml")
    text = get_cluster("slurm").env_file(spec)
    # Unexpanded in the file: the node's own shell fills them in.
    assert 'SHARDCTL_NODE_RANK="${SLURM_NODEID:?' in text
    assert 'SHARDCTL_NNODES="${SLURM_JOB_NUM_NODES:?' in text
    assert '"${SLURM_JOB_NODELIST:?' in text
    nodes = "nodea,nodeb"
    slurm = {
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_JOB_NODELIST": nodes,
        **_scontrol_on_path(tmp_path, os.environ["PATH"]),
    }
    for node_id in ("0", "1"):
        got = _env_after_sourcing(text, {**slurm, "SLURM_NODEID": node_id}, tmp_path)
        assert got["SHARDCTL_NODE_RANK"] == node_id
        assert got["SHARDCTL_NNODES"] == "2"
        assert got["MASTER_ADDR"] == "nodea"
        assert got["MASTER_PORT"] == "29511"


def test_slurm_env_expands_a_real_hostlist(tmp_path: Path) -> None:
    if not shutil.which("scontrol"):
        pytest.skip("Slurm's scontrol is not installed (apt-get install slurm-client)")
    spec = load_spec(ROOT / "examples" / "slurm-2node.yaml")
    got = _env_after_sourcing(
        get_cluster("slurm").env_file(spec),
        {"SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_NODEID": "1"},
        tmp_path,
    )
    assert got["MASTER_ADDR"] == "gpu07" and got["SHARDCTL_NODE_RANK"] == "1"


def test_slurm_launch_script_gives_node_rank_one_on_node_one(tmp_path: Path) -> None:
    spec = load_spec(ROOT / "examples" / "slurm-2node.yaml")
    out = write_files({"launch.sh": get_cluster("slurm").launch_script(spec, SPEC)}, tmp_path / "r")
    record = tmp_path / "record.jsonl"
    env = stub_launchers(tmp_path / "stubs", record)
    env.update(_scontrol_on_path(tmp_path, env["PATH"]))
    env.update({"SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "nodea,nodeb"})
    for node_id in ("1", "0"):
        done = run_script(out / "launch.sh", {**env, "SLURM_NODEID": node_id})
        assert done.returncode == 0, done.stderr
    ranks = [r["env"]["SHARDCTL_NODE_RANK"] for r in json_lines(record)]
    assert ranks == ["1", "0"]


def json_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_slurm_script_outside_an_allocation_says_why(tmp_path: Path) -> None:
    spec = load_spec(ROOT / "examples" / "slurm-2node.yaml")
    out = write_files({"launch.sh": get_cluster("slurm").launch_script(spec, SPEC)}, tmp_path / "r")
    env = stub_launchers(tmp_path / "stubs", tmp_path / "record.jsonl")
    done = run_script(out / "launch.sh", env)
    assert done.returncode != 0
    assert "SLURM_JOB_NUM_NODES" in done.stderr and "Slurm allocation" in done.stderr
    assert not (tmp_path / "record.jsonl").exists()  # the launcher never started


def test_k8s_env_reads_the_operator_variables(tmp_path: Path) -> None:
    spec = load_spec(ROOT / "examples" / "k8s.yaml")
    pet = {
        "PET_NNODES": "2", "PET_NODE_RANK": "1", "PET_NPROC_PER_NODE": "2",
        "MASTER_ADDR": "k8s-tiny-master-0", "MASTER_PORT": "23456",
    }  # fmt: skip
    got = _env_after_sourcing(get_cluster("k8s").env_file(spec), pet, tmp_path)
    assert got["SHARDCTL_NODE_RANK"] == "1" and got["SHARDCTL_NNODES"] == "2"
    assert got["MASTER_ADDR"] == "k8s-tiny-master-0" and got["MASTER_PORT"] == "23456"


def test_user_env_comes_after_defaults_and_before_runtime_vars() -> None:
    spec = variant({"env": {"NCCL_DEBUG": "INFO"}})
    text = get_cluster("local").env_file(spec)
    assert text.index("OMP_NUM_THREADS") < text.index("NCCL_DEBUG=INFO")
    # The runtime values are set last, so nothing before them can shadow them ...
    assert text.index("NCCL_DEBUG=INFO") < text.index("SHARDCTL_NODE_RANK")
    # ... and the spec refuses them as user env in the first place.
    with pytest.raises(SpecError, match="SHARDCTL_NODE_RANK is set by the launcher"):
        variant({"env": {"SHARDCTL_NODE_RANK": "7"}})


def test_nccl_settings_only_on_cuda() -> None:
    assert "NCCL" not in get_cluster("local").env_file(variant())
    cuda = get_cluster("local").env_file(variant({"resources": {"device": "cuda"}}))
    assert "export TORCH_NCCL_ASYNC_ERROR_HANDLING=1" in cuda


def test_launch_script_shape() -> None:
    text = get_cluster("local").launch_script(variant(), SPEC)
    lines = text.splitlines()
    assert lines[0] == "#!/usr/bin/env bash"
    assert "set -euo pipefail" in lines
    assert text.rstrip().splitlines()[-1].endswith('"${SHARDCTL_RENDER_DIR}"/job.yaml')
    # The watchdog's words only when no node agent offered to watch (a hand run).
    first = 'exec "$@" \\\n    ' + LAUNCH_WRAPPER + "torchrun "
    assert text.count(first) == 1 and text.endswith("\n")
    assert text.count('set -- "${SHARDCTL_PYTHON:-python3}" -m shardctl.train.watchdog --') == 1


# ----------------------------------------------------- real launchers (slow)

LAUNCHER_CASES = [
    ("torchrun", "fsdp"),
    ("accelerate", "fsdp"),
    ("accelerate", "deepspeed"),
    ("deepspeed", "deepspeed"),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _probe_env(probe_out: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PET_"))}
    env.pop("SHARDCTL_NODE_RANK", None)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    env["PYTHONPATH"] = str(ROOT / "tests" / "helpers")
    env["PROBE_OUT"] = str(probe_out)
    return env


def _render_probe(spec, out: Path) -> Path:
    files = render_artifacts(spec, "local")
    files["launch.sh"] = get_cluster("local").launch_script(spec, SPEC, module="rank_probe")
    return write_files(files, out)


def _start(
    script: Path, env: dict[str, str], log: Path, cwd: Path | None = None
) -> subprocess.Popen:
    with log.open("w") as fh:
        return subprocess.Popen(
            ["bash", str(script)], env=env, stdout=fh, stderr=subprocess.STDOUT,
            start_new_session=True, cwd=cwd,
        )  # fmt: skip


def _wait(procs: list[subprocess.Popen], logs: list[Path], timeout: float = 240) -> None:
    try:
        for proc, log in zip(procs, logs, strict=True):
            assert proc.wait(timeout=timeout) == 0, log.read_text()[-4000:]
    finally:
        for proc in procs:
            if proc.poll() is None:  # kill only what this test started, by its group
                os.killpg(proc.pid, 9)
                proc.wait()


def _records(probe_out: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(probe_out.glob("rank-*.json"))]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("launcher", "backend"), LAUNCHER_CASES)
def test_real_launcher_starts_a_working_world(tmp_path: Path, launcher: str, backend: str) -> None:
    spec = variant(
        {
            "launcher": launcher,
            "strategy": {"backend": backend},
            "local": {"master_port": _free_port()},
        }
    )
    out = _render_probe(spec, tmp_path / "rendered dir")  # a space in the path, on purpose
    probe_out = tmp_path / "probe"
    probe_out.mkdir()
    log = tmp_path / "launch.log"
    _wait([_start(out / "launch.sh", _probe_env(probe_out), log)], [log])
    records = _records(probe_out)
    assert [r["rank"] for r in records] == [0, 1]
    for r in records:
        assert r["world_size"] == 2 and r["sum_of_ranks"] == 1.0
        assert r["argv"] == [str(out / "job.yaml")]
        assert r["env"]["OMP_NUM_THREADS"] == "1"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_nodes_rendezvous_on_one_host(tmp_path: Path) -> None:
    """The 2-node example, both nodes started here with SHARDCTL_NODE_RANK preset."""
    spec = variant({"local": {"master_port": _free_port()}}, example="slurm-2node")
    out = _render_probe(spec, tmp_path / "r")
    probe_out = tmp_path / "probe"
    probe_out.mkdir()
    procs, logs = [], []
    for node in ("1", "0"):
        logs.append(tmp_path / f"node{node}.log")
        env = {**_probe_env(probe_out), "SHARDCTL_NODE_RANK": node}
        procs.append(_start(out / "launch.sh", env, logs[-1]))
    _wait(procs, logs)
    records = _records(probe_out)
    assert [r["rank"] for r in records] == [0, 1, 2, 3]
    assert all(r["world_size"] == 4 and r["sum_of_ranks"] == 6.0 for r in records)
    assert sorted(r["env"]["SHARDCTL_NODE_RANK"] for r in records) == ["0", "0", "1", "1"]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("example", ["deepspeed-zero3", "slurm-2node"])
def test_example_trains_from_its_rendered_launch_script(tmp_path: Path, example: str) -> None:
    """The example as it is, started by its rendered launch.sh with the real trainer;
    only shorter (4 steps, a checkpoint every 2, not 20 and 10): what is tested is
    the launch, and every step past the first checkpoint adds time, not coverage.

    slurm-2node runs as two "nodes" on this host (SHARDCTL_NODE_RANK preset on one),
    through the same c10d rendezvous the Slurm nodes use.
    """
    shorter = {"train": {"steps": 4}, "checkpoint": {"every_steps": 2}}
    spec = variant({"local": {"master_port": _free_port()}, **shorter}, example=example)
    out = write_files(render_artifacts(spec, "local"), tmp_path / "rendered")
    env = _probe_env(tmp_path)
    env.pop("PYTHONPATH")
    procs, logs = [], []
    for node in reversed(range(spec.resources.nodes)):
        logs.append(tmp_path / f"node{node}.log")
        node_env = {**env, "SHARDCTL_NODE_RANK": str(node)}
        procs.append(_start(out / "launch.sh", node_env, logs[-1], cwd=tmp_path))
    _wait(procs, logs, timeout=540)
    run_dir = tmp_path / spec.run_dir
    assert (run_dir / "DONE").is_file()
    steps = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert steps == ["step-00000002", "step-00000004"]

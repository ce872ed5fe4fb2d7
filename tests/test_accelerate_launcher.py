"""What runs under `launcher: accelerate` is what `validate` said (issue 31, item 6).

On CPU, a DeepSpeed spec runs as DeepSpeed on every rank (accelerate drops DeepSpeed
for DDP when ACCELERATE_USE_CPU is set, and counts one process when it finds no
backend); a script's FSDP, which accelerate 1.x runs as DDP on CPU, is refused before
anything starts; `precision: auto` means the same in every rendered launcher config
and `validate` says what it becomes. The slow tests run the real `accelerate launch`
on 2 CPU ranks through `shardctl submit`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers.train_run import free_port, tiny_spec
from shardctl.orchestrator.launch import backend_env, precision_words
from shardctl.orchestrator.render import launcher_files
from shardctl.orchestrator.spec import JobSpec, parse_spec

ROOT = Path(__file__).resolve().parent.parent
CODE = ROOT / "tests" / "data" / "usercode"
SHARDCTL = str(Path(sys.executable).parent / "shardctl")
DS2 = {"backend": "deepspeed", "zero_stage": 2}


def _script_spec(launcher: str, strategy: dict[str, Any], device: str = "cpu") -> JobSpec:
    return parse_spec(
        {
            "name": "s",
            "resources": {"procs_per_node": 2, "device": device},
            "launcher": launcher,
            "strategy": strategy,
            "entrypoint": {"script": str(CODE / "train.py")},
        }
    )


def _shardctl(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [SHARDCTL, *args], capture_output=True, text=True, timeout=240, cwd=cwd,
        start_new_session=True,
    )  # fmt: skip


# ------------------------------------------------------------- DeepSpeed on CPU


def test_a_deepspeed_job_under_accelerate_on_cpu_does_not_export_accelerate_use_cpu() -> None:
    # With ACCELERATE_USE_CPU=true accelerate 1.x drops DeepSpeed and wraps DDP.
    env = backend_env(_script_spec("accelerate", DS2))
    assert "ACCELERATE_USE_CPU" not in env and env["DS_ACCELERATOR"] == "cpu"


def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    """`code` in a fresh interpreter whose environment has no launcher variables."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "DS_"))}
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        clean.pop(name, None)
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
        env={**clean, **env},
    )  # fmt: skip


def test_outside_a_deepspeed_cpu_rank_of_accelerate_the_hook_imports_nothing() -> None:
    # entry.py runs before every script: it stays torch-free there.
    code = (
        "import sys\nfrom shardctl.train import accelerate_cpu\naccelerate_cpu.install()\n"
        "print(sorted(m for m in ('torch', 'accelerate') if m in sys.modules))"
    )
    for env in ({}, {"ACCELERATE_USE_DEEPSPEED": "true", "DS_ACCELERATOR": "cuda"}):
        res = _python(code, **env)
        assert res.returncode == 0 and res.stdout.strip() == "[]", res.stderr


def test_a_scripts_cpu_true_under_a_deepspeed_config_is_said() -> None:
    """accelerate drops DeepSpeed for `cpu=True` whatever shardctl does: rank 0 says so."""
    code = (
        "from shardctl.train import accelerate_cpu\naccelerate_cpu.install()\n"
        "from accelerate.state import PartialState\nPartialState(cpu=True)\n"
    )
    res = _python(code, ACCELERATE_USE_DEEPSPEED="true", DS_ACCELERATOR="cpu")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "Accelerator(cpu=True)" in res.stderr and "drop DeepSpeed" in res.stderr


@pytest.mark.slow
def test_an_accelerator_script_on_deepspeed_zero2_runs_deepspeed_on_2_cpu_ranks(
    tmp_path: Path,
) -> None:
    """An unmodified `Accelerator()` script: DeepSpeed engines, a 2-rank data split,
    and a DeepSpeed `save_state` (one ZeRO optimizer file per rank)."""
    saved = tmp_path / "acc-ds" / "state"
    spec = tmp_path / "acc-ds.yaml"
    data = {
        "name": "acc-ds",
        "run_dir": str(tmp_path / "acc-ds"),
        "resources": {"procs_per_node": 2, "device": "cpu"},
        "launcher": "accelerate",
        "strategy": {**DS2, "precision": "bf16-mixed"},
        "entrypoint": {"script": str(CODE / "accelerate_deepspeed.py"), "args": [str(saved)]},
        "local": {"master_port": free_port()},
        "restart": {"max_in_allocation": 0},
    }
    spec.write_text(yaml.safe_dump(data, sort_keys=False))
    said = _shardctl("validate", str(spec), cwd=tmp_path)
    assert said.returncode == 0 and "accelerate → deepspeed" in said.stdout, said.stderr
    res = _shardctl("submit", str(spec), "--wait", cwd=tmp_path)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    ranks = [json.loads(line[6:]) for line in res.stdout.splitlines() if line.startswith("ACCEL ")]
    assert sorted(r["process_index"] for r in ranks) == [0, 1], out[-4000:]
    for rank in ranks:
        assert rank["distributed_type"] == "DEEPSPEED" and rank["model"] == "DeepSpeedEngine"
        # 32 samples, batches of 4, split between the 2 ranks: 4 batches each.
        assert (rank["num_processes"], rank["batches"]) == (2, 4)
    assert (saved / "latest").read_text().strip() == "pytorch_model"
    optim = sorted(p.name for p in (saved / "pytorch_model").glob("*_optim_states.pt"))
    assert optim == [
        "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
    ]
    assert sorted(p.name for p in saved.glob("random_states_*.pkl")) == [
        "random_states_0.pkl",
        "random_states_1.pkl",
    ]
    # The shared-memory op stays switched off, as in the built-in loop's backend.
    assert "shm_comm" not in out


@pytest.mark.slow
def test_the_builtin_loop_under_accelerate_saves_a_deepspeed_checkpoint_on_cpu(
    tmp_path: Path,
) -> None:
    spec = tiny_spec(
        tmp_path, "loop-ds", launcher="accelerate", strategy={**DS2, "sharding": None},
        train={"steps": 2}, checkpoint={"every_steps": 2},
    )  # fmt: skip
    res = _shardctl("submit", str(spec), "--wait", cwd=tmp_path)
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    step = tmp_path / "loop-ds" / "checkpoints" / "step-00000002"
    manifest = json.loads((step / "manifest.json").read_text())
    assert (manifest["backend"], manifest["world_size"]) == ("deepspeed", 2)
    optim = sorted(p.name for p in step.rglob("*_optim_states.pt"))
    assert [name.split("_mp_rank")[0][-len("zero_pp_rank_0") :] for name in optim] == [
        "zero_pp_rank_0",
        "zero_pp_rank_1",
    ]


# ------------------------------------------------------------------ FSDP on CPU

REFUSED = {
    "name": "acc-fsdp",
    "resources": {"procs_per_node": 2, "device": "cpu"},
    "launcher": "accelerate",
    "strategy": {"backend": "fsdp"},
    "entrypoint": {"script": str(CODE / "train.py")},
}


@pytest.mark.parametrize("command", ["validate", "submit"])
def test_a_scripts_fsdp_under_accelerate_on_cpu_is_refused_before_anything_starts(
    tmp_path: Path, command: str
) -> None:
    spec = tmp_path / "acc-fsdp.yaml"
    spec.write_text(yaml.safe_dump({**REFUSED, "run_dir": str(tmp_path / "run")}))
    res = _shardctl(command, str(spec), cwd=tmp_path)
    assert res.returncode == 2, res.stdout + res.stderr
    lines = [line for line in res.stderr.splitlines() if "launcher 'accelerate'" in line]
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    line = lines[0]
    for named in ("strategy.backend 'fsdp'", "resources.device 'cpu'", "as DDP"):
        assert named in line
    for instead in ("launcher: torchrun", "strategy.backend: deepspeed", "resources.device: cuda"):
        assert instead in line
    assert not (tmp_path / "run").exists()


def test_what_accelerate_runs_as_fsdp_is_accepted() -> None:
    # On a GPU, accelerate's FSDP plugin is real; the built-in loop shards with FSDP2
    # itself whatever the launcher, so on CPU too.
    assert _script_spec("accelerate", {"backend": "fsdp"}, "cuda").launcher == "accelerate"
    loop = parse_spec({**yaml.safe_load((ROOT / "examples" / "tiny-llama.yaml").read_text()),
                       "launcher": "accelerate"})  # fmt: skip
    assert (loop.strategy.backend, loop.resources.device) == ("fsdp", "cpu")


# ------------------------------------------------------------- precision: auto

# What a script is handed for `auto`, written out: fp32 on CPU (a CPU's bf16 is known
# only on the node), bf16-mixed on CUDA.
AUTO_HANDED = {"cpu": "fp32", "cuda": "bf16-mixed"}
SCRIPT_LAUNCHES = [
    ("torchrun", DS2),
    ("accelerate", DS2),
    ("deepspeed", DS2),
    ("accelerate", {"backend": "fsdp"}),  # cuda only: refused on cpu
]


def _handed_precision(files: dict[str, str]) -> str:
    """The precision a script reads from the launcher files it is handed."""
    accelerate = None
    if "accelerate_config.yaml" in files:
        accelerate = yaml.safe_load(files["accelerate_config.yaml"])
    if "ds_config.json" in files:
        ds = json.loads(files["ds_config.json"])
        # Beside a DeepSpeed config file accelerate takes precision from it alone.
        assert accelerate is None or "mixed_precision" not in accelerate
        if ds.get("bf16", {}).get("enabled"):
            return "bf16-mixed"
        return "fp16-mixed" if ds.get("fp16", {}).get("enabled") else "fp32"
    assert accelerate is not None
    return {"bf16": "bf16-mixed", "fp16": "fp16-mixed", "no": "fp32"}[accelerate["mixed_precision"]]


@pytest.mark.parametrize("device", sorted(AUTO_HANDED))
def test_precision_auto_is_the_same_in_every_launchers_files_and_validate_says_it(
    device: str,
) -> None:
    expected = AUTO_HANDED[device]
    for launcher, strategy in SCRIPT_LAUNCHES:
        if device == "cpu" and strategy["backend"] == "fsdp":
            continue
        spec = _script_spec(launcher, {**strategy, "precision": "auto"}, device)
        assert _handed_precision(launcher_files(spec)) == expected, (launcher, strategy)
        assert f"precision auto → {expected} in the rendered" in precision_words(spec)


def test_the_builtin_loop_decides_auto_on_the_node_under_every_launcher() -> None:
    base = yaml.safe_load((ROOT / "examples" / "tiny-llama.yaml").read_text())
    said = set()
    for launcher in ("torchrun", "accelerate", "deepspeed"):
        data = {**base, "launcher": launcher, "strategy": {**DS2, "precision": "auto"}}
        said.add(precision_words(parse_spec(data)))
    assert said == {
        "precision auto (decided on the node: bf16-mixed on a CPU with avx512_bf16/amx_bf16, "
        "else fp32)"
    }

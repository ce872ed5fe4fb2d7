"""Shared pieces of the rendering tests: spec variants, stub launchers, shellcheck."""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml
from shardctl.orchestrator.spec import JobSpec, parse_spec

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
LAUNCHERS = ("torchrun", "accelerate", "deepspeed")
# The line of launch.sh before torchrun's and accelerate's: they run in-process under
# shardctl's launch wrapper (shardctl.orchestrator.launch_wrapper), deepspeed does not.
LAUNCH_WRAPPER = '"${SHARDCTL_PYTHON:-python3}" -m shardctl.orchestrator.launch_wrapper \\\n    '
# What the stub launchers record from their environment besides argv.
RECORDED_ENV = (
    "SHARDCTL_NNODES", "SHARDCTL_NODE_RANK", "SHARDCTL_NPROC_PER_NODE", "MASTER_ADDR",
    "MASTER_PORT", "OMP_NUM_THREADS", "SHARDCTL_RENDER_DIR", "DS_ACCELERATOR",
)  # fmt: skip


def example_data(name: str = "tiny-llama") -> dict[str, Any]:
    return yaml.safe_load((EXAMPLES / f"{name}.yaml").read_text())


def merge(base: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in patch.items():
        if value is None:  # None removes the key
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def variant(patch: dict[str, Any] | None = None, example: str = "tiny-llama") -> JobSpec:
    """An example spec with `patch` deep-merged into it (a None value removes that key)."""
    return parse_spec(merge(example_data(example), patch or {}))


def write_files(files: dict[str, str], out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        (out / name).write_text(content, encoding="utf-8")
        if name.endswith(".sh"):
            (out / name).chmod(0o755)
    return out


def stub_launchers(bin_dir: Path, record: Path) -> dict[str, str]:
    """Put torchrun/accelerate/deepspeed stubs on a PATH folder; each appends
    {"prog", "argv", "env"} as one JSON line to `record`. Returns an env for bash."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    script = (
        f"#!{sys.executable}\n"
        "import json, os, sys\n"
        f"keys = {list(RECORDED_ENV)!r} + os.environ.get('STUB_EXTRA_ENV', '').split()\n"
        "entry = {'prog': os.path.basename(sys.argv[0]), 'argv': sys.argv[1:],\n"
        "         'env': {k: os.environ.get(k) for k in keys if k}}\n"
        f"with open({str(record)!r}, 'a', encoding='utf-8') as f:\n"
        "    f.write(json.dumps(entry) + '\\n')\n"
    )
    for name in LAUNCHERS:
        path = bin_dir / name
        path.write_text(script)
        path.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PET_"))}
    env.pop("SHARDCTL_NODE_RANK", None)
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("SHARDCTL_PYTHON", sys.executable)  # the node watchdog's interpreter
    return env


def read_records(record: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in record.read_text(encoding="utf-8").splitlines()]


def run_script(
    script: Path, env: dict[str, str], cwd: Path | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(script)],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def shellcheck() -> str | None:
    return shutil.which("shellcheck")


def run_shellcheck(
    paths: list[Path], exclude: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    """shellcheck every file with all optional checks on (severity: style and up)."""
    exe = shellcheck()
    assert exe is not None
    skip = [f"--exclude={','.join(exclude)}"] if exclude else []
    return subprocess.run(
        [exe, "--shell=bash", "--enable=all", "--format=gcc", *skip, *map(str, paths)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )

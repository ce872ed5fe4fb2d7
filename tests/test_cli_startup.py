"""CLI start-up stays light: no torch, deepspeed, kubernetes, submitit, transformers or boto3.

Each command runs in a fresh interpreter through the real click entry point; at
exit the process writes the names of every module it imported, and the test
checks none of the heavy packages is among them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
HEAVY = ("torch", "deepspeed", "kubernetes", "submitit", "transformers", "accelerate", "boto3",
         "botocore")  # fmt: skip

HARNESS = """
import atexit, importlib, json, os, sys

def dump():
    with open(os.environ["SHARDCTL_MODULES_OUT"], "w") as f:
        json.dump(sorted(sys.modules), f)

atexit.register(dump)
for name in filter(None, os.environ.get("SHARDCTL_PRELOAD", "").split(",")):
    importlib.import_module(name)
from shardctl.orchestrator.cli import main
sys.argv = ["shardctl", *sys.argv[1:]]
main()
"""

COMMANDS = {
    "help": ["--help"],
    "version": ["--version"],
    "render-help": ["render", "--help"],
    "validate": ["validate", str(EXAMPLES / "tiny-llama.yaml")],
    "validate-json": ["validate", str(EXAMPLES / "deepspeed-zero3.yaml"), "--output", "json"],
    "render-local": [
        "render",
        str(EXAMPLES / "tiny-llama.yaml"),
        "--cluster",
        "local",
        "--out",
        "{tmp}/local",
    ],
    "render-deepspeed": [
        "render",
        str(EXAMPLES / "deepspeed-zero3.yaml"),
        "--cluster",
        "local",
        "--out",
        "{tmp}/ds",
    ],
    "render-slurm": [
        "render",
        str(EXAMPLES / "slurm-2node.yaml"),
        "--cluster",
        "slurm",
        "--out",
        "{tmp}/slurm",
    ],
    "render-k8s": ["render", str(EXAMPLES / "k8s.yaml"), "--cluster", "k8s", "--out", "{tmp}/k8s"],
    "convert": ["convert", str(EXAMPLES / "tiny-llama.yaml"), "--to", "deepspeed"],
    "init": ["init", "{tmp}/job.yaml"],
    "submit-dry-run-local": ["submit", str(EXAMPLES / "tiny-llama.yaml"), "--dry-run"],
    "submit-dry-run-slurm": [
        "submit",
        str(EXAMPLES / "slurm-2node.yaml"),
        "--cluster",
        "slurm",
        "--dry-run",
    ],
    "submit-dry-run-k8s": ["submit", str(EXAMPLES / "k8s.yaml"), "--cluster", "k8s", "--dry-run"],
}


def run_cli(tmp_path: Path, args: list[str], preload: str = "") -> tuple[int, str, list[str]]:
    harness = tmp_path / "harness.py"
    harness.write_text(HARNESS, encoding="utf-8")
    out = tmp_path / "modules.json"
    env = {**os.environ, "SHARDCTL_MODULES_OUT": str(out), "SHARDCTL_PRELOAD": preload}
    proc = subprocess.run(
        [sys.executable, str(harness), *[a.format(tmp=tmp_path) for a in args]],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=tmp_path,
    )
    return proc.returncode, proc.stderr, json.loads(out.read_text())


def heavy_in(modules: list[str]) -> list[str]:
    return sorted({m.split(".")[0] for m in modules} & set(HEAVY))


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_command_imports_no_heavy_package(tmp_path: Path, command: str):
    rc, stderr, modules = run_cli(tmp_path, COMMANDS[command])
    assert rc == 0, stderr
    assert "shardctl.orchestrator.cli" in modules  # the harness really ran the CLI
    assert heavy_in(modules) == [], f"`shardctl {' '.join(COMMANDS[command])}` imported them"


CLUSTERS = "shardctl.orchestrator.clusters"


@pytest.mark.parametrize(
    ("command", "backends"),
    # validate runs submit's checks of the cluster asked for (local by default).
    [("validate", {"local"}), ("render-local", {"local"}), ("render-slurm", {"slurm"})],
)
def test_a_command_loads_only_the_cluster_asked_for(
    tmp_path: Path, command: str, backends: set[str]
):
    """Every spec holds every built-in cluster's section, but a section loads without
    its cluster's backend: only the cluster asked for is imported."""
    rc, stderr, modules = run_cli(tmp_path, COMMANDS[command])
    assert rc == 0, stderr
    assert {f"{CLUSTERS}.{n}.section" for n in ("local", "slurm", "k8s")} <= set(modules)
    loaded = {n for n in ("local", "slurm", "k8s") if f"{CLUSTERS}.{n}" in modules}
    assert loaded == backends


def test_the_check_sees_a_heavy_import(tmp_path: Path):
    """The same harness, with submitit imported first, must report it."""
    rc, stderr, modules = run_cli(tmp_path, ["--version"], preload="submitit")
    assert rc == 0, stderr
    assert heavy_in(modules) == ["submitit"]


def test_python_importtime_agrees_for_render(tmp_path: Path):
    """`python -X importtime` lists every import of a real `shardctl render` too."""
    proc = subprocess.run(
        [
            sys.executable,
            "-X",
            "importtime",
            "-m",
            "shardctl.orchestrator.cli",
            "render",
            str(EXAMPLES / "tiny-llama.yaml"),
            "--cluster",
            "local",
            "--out",
            str(tmp_path / "o"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    imported = {
        line.split("|")[-1].strip().split(".")[0]
        for line in proc.stderr.splitlines()
        if line.startswith("import time:") and "|" in line
    }
    assert "shardctl" in imported and "click" in imported
    assert imported.isdisjoint(HEAVY), sorted(imported & set(HEAVY))

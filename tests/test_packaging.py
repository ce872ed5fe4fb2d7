"""What `pip install shardctl` puts in site-packages: every package, the Helm chart and
the manifests, and the paths the hints print point there (not into a checkout)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # Built from a clean copy of the checkout's files: a stale egg-info or build/ folder
    # in the checkout would otherwise fill in what the configuration forgot.
    source = tmp_path_factory.mktemp("source")
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True,
        check=True, timeout=60,
    ).stdout.decode().split("\0")  # fmt: skip
    for rel in filter(None, listed):
        if (ROOT / rel).is_file():
            (source / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, source / rel)
    base = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(source)]
    # The venv's own setuptools when it has one; otherwise pip fetches the build backend.
    done = subprocess.run([*base, "--no-build-isolation"], capture_output=True, timeout=300)
    if done.returncode != 0:
        done = subprocess.run(base, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr
    (path,) = out.glob("shardctl-*.whl")
    return path


def test_every_package_and_the_kubernetes_files_are_in_the_wheel(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    for top in ("orchestrator", "train"):
        for init in (ROOT / top).rglob("__init__.py"):
            rel = init.relative_to(ROOT).as_posix()
            assert f"shardctl/{rel}" in names, f"{rel} is missing from the wheel"
    chart = ROOT / "helm" / "shardctl-job"
    for path in chart.rglob("*"):
        if path.is_file():
            rel = path.relative_to(ROOT).as_posix()
            assert f"shardctl/{rel}" in names, f"{rel} is missing from the wheel"
    for path in (ROOT / "manifests").glob("*.yaml"):
        assert f"shardctl/manifests/{path.name}" in names


def test_hints_point_at_the_installed_copy(wheel: Path, tmp_path: Path) -> None:
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    # -S: no site-packages, so the checkout's editable install cannot answer instead.
    code = (
        "import sys\n"
        f"sys.path.insert(0, {str(site)!r})\n"
        "from shardctl.orchestrator import assets\n"
        "print(assets.chart_dir())\n"
        "print(assets.manifest('rbac.yaml'))\n"
    )
    done = subprocess.run(
        [sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    chart, rbac = (Path(line) for line in done.stdout.splitlines())
    assert chart == site / "shardctl" / "helm" / "shardctl-job"
    assert (chart / "Chart.yaml").is_file() and (chart / "templates" / "trainjob.yaml").is_file()
    assert rbac == site / "shardctl" / "manifests" / "rbac.yaml" and rbac.is_file()

"""What the pods need from the image, read from the project itself: shared by the
Containerfile lint and the real-image tests."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

from shardctl.orchestrator.clusters.k8s import objects as k8s_objects
from shardctl.orchestrator.spec import load_spec

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Expect:
    """What the pods need from the image, read from the project itself."""

    uid: int
    workdir: str
    home: str
    cache: str
    package_dirs: tuple[str, ...]
    readme: str
    license: str


def expectations() -> Expect:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    spec = load_spec(ROOT / "examples" / "k8s.yaml")
    setuptools_cfg = pyproject.get("tool", {}).get("setuptools", {})
    return Expect(
        uid=spec.k8s.run_as_user,
        workdir=k8s_objects.RUNS_MOUNT,
        home=k8s_objects.CACHE_ENV["HOME"],
        cache=k8s_objects.CACHE_ENV["XDG_CACHE_HOME"],
        package_dirs=tuple(sorted(set(setuptools_cfg.get("package-dir", {}).values()))),
        readme=str(pyproject["project"].get("readme", "README.md")),
        license=str(pyproject["project"].get("license", "")),
    )

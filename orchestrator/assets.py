"""Where the files shardctl ships beside its code are, in this installation.

The Helm chart (`helm/shardctl-job`) and the plain manifests (`manifests/`) are
package data: a `pip install` puts them inside the package, an editable install
finds them in the checkout. The hints shardctl prints name these paths, so they
work wherever shardctl was installed from.
"""

from __future__ import annotations

from importlib.util import find_spec
from pathlib import Path

CHART_NAME = "shardctl-job"


def _package_dir(package: str) -> Path:
    # Data-only folders are namespace packages (no __init__.py): their location is
    # the first search location of the import system's spec, installed or editable.
    spec = find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"{package} is missing from this installation of shardctl")
    return Path(next(iter(spec.submodule_search_locations)))


def chart_dir() -> Path:
    """The Helm chart `shardctl-job` of this installation."""
    return _package_dir("shardctl.helm") / CHART_NAME


def manifests_dir() -> Path:
    """The plain-kubectl manifests (namespace, RBAC, PVC, an example job)."""
    return _package_dir("shardctl.manifests")


def manifest(name: str) -> Path:
    return manifests_dir() / name


def shipped_paths() -> dict[str, str]:
    """{chart, manifests}: for the `next_step` hints of the clusters."""
    return {"chart": str(chart_dir()), "manifests": str(manifests_dir())}

"""One object per Kubernetes job API: the import rules of clusters/k8s/ (DESIGN.md) and
what every kind answers the same way."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest
from shardctl.orchestrator.clusters.base import JobState
from shardctl.orchestrator.clusters.k8s import apis, objects
from shardctl.orchestrator.clusters.k8s.pytorchjob import PYTORCHJOB
from shardctl.orchestrator.clusters.k8s.trainjob import TRAINJOB
from shardctl.orchestrator.spec import load_spec

PACKAGE = Path(objects.__file__).parent
ROOT = Path(__file__).resolve().parents[1]


def sibling_imports(path: Path) -> list[tuple[str, bool]]:
    """(sibling module, imported inside a function?) per `from .x import` / `from . import x`."""
    tree = ast.parse(path.read_text())
    inner = {
        id(node)
        for fn in ast.walk(tree)
        if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef)
        for node in ast.walk(fn)
    }
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            names = [node.module] if node.module else [a.name for a in node.names]
            found += [(name.split(".")[0], id(node) in inner) for name in names]
    return found


def test_the_kinds_never_import_each_other_and_nothing_dodges_a_cycle() -> None:
    graph = {p.stem: sibling_imports(p) for p in PACKAGE.glob("*.py")}
    assert not [(m, i) for m, imps in graph.items() for i, inside in imps if inside]
    edges = {m: {i for i, _ in imps} for m, imps in graph.items()}
    assert "trainjob" not in edges["pytorchjob"] and "pytorchjob" not in edges["trainjob"]
    assert edges["pods"] == set() and edges["jobkind"] == set()

    def reach(start: str, seen: set[str]) -> set[str]:
        for nxt in edges.get(start, set()) - seen:
            seen.add(nxt)
            reach(nxt, seen)
        return seen

    assert [m for m in edges if m in reach(m, set())] == []  # no cycle at import time


def test_job_kind_picks_by_api_and_old_records_are_pytorchjobs() -> None:
    assert apis.job_kind("trainjob") is TRAINJOB
    assert apis.job_kind("pytorchjob") is PYTORCHJOB
    assert apis.job_kind(None) is PYTORCHJOB  # a record from before TrainJobs


@pytest.mark.parametrize("example", ["k8s", "k8s-trainjob"])
def test_each_example_renders_its_own_kind(example: str) -> None:
    spec = load_spec(ROOT / "examples" / f"{example}.yaml")
    kind = apis.job_kind(spec.k8s.api)
    rendered = objects.render(spec)
    assert set(rendered.objects) == {"configmap", kind.api}
    assert rendered.job["kind"] == kind.kind
    assert rendered.job["apiVersion"] == f"{kind.group}/{kind.version}"
    assert f"{kind.api}.yaml" in rendered.files
    # The rendered job reads back through its own kind: procs per node, a fresh state.
    assert kind.procs_per_node(rendered.job) == spec.resources.procs_per_node
    assert kind.state_of(rendered.job).state is JobState.PENDING


def pod(labels: dict[str, str], name: str = "p", **annotations: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": labels, "annotations": annotations}}


def test_each_kind_finds_the_node_of_its_own_pods_only() -> None:
    master = pod({"training.kubeflow.org/replica-type": "Master",
                  "training.kubeflow.org/replica-index": "0"}, "m")  # fmt: skip
    worker = pod({"training.kubeflow.org/replica-type": "Worker",
                  "training.kubeflow.org/replica-index": "1"}, "w")  # fmt: skip
    assert [PYTORCHJOB.node(p) for p in (master, worker)] == [0, 2]
    assert PYTORCHJOB.role(worker) == "Worker 1"
    indexed = pod({"jobset.sigs.k8s.io/replicatedjob-name": "node",
                   "batch.kubernetes.io/job-completion-index": "3"})  # fmt: skip
    annotated = pod({}, **{"batch.kubernetes.io/job-completion-index": "2"})
    assert [TRAINJOB.node(p) for p in (indexed, annotated)] == [3, 2]
    assert TRAINJOB.role(indexed) == "node 3"
    # Neither reads the other API's labels as its own.
    assert TRAINJOB.node(worker) is None and PYTORCHJOB.node(indexed) is None

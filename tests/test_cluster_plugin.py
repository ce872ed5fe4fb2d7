"""A cluster that lives outside shardctl's repository, installed for real.

tests/data/example_cluster is a small distribution (`shardctl-batchq`) whose entry
point in the group `shardctl.clusters` names its `Cluster` subclass; pip installs it
into a folder of its own (`--target`), and every command below runs in a fresh
interpreter with that folder on PYTHONPATH, as an installed plugin would be found.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from shardctl.orchestrator import clusters
from shardctl.orchestrator.errors import UsageError
from shardctl.orchestrator.spec import load_spec, parse_spec

ROOT = Path(__file__).resolve().parent.parent
PLUGIN = ROOT / "tests" / "data" / "example_cluster"
EXAMPLES = ROOT / "examples"

SPEC = {
    "name": "bq-tiny",
    "resources": {"nodes": 2, "procs_per_node": 1},
    "train": {
        "model": {"llama": {"vocab_size": 256, "hidden_size": 64, "num_attention_heads": 4}},
        "data": {"builtin": "python-stdlib"},
        "steps": 10,
    },
    "checkpoint": {"every_steps": 5},
    "batchq": {"queue": "gpu"},
}


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The plugin installed by pip into a folder of its own (the source copied first:
    setuptools builds in the source tree)."""
    tmp = tmp_path_factory.mktemp("plugin")
    source, target = tmp / "src", tmp / "site"
    shutil.copytree(PLUGIN, source)
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-input",
         "--disable-pip-version-check", "--target", str(target), str(source)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, f"pip could not install the example plugin:\n{done.stderr}"
    points = (target / "shardctl_batchq-0.1.0.dist-info" / "entry_points.txt").read_text()
    assert "[shardctl.clusters]" in points
    return target


def shardctl(
    site: Path | None, cwd: Path, *args: str, spec: dict | None = None
) -> subprocess.CompletedProcess[str]:
    if spec is not None:
        (cwd / "job.yaml").write_text(yaml.safe_dump(spec), encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if site is not None:
        env["PYTHONPATH"] = str(site)
    return subprocess.run(
        [sys.executable, "-m", "shardctl.orchestrator.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
        env=env,
    )


def with_batchq(**section: object) -> dict:
    return {**SPEC, "batchq": section}


def test_validate_reads_the_plugin_section(site: Path, tmp_path: Path) -> None:
    out = shardctl(site, tmp_path, "validate", "job.yaml", "-o", "json", spec=SPEC)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["batchq"] == {"queue": "gpu", "priority": 5, "max_nodes": 4}


def test_the_plugin_section_gets_the_usual_error_text(site: Path, tmp_path: Path) -> None:
    out = shardctl(site, tmp_path, "validate", "job.yaml", spec=with_batchq(quuee="gpu"))
    assert out.returncode == 2
    assert (
        "unknown key 'batchq.quuee' in batchq; did you mean 'queue'? "
        "(accepted: max_nodes, priority, queue)"
    ) in out.stderr
    out = shardctl(site, tmp_path, "validate", "job.yaml", spec=with_batchq(queue="GPU"))
    assert out.returncode == 2
    assert "batchq.queue: 'GPU' is not a queue name; accepted: lower-case words" in out.stderr
    out = shardctl(site, tmp_path, "validate", "job.yaml", spec=with_batchq(priority=10))
    assert out.returncode == 2
    assert "batchq.priority: 10 is more than 9, the most shardctl accepts" in out.stderr
    # Its check across sections runs with every validation, in the spec's own words.
    too_many = {**with_batchq(queue="gpu", max_nodes=1)}
    out = shardctl(site, tmp_path, "validate", "job.yaml", spec=too_many)
    assert out.returncode == 2
    assert "resources.nodes (2) is more than batchq.max_nodes (1)" in out.stderr


def test_render_and_dry_run_through_the_plugin(site: Path, tmp_path: Path) -> None:
    out = shardctl(site, tmp_path, "render", "job.yaml", "--cluster", "batchq", "--out", "r",
                   spec=SPEC)  # fmt: skip
    assert out.returncode == 0, out.stderr
    files = sorted(p.name for p in (tmp_path / "r").iterdir() if not p.name.startswith("."))
    assert files == ["batchq.sh", "env.sh", "job.yaml", "launch.sh"]
    script = (tmp_path / "r" / "batchq.sh").read_text()
    assert "#BQ queue=gpu priority=5 nodes=2\n" in script
    assert 'SHARDCTL_NODE_RANK="${BQ_NODE_INDEX:?' in (tmp_path / "r" / "env.sh").read_text()
    assert yaml.safe_load((tmp_path / "r" / "job.yaml").read_text())["batchq"]["queue"] == "gpu"
    assert "submit it by hand: bq submit" in out.stdout
    # What the nodes read is a spec the plugin reads back.
    again = shardctl(site, tmp_path, "validate", "r/job.yaml")
    assert again.returncode == 0, again.stderr

    dry = shardctl(site, tmp_path, "submit", "job.yaml", "--cluster", "batchq", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert dry.stdout == "# bq submit batchq.sh\n" + script


def test_what_the_plugin_needs_to_run_is_checked_when_rendering_for_it(
    site: Path, tmp_path: Path
) -> None:
    no_queue = with_batchq()
    assert shardctl(site, tmp_path, "validate", "job.yaml", spec=no_queue).returncode == 0
    local = shardctl(site, tmp_path, "render", "job.yaml", "--out", "l")
    assert local.returncode == 0, local.stderr
    out = shardctl(site, tmp_path, "render", "job.yaml", "--cluster", "batchq", "--out", "r")
    assert out.returncode == 2
    assert "batchq.queue is required for --cluster batchq; e.g. batchq.queue: gpu" in out.stderr
    # A spec without the section renders for the plugin with the section's defaults.
    bare = {k: v for k, v in SPEC.items() if k != "batchq"}
    out = shardctl(site, tmp_path, "render", "job.yaml", "--cluster", "batchq", "--out", "r",
                   spec=bare)  # fmt: skip
    assert out.returncode == 2
    assert "batchq.queue is required" in out.stderr


def test_doctor_asks_the_plugin(site: Path, tmp_path: Path) -> None:
    out = shardctl(site, tmp_path, "doctor", "job.yaml", "--cluster", "batchq", "-o", "json",
                   spec=SPEC)  # fmt: skip
    assert out.returncode == 0, out.stderr
    checks = {c["name"]: c for c in json.loads(out.stdout)["checks"]}
    assert checks["queue"]["status"] == "ok"
    assert checks["preemption budget"]["detail"] == "batchq never preempts"
    assert "$BQ_NODE_INDEX" in checks["node rank"]["detail"]


def test_submit_status_and_ls_reach_the_plugin(site: Path, tmp_path: Path) -> None:
    """The example queue submits nothing and knows no job: `submit` says so in the
    plugin's own words, leaves no record and no run dir; a job recorded for it is
    listed by `ls` and asked about by `status`, which get the plugin's answer."""
    from shardctl.orchestrator.clusters.base import JobRef
    from shardctl.orchestrator.clusters.records import jobs_dir, remember

    out = shardctl(site, tmp_path, "submit", "job.yaml", "--cluster", "batchq", spec=SPEC)
    assert (out.returncode, out.stderr) == (2, "error: batchq is an example: it submits nothing\n")
    assert not (tmp_path / "runs").exists()  # nothing rendered for a job that never ran
    assert list(jobs_dir().glob("*.json")) == []
    listed = shardctl(site, tmp_path, "ls", "-o", "json")
    assert (listed.returncode, json.loads(listed.stdout)["jobs"]) == (0, [])

    remember(JobRef("batchq", "bq-17", "bq-tiny", str(tmp_path / "runs" / "bq-tiny")))
    listed = shardctl(site, tmp_path, "ls", "-o", "json")
    assert listed.returncode == 0, listed.stderr
    [row] = json.loads(listed.stdout)["jobs"]
    assert (row["name"], row["cluster"], row["job_id"], row["state"], row["stale"]) == (
        "bq-tiny", "batchq", "bq-17", "?", True,
    )  # fmt: skip
    # The plugin was loaded for the record and asked: the answer is its own.
    assert row["why_stale"] == "cluster batchq did not answer: batchq is an example: it has no jobs"
    table = shardctl(site, tmp_path, "ls")
    assert table.returncode == 0, table.stderr
    [line] = [ln for ln in table.stdout.splitlines() if ln.startswith("bq-tiny ")]
    assert line.split()[:4] == ["bq-tiny", "batchq", "bq-17", "?*"]
    assert "* bq-tiny: cluster batchq did not answer: batchq is an example" in table.stdout
    status = shardctl(site, tmp_path, "status", "bq-tiny")
    assert (status.returncode, status.stderr) == (
        2,
        "error: batchq is an example: it has no jobs\n",
    )
    # Without the plugin installed, the record's cluster is named as unknown.
    listed = shardctl(None, tmp_path, "ls", "-o", "json")
    assert listed.returncode == 0, listed.stderr
    [row] = json.loads(listed.stdout)["jobs"]
    assert "--cluster 'batchq' is not a cluster" in row["why_stale"]


def test_without_the_plugin_its_section_and_name_are_unknown(tmp_path: Path) -> None:
    out = shardctl(None, tmp_path, "validate", "job.yaml", spec=SPEC)
    assert out.returncode == 2
    assert "unknown key 'batchq' in the top level" in out.stderr
    out = shardctl(None, tmp_path, "render", "job.yaml", "--cluster", "batchq")
    assert out.returncode == 2
    assert "'batchq' is not one of 'local', 'slurm', 'k8s'" in out.stderr


def test_entry_points_are_read_only_for_a_name_not_built_in(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Reading entry points scans every installed distribution: a spec of built-in
    sections and a built-in --cluster never do it."""
    asked: list[str] = []

    def entry_points(**kw: str) -> importlib.metadata.EntryPoints:
        asked.append(kw.get("group", ""))
        return importlib.metadata.EntryPoints(())

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)
    clusters._entry_points.cache_clear()
    try:
        load_spec(EXAMPLES / "slurm-2node.yaml", cluster="slurm")
        assert clusters.cluster_class("k8s").name == "k8s"
        assert asked == []
        with pytest.raises(UsageError, match=r"'aws' is not a cluster; accepted: local, slurm"):
            clusters.cluster_class("aws")
        assert asked == [clusters.ENTRY_POINT_GROUP]
        with pytest.raises(Exception, match=r"unknown key 'batchq' in the top level"):
            parse_spec(SPEC)
    finally:
        clusters._entry_points.cache_clear()


@pytest.mark.parametrize("name", clusters.CLUSTER_NAMES)
def test_a_builtin_section_is_its_cluster_class_s(name: str) -> None:
    """REGISTRY names a built-in's section beside its class (so that a spec is read
    without the backend); both must be the one class."""
    assert clusters.section_model(name) is clusters.cluster_class(name).spec_section

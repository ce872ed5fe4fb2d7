"""`submit` options: what --help says matches what each cluster supports."""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from helpers.render_util import EXAMPLES
from shardctl.orchestrator.cli import cli
from shardctl.orchestrator.clusters import CLUSTER_NAMES, cluster_class


def test_help_says_where_wait_and_replace_work() -> None:
    text = " ".join(CliRunner().invoke(cli, ["submit", "--help"]).output.split())
    waits = [n for n in CLUSTER_NAMES if cluster_class(n).can_follow]
    assert sorted(waits) == ["k8s", "local", "slurm"]
    assert "local: streams the logs" in text and "k8s: reports each state change" in text
    assert "slurm: streams every node's logs, through requeues" in text
    assert "k8s: delete a job of the same name" in text
    assert "Replace the live job of this run dir: cancel it (on any cluster)" in text


def test_wait_is_refused_where_it_cannot_work(tmp_path, monkeypatch) -> None:
    # Every built-in cluster follows; a cluster that cannot (a plugin's) is refused.
    monkeypatch.setattr(cluster_class("slurm"), "can_follow", False)
    spec = str(EXAMPLES / "slurm-2node.yaml")
    res = CliRunner().invoke(cli, ["submit", spec, "--cluster", "slurm", "--wait"])
    assert res.exit_code == 2 and "--wait works with --cluster local, slurm or k8s" in res.output


# Only --dry-run for submit: without the fix a real submit would start a run.
@pytest.mark.parametrize("args", [["submit", "--dry-run"], ["render"]], ids=["submit", "render"])
def test_a_bare_double_dash_is_refused_saying_what_it_expects(tmp_path, args) -> None:
    spec = str(EXAMPLES / "tiny-llama.yaml")
    out = ["--out", str(tmp_path / "r")] if args[0] == "render" else []
    res = CliRunner().invoke(cli, [args[0], spec, *args[1:], *out, "--"])
    assert res.exit_code == 2, res.output
    assert "nothing follows --" in res.output
    assert "a script and its arguments" in res.output and "-m MODULE" in res.output
    assert not (tmp_path / "r").exists()


def test_a_double_dash_inside_the_scripts_arguments_is_passed_on() -> None:
    spec = str(EXAMPLES / "tiny-llama.yaml")
    script = str(EXAMPLES / "fsdp2_script.py")
    res = CliRunner().invoke(cli, ["submit", spec, "--dry-run", "--", script, "--"])
    assert res.exit_code == 0, res.output
    assert "nothing follows --" not in res.output

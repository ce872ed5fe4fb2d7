"""`--set KEY.PATH=VALUE` on validate, render and submit: YAML-typed, validated like the
file, recorded in the rendered job.yaml; every bad assignment is a clear error."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner
from helpers.render_util import EXAMPLES
from shardctl.orchestrator.cli import cli
from shardctl.orchestrator.errors import SpecError
from shardctl.orchestrator.overrides import apply_overrides, parse_path
from shardctl.orchestrator.spec import load_spec


def run(*args: str) -> Any:
    return CliRunner().invoke(cli, list(args))


@pytest.mark.parametrize(
    ("path", "steps"),
    [
        ("train.lr", ["train", "lr"]),
        ("k8s.tolerations[0].key", ["k8s", "tolerations", 0, "key"]),
        ('k8s.labels["kueue.x-k8s.io/queue-name"]', ["k8s", "labels", "kueue.x-k8s.io/queue-name"]),
        ("k8s.labels['a.b/c']", ["k8s", "labels", "a.b/c"]),
        ("name", ["name"]),
    ],
)
def test_paths(path: str, steps: list[Any]) -> None:
    assert parse_path(path) == steps


@pytest.mark.parametrize("path", [".a", "a..b", "a.", "a[x]", "a b", "a.b[", "", "a\tb"])
def test_unreadable_paths_say_where(path: str) -> None:
    with pytest.raises(SpecError, match=r"cannot read the key path|the key path is empty"):
        parse_path(path)


def test_values_are_yaml_and_sections_are_created() -> None:
    data = {"train": {"lr": 1.0}, "k8s": {"tolerations": [{"key": "a"}]}}
    out = apply_overrides(
        data,
        [
            "train.lr=0.0003",
            "resources.nodes=2",
            "k8s.tolerations[0].key=gpu",
            "k8s.tolerations[1]={key: spot, operator: Exists}",
            'k8s.labels["kueue.x-k8s.io/queue-name"]=team-a',
            "k8s.pvc=",
            "env.NOTE=it's = fine",
        ],
    )
    assert out == {
        "train": {"lr": 0.0003},
        "resources": {"nodes": 2},
        "k8s": {
            "tolerations": [{"key": "gpu"}, {"key": "spot", "operator": "Exists"}],
            "labels": {"kueue.x-k8s.io/queue-name": "team-a"},
            "pvc": None,
        },
        "env": {"NOTE": "it's = fine"},
    }
    assert data == {"train": {"lr": 1.0}, "k8s": {"tolerations": [{"key": "a"}]}}  # untouched


@pytest.mark.parametrize(
    ("assignment", "message"),
    [
        ("noequals", "expected KEY.PATH=VALUE"),
        ("=3", "expected KEY.PATH=VALUE"),
        ("train.lr.x=1", "train.lr is 1.0 (float), not a mapping, so it has no key 'x'"),
        ("train[0]=1", "not a list; [0] indexes lists only"),
        ("k8s.tolerations[5]=x", "past the end of a list of 1 item(s)"),
        ("train.lr=[1,", "not valid YAML"),
    ],
)
def test_bad_assignments_are_clear_errors(assignment: str, message: str) -> None:
    with pytest.raises(SpecError) as err:
        apply_overrides({"train": {"lr": 1.0}, "k8s": {"tolerations": [{}]}}, [assignment])
    assert message in str(err.value)


def test_validated_like_the_file_with_the_source_named() -> None:
    spec = EXAMPLES / "tiny-llama.yaml"
    assert load_spec(spec, ["train.lr=0.0003"]).train.lr == 0.0003
    for assignment, message in [
        ("train.lrr=1", "unknown key 'train.lrr' in train; did you mean 'lr'?"),
        ("train.lr=1e30", "train.lr: '1e30' is more than 10.0"),
        ("resources.nodes=yes", "resources.nodes"),
        ("k8s.labels.bad key=x", "cannot read the key path"),
    ]:
        with pytest.raises(SpecError) as err:
            load_spec(spec, [assignment])
        assert message in str(err.value), err.value
        if "key path" not in message:
            assert f"with --set {assignment}" in str(err.value)


def test_cli_validate_render_submit_take_set(tmp_path: Path) -> None:
    spec = str(EXAMPLES / "tiny-llama.yaml")
    out = run("validate", spec, "--set", "resources.procs_per_node=1", "-o", "json")
    assert out.exit_code == 0, out.output
    assert yaml.safe_load(out.stdout)["resources"]["procs_per_node"] == 1
    # The rendered job.yaml records the result: what the ranks read is what was set.
    target = tmp_path / "r"
    out = run("render", spec, "--out", str(target), "--set", "train.lr=0.0005",
              "--set", "name=sweep-lr-5e-4")  # fmt: skip
    assert out.exit_code == 0, out.output
    rendered = yaml.safe_load((target / "job.yaml").read_text())
    assert rendered["train"]["lr"] == 0.0005 and rendered["name"] == "sweep-lr-5e-4"
    out = run("submit", str(EXAMPLES / "k8s.yaml"), "--cluster", "k8s", "--dry-run",
              "--set", "k8s.api=trainjob", "--set", "k8s.backoff_limit=6")  # fmt: skip
    assert out.exit_code == 0, out.output
    assert "kind: TrainJob" in out.stdout
    bad = run("validate", spec, "--set", "train.lrr=1")
    assert bad.exit_code == 2 and "did you mean 'lr'" in bad.stderr
    assert "Traceback" not in bad.output

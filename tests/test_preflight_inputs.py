"""Before any rank starts: the files and packages a run reads are checked where the
ranks read the spec's paths where this machine does (orchestrator/inputs.py).
`validate` and `submit` refuse the same spec with the same line; `doctor` reports it."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner
from helpers.render_util import example_data, merge
from shardctl.orchestrator.cli import cli
from shardctl.orchestrator.doctor import input_checks
from shardctl.orchestrator.spec import load_spec

NO_BUILTIN = {"builtin": None}
CASES: dict[str, tuple[dict[str, Any], str]] = {
    "corpus": (
        {"train": {"data": {**NO_BUILTIN, "text": "corpus.txt"}}},
        "train.data.text '{d}/corpus.txt' does not exist here; accepted: a text file",
    ),
    "tokens": (
        {"train": {"data": {**NO_BUILTIN, "tokens": "tokens.npy"}}},
        "train.data.tokens '{d}/tokens.npy' does not exist here",
    ),
    "pretrained": (
        {"train": {"model": {"llama": None, "pretrained": "base-model"}}},
        "train.model.pretrained '{d}/base-model' does not exist here",
    ),
    "resume": (
        {"checkpoint": {"resume": "old/step-00000010"}},
        "checkpoint.resume '{d}/old/step-00000010' does not exist here; accepted: 'auto', "
        "'never' or the path of a complete step-NNNNNNNN folder",
    ),
    "tensorboard-file": (
        {"logging": {"tensorboard_dir": "job.yaml"}},
        "logging.tensorboard_dir '{d}/job.yaml' is a file; accepted: a folder",
    ),
    "run-dir-file": (
        {"run_dir": "job.yaml"},
        "run_dir '{d}/job.yaml' cannot be a folder here (it is a file); accepted: a folder, "
        "or a path "
        "where one can be made",
    ),
    "tracker": (
        {"logging": {"backends": ["wandb"]}},
        "logging.backends 'wandb' needs the Python package 'wandb', which is not installed; "
        "install it with: pip install 'shardctl[wandb]'",
    ),
    "script": (
        {"train": None, "entrypoint": {"script": "nope.py"}},
        "entrypoint.script '{d}/nope.py' is not a Python file; accepted: a Python file that "
        "exists here",
    ),
}


def _spec(folder: Path, patch: dict[str, Any]) -> Path:
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump(merge(example_data(), patch)))
    return path


@pytest.fixture
def no_wandb(monkeypatch: pytest.MonkeyPatch) -> None:
    # As in an environment without the extra: find_spec answers None for it.
    monkeypatch.setitem(sys.modules, "wandb", None)


@pytest.mark.parametrize("case", sorted(CASES))
def test_validate_and_submit_refuse_alike_and_start_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_wandb: None, case: str
) -> None:
    patch, expected = CASES[case]
    path = _spec(tmp_path, patch)
    monkeypatch.chdir("/")  # the relative paths are the spec folder's, not the cwd's
    expected = expected.format(d=tmp_path.resolve())
    lines = {}
    for command in (["validate"], ["submit"], ["submit", "--dry-run"]):
        result = CliRunner().invoke(cli, [*command, str(path)])
        assert result.exit_code == 2, (command, result.output)
        assert len(result.stderr.splitlines()) == 1, result.stderr
        assert expected in result.stderr, result.stderr
        lines[" ".join(command)] = result.stderr
    assert len(set(lines.values())) == 1, lines
    assert not (tmp_path / "runs").exists()  # no run dir, so no rank started


def test_a_file_above_the_run_dir_is_named(tmp_path: Path) -> None:
    (tmp_path / "runs").write_text("not a folder")
    path = _spec(tmp_path, {"run_dir": "runs/job"})
    result = CliRunner().invoke(cli, ["submit", str(path)])
    assert result.exit_code == 2 and "Traceback" not in result.output
    d = tmp_path.resolve()
    assert result.stderr.strip().endswith(
        f"run_dir '{d}/runs/job' cannot be a folder here ('{d}/runs' is a file); accepted: a "
        "folder, or a path where one can be made (a relative path is taken from the spec "
        "file's folder)"
    ), result.stderr
    assert (tmp_path / "runs").read_text() == "not a folder"


def test_a_factory_that_does_not_import_is_refused_at_submit_only(tmp_path: Path) -> None:
    patch = {"train": {"model": {"llama": None, "factory": "shardctl_no_such_pkg.m:build"}}}
    path = _spec(tmp_path, patch)
    # Cheap commands never import the user's code (start-up stays torch-free).
    assert CliRunner().invoke(cli, ["validate", str(path)]).exit_code == 0
    result = CliRunner().invoke(cli, ["submit", str(path)])
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines() == [
        f"error: {path}: invalid job spec: train.model.factory "
        "'shardctl_no_such_pkg.m:build': cannot import module 'shardctl_no_such_pkg.m' "
        "(ModuleNotFoundError: No module named 'shardctl_no_such_pkg'); accepted: "
        "'package.module:function' importable on every node (installed, or on PYTHONPATH)"
    ]
    assert not (tmp_path / "runs").exists()


def test_a_factory_that_imports_passes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "mymodels.py").write_text("def build(spec):\n    return None\n")
    (tmp_path / "nofn.py").write_text("x = 1\n")
    monkeypatch.chdir(tmp_path)  # ranks import from their working directory
    from shardctl.orchestrator.inputs import import_problems

    good = load_spec(
        _spec(tmp_path, {"train": {"model": {"llama": None, "factory": "mymodels:build"}}})
    )
    assert import_problems(good) == []
    bad = load_spec(_spec(tmp_path, {"train": {"model": {"llama": None, "factory": "nofn:build"}}}))
    assert import_problems(bad) == [
        "train.model.factory 'nofn:build': module 'nofn' has no function 'build'; accepted: "
        "'package.module:function' importable on every node (installed, or on PYTHONPATH)"
    ]


def test_pods_read_their_own_paths_so_k8s_checks_none_here(tmp_path: Path) -> None:
    patch = merge(CASES["corpus"][0], {"k8s": {"image": "registry.example/shardctl:1"}})
    path = _spec(tmp_path, patch)
    result = CliRunner().invoke(cli, ["validate", str(path), "--cluster", "k8s"])
    assert result.exit_code == 0, result.output
    assert input_checks(load_spec(path, cluster="k8s"), "k8s") == []


@pytest.mark.parametrize("cluster", ["local", "slurm"])
def test_doctor_reports_the_same_lines(tmp_path: Path, no_wandb: None, cluster: str) -> None:
    patch = merge(CASES["corpus"][0], CASES["tracker"][0])
    spec = load_spec(_spec(tmp_path, patch), cluster=cluster)
    failed = [c.detail for c in input_checks(spec, cluster) if c.status == "fail"]
    from shardctl.orchestrator.inputs import input_problems

    assert failed == input_problems(spec) and len(failed) == 2


def test_doctor_cli_fails_on_a_missing_corpus(tmp_path: Path) -> None:
    path = _spec(tmp_path, CASES["corpus"][0])
    result = CliRunner().invoke(cli, ["doctor", str(path)])
    assert result.exit_code == 1, result.output
    assert "FAIL  input files: train.data.text" in result.stdout

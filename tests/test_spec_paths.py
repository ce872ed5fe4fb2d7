"""A spec's relative paths are the spec file's, as docker compose reads a compose file:
the same spec submitted from two directories is the same run (spec/paths.py)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner
from helpers.render_util import example_data, merge
from shardctl.orchestrator.cli import cli
from shardctl.orchestrator.clusters import render_artifacts
from shardctl.orchestrator.spec import JobSpec, load_spec, parse_spec

# Every relative path a spec can hold, by what it is for.
LLAMA_PATHS = {
    "run_dir": "out/run",
    "checkpoint": {"dir": "scratch/ckpt", "resume": "old/step-00000010"},
    "train": {"data": {"builtin": None, "text": "data/corpus.txt"}},
    "logging": {"tensorboard_dir": "tb"},
}
PRETRAINED = {"train": {"model": {"llama": None, "pretrained": "models/base"}}}
TOKENS = {"train": {"data": {"builtin": None, "tokens": "data/tokens.npy"}}}
SCRIPT = {
    "train": None,
    "entrypoint": {"script": "code/train.py", "code_dir": "code"},
    "checkpoint": {"every_steps": 1},
}


def _write(folder: Path, patch: dict[str, Any]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump(merge(example_data(), patch)))
    return path


def _paths(spec: JobSpec) -> dict[str, str | None]:
    t, ep = spec.train, spec.entrypoint
    return {
        "run_dir": spec.run_dir,
        "checkpoint.dir": spec.checkpoint_dir,
        "checkpoint.resume": spec.checkpoint.resume,
        "logging.tensorboard_dir": spec.logging.tensorboard_dir,
        "train.data.text": t.data.text if t else None,
        "train.data.tokens": t.data.tokens if t else None,
        "train.model.pretrained": t.model.pretrained if t else None,
        "entrypoint.script": ep.script if ep else None,
        "entrypoint.code_dir": ep.code_dir if ep else None,
    }


@pytest.mark.parametrize("patch", [LLAMA_PATHS, PRETRAINED, TOKENS, SCRIPT], ids=str)
def test_relative_paths_are_taken_from_the_spec_file_s_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, patch: dict[str, Any]
) -> None:
    spec_dir = (tmp_path / "project").resolve()
    path = _write(spec_dir, patch)
    seen = []
    for cwd in (tmp_path, spec_dir, Path("/")):
        monkeypatch.chdir(cwd)
        seen.append(_paths(load_spec(path)))
    assert seen[0] == seen[1] == seen[2]
    # Each path as written (a spec built in code), then joined to the spec's folder.
    written = _paths(parse_spec(merge(example_data(), patch)))
    for field, value in written.items():
        if value is not None and value != "auto":
            assert seen[0][field] == os.path.normpath(spec_dir / value), field


def test_the_default_run_dir_is_beside_the_spec(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _write(tmp_path / "project", {})
    monkeypatch.chdir(tmp_path)
    spec = load_spec(path)
    assert spec.run_dir == str((tmp_path / "project" / "runs" / "tiny-llama").resolve())
    assert spec.checkpoint_dir == spec.run_dir + "/checkpoints"


def test_submit_dry_run_is_the_same_run_from_any_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _write(tmp_path / "project", {})
    texts = []
    for cwd in (tmp_path, tmp_path / "project"):
        monkeypatch.chdir(cwd)
        result = CliRunner().invoke(cli, ["submit", str(path), "--dry-run"])
        assert result.exit_code == 0, result.output
        texts.append(result.stdout)
    assert texts[0] == texts[1]
    assert str((tmp_path / "project" / "runs" / "tiny-llama").resolve()) in texts[0]


def test_paths_given_with_set_are_taken_from_the_current_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _write(tmp_path / "project", LLAMA_PATHS)
    here = tmp_path / "elsewhere"
    here.mkdir()
    monkeypatch.chdir(here)
    spec = load_spec(path, ["run_dir=mine", "train.data={text: my.txt}"])
    assert spec.run_dir == str(here / "mine")
    assert spec.train is not None and spec.train.data.text == str(here / "my.txt")
    # What the file says and --set did not touch stays the file's.
    project = (tmp_path / "project").resolve()
    assert spec.checkpoint_dir == str(project / "scratch" / "ckpt")
    assert spec.logging.tensorboard_dir == str(project / "tb")


def test_a_spec_built_in_code_keeps_its_paths_as_written() -> None:
    spec = parse_spec(merge(example_data(), LLAMA_PATHS))
    assert spec.run_dir == "out/run" and spec.logging.tensorboard_dir == "tb"


def test_kubernetes_pods_read_the_rank_paths_as_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Inside a pod a relative corpus is the pod's (its working dir is the run volume):
    # the submitting machine's folders mean nothing there.
    patch = merge(LLAMA_PATHS, {"k8s": {"image": "registry.example/shardctl:1", "pvc": "runs"}})
    path = _write(tmp_path / "project", patch)
    monkeypatch.chdir(tmp_path)
    spec = load_spec(path, cluster="k8s")
    assert spec.train is not None and spec.train.data.text == "data/corpus.txt"
    configmap = yaml.safe_load(render_artifacts(spec, "k8s")["configmap.yaml"])
    inside = yaml.safe_load(configmap["data"]["job.yaml"])
    assert inside["train"]["data"]["text"] == "data/corpus.txt"
    assert inside["logging"]["tensorboard_dir"] == "tb"
    assert inside["checkpoint"]["resume"] == "old/step-00000010"
    assert inside["run_dir"] == "/shardctl/runs/tiny-llama"
    # The same file read for this machine takes them from its folder.
    local = load_spec(path)
    assert local.train is not None
    assert local.train.data.text == str((tmp_path / "project" / "data/corpus.txt").resolve())

"""render_artifacts and `shardctl render`: which files, their properties, the CLI."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from helpers.render_util import EXAMPLES, ROOT, variant
from shardctl.orchestrator import clusters
from shardctl.orchestrator.cli import cli
from shardctl.orchestrator.clusters import render_artifacts
from shardctl.orchestrator.clusters.writer import LEDGER
from shardctl.orchestrator.errors import RenderError, UsageError
from shardctl.orchestrator.spec import load_spec, read_job_yaml
from shardctl.orchestrator.templating import render_template

COMMON = {"job.yaml", "env.sh", "launch.sh"}


@pytest.mark.parametrize(
    ("launcher", "backend", "extra"),
    [
        ("torchrun", "fsdp", set()),
        ("torchrun", "deepspeed", {"ds_config.json"}),
        ("accelerate", "fsdp", {"accelerate_config.yaml"}),
        ("accelerate", "deepspeed", {"accelerate_config.yaml", "ds_config.json"}),
        ("deepspeed", "deepspeed", {"hostfile", "ds_config.json"}),
    ],
)
def test_files_follow_launcher_and_backend(launcher: str, backend: str, extra: set[str]) -> None:
    spec = variant({"launcher": launcher, "strategy": {"backend": backend}})
    assert set(render_artifacts(spec, "local")) == COMMON | extra


def test_job_yaml_loads_back_to_an_equal_spec(tmp_path: Path) -> None:
    for path in sorted(EXAMPLES.glob("*.yaml")):
        spec = load_spec(path)
        written = tmp_path / f"{path.stem}.yaml"
        written.write_text(render_artifacts(spec, "local")["job.yaml"])
        assert read_job_yaml(written) == spec, path.name


def test_launch_script_inlines_the_env_file() -> None:
    files = render_artifacts(variant(), "local")
    body = files["env.sh"].split("# Runtime values are")[1].split("\n", 1)[1]
    assert body.strip() and body in files["launch.sh"]


def test_cluster_artifacts_are_merged_in() -> None:
    spec = load_spec(EXAMPLES / "k8s.yaml")
    files = render_artifacts(spec, "k8s")
    assert set(files) >= COMMON and "pytorchjob.yaml" in files
    assert list(files) == sorted(files)


def test_k8s_node_files_are_the_ones_the_pods_get() -> None:
    """launch.sh and job.yaml of --cluster k8s are the ConfigMap's, byte for byte."""
    import yaml

    files = render_artifacts(load_spec(EXAMPLES / "k8s.yaml"), "k8s")
    data = yaml.safe_load(files["configmap.yaml"])["data"]
    assert data["launch.sh"] == files["launch.sh"]
    assert data["job.yaml"] == files["job.yaml"]


def test_missing_cluster_module_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    section = clusters.REGISTRY["slurm"].section  # a spec still reads its slurm: section
    monkeypatch.setitem(clusters.REGISTRY, "slurm", clusters.Builtin("no_such_mod:X", section))
    with pytest.raises(RenderError, match=r"cluster 'slurm' needs the module .*no_such_mod"):
        render_artifacts(variant(), "slurm")
    # Local rendering never needs it.
    assert set(render_artifacts(variant(), "local")) == COMMON


def test_unknown_cluster_names_the_accepted_ones() -> None:
    with pytest.raises(UsageError, match=r"'aws' is not a cluster; accepted: local, slurm, k8s"):
        render_artifacts(variant(), "aws")


def test_conflicting_cluster_artifact_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    slurm = clusters.cluster_class("slurm")
    monkeypatch.setattr(slurm, "own_artifacts", lambda self, node, common: {"env.sh": "x\n"})
    with pytest.raises(RenderError, match=r"env\.sh"):
        render_artifacts(variant(), "slurm")


def test_missing_template_variable_names_the_template() -> None:
    with pytest.raises(RenderError, match=r"template 'launch.sh.j2'.*undefined"):
        render_template("launch.sh.j2", job_name="x")
    with pytest.raises(RenderError, match=r"no-such\.j2"):
        render_template("no-such.j2")


def test_rendering_is_pure() -> None:
    spec = variant({"launcher": "accelerate", "strategy": {"backend": "deepspeed"}})
    assert render_artifacts(spec, "local") == render_artifacts(spec, "local")


# --------------------------------------------------------------------- CLI


def test_cli_writes_every_file_and_marks_scripts_executable(tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = CliRunner().invoke(
        cli,
        ["render", str(EXAMPLES / "deepspeed-zero3.yaml"), "--out", str(out)],
    )
    assert result.exit_code == 0, result.output
    expected = render_artifacts(load_spec(EXAMPLES / "deepspeed-zero3.yaml"), "local")
    assert sorted(p.name for p in out.iterdir() if p.name != LEDGER) == sorted(expected)
    for name, content in expected.items():
        assert (out / name).read_text() == content
        executable = bool((out / name).stat().st_mode & stat.S_IXUSR)
        assert executable is name.endswith(".sh"), name
        assert name in result.output
    assert "ds_config.json" in result.output and " B" in result.output


def test_cli_default_out_dir_is_in_the_run_dir(tmp_path: Path, monkeypatch) -> None:
    # The default run dir is beside the spec file, not in the current directory.
    (tmp_path / "specs").mkdir()
    shutil.copy(EXAMPLES / "k8s.yaml", tmp_path / "specs")
    monkeypatch.chdir(tmp_path)
    spec = tmp_path / "specs" / "k8s.yaml"
    result = CliRunner().invoke(cli, ["render", str(spec), "--cluster", "k8s"])
    assert result.exit_code == 0, result.output
    assert not (tmp_path / "runs").exists()
    out = tmp_path / "specs" / "runs" / "k8s-tiny" / "rendered" / "k8s"
    assert (out / "pytorchjob.yaml").is_file() and (out / "launch.sh").is_file()


def test_cli_names_files_left_from_an_earlier_render(tmp_path: Path) -> None:
    (tmp_path / "hostfile").write_text("old\n")
    result = CliRunner().invoke(
        cli, ["render", str(EXAMPLES / "tiny-llama.yaml"), "--out", str(tmp_path)]
    )
    assert result.exit_code == 0, result.output
    assert "not from this render: hostfile" in result.output
    assert (tmp_path / "hostfile").read_text() == "old\n"


def test_cli_json_output(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        cli, ["render", str(EXAMPLES / "tiny-llama.yaml"), "--out", str(tmp_path), "-o", "json"]
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["cluster"] == "local" and doc["name"] == "tiny-llama"
    sizes = {f["name"]: f["bytes"] for f in doc["files"]}
    assert sizes == {p.name: p.stat().st_size for p in tmp_path.iterdir() if p.name != LEDGER}
    assert doc["not_rendered_now"] == []


# ------------------------------------------------------ never overwrite the user's files


def test_render_into_the_specs_own_folder_keeps_the_users_job_yaml(tmp_path: Path) -> None:
    """`render job.yaml --out .` once replaced the user's commented spec with the rendered one."""
    spec = tmp_path / "job.yaml"
    original = "# my comments\n" + (EXAMPLES / "tiny-llama.yaml").read_text()
    spec.write_text(original)
    result = CliRunner().invoke(cli, ["render", str(spec), "--out", str(tmp_path)])
    assert result.exit_code == 2, result.output
    assert (
        f"not overwriting {spec}" in result.output and "shardctl did not write it" in result.output
    )
    assert spec.read_text() == original
    # Nothing else was written either: the refusal comes before the first byte.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.yaml"]


def test_rendering_again_replaces_only_what_shardctl_wrote(tmp_path: Path) -> None:
    out = tmp_path / "out"
    args = ["render", str(EXAMPLES / "tiny-llama.yaml"), "--out", str(out)]
    assert CliRunner().invoke(cli, args).exit_code == 0
    assert CliRunner().invoke(cli, args).exit_code == 0  # its own files: fine
    (out / "launch.sh").write_text("#!/bin/bash\n# edited by hand\n")
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2 and "launch.sh" in result.output
    assert (out / "launch.sh").read_text().endswith("# edited by hand\n")


def test_render_out_is_a_file(tmp_path: Path) -> None:
    target = tmp_path / "a-file"
    target.write_text("keep me\n")
    result = CliRunner().invoke(
        cli, ["render", str(EXAMPLES / "tiny-llama.yaml"), "--out", str(target)]
    )
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert target.read_text() == "keep me\n"


def test_render_writes_what_the_dry_run_holds(tmp_path: Path) -> None:
    """`shardctl render` = the dry run's artifacts (Slurm: absolute run dir, this Python)."""
    from shardctl.orchestrator.clusters import get_cluster

    spec = load_spec(EXAMPLES / "slurm-2node.yaml")
    out = tmp_path / "r"
    result = CliRunner().invoke(
        cli, ["render", str(EXAMPLES / "slurm-2node.yaml"), "--cluster", "slurm", "--out", str(out)]
    )
    assert result.exit_code == 0, result.output
    expected = get_cluster("slurm").dryrun(spec).artifacts
    assert {p.name: p.read_text() for p in out.iterdir() if p.name != LEDGER} == expected
    assert "sbatch " in result.output and "job.sbatch" in result.output


def test_cli_bad_spec_exits_2_without_traceback(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: Bad Name\ntrain: {}\n")
    result = CliRunner().invoke(cli, ["render", str(bad), "--out", str(tmp_path / "o")])
    assert result.exit_code == 2
    assert "name" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "o").exists()


def test_cli_out_is_a_file(tmp_path: Path) -> None:
    target = tmp_path / "file"
    target.write_text("")
    result = CliRunner().invoke(
        cli, ["render", str(EXAMPLES / "tiny-llama.yaml"), "--out", str(target / "sub")]
    )
    assert result.exit_code in (1, 2) and "error:" in result.output


def test_render_imports_no_heavy_packages(tmp_path: Path) -> None:
    """`shardctl render` (every cluster) never imports torch, deepspeed, kubernetes, submitit."""
    code = (
        "import sys\n"
        "from shardctl.orchestrator.cli import main\n"
        "cases = [('deepspeed-zero3', 'local'), ('deepspeed-zero3', 'slurm'), ('k8s', 'k8s'),\n"
        "         ('k8s-trainjob', 'k8s')]\n"
        "for example, cluster in cases:\n"
        "    try:\n"
        f"        sys.argv = ['shardctl', 'render', {str(EXAMPLES)!r} + f'/{{example}}.yaml',\n"
        f"                    '--cluster', cluster,\n"
        f"                    '--out', {str(tmp_path)!r} + '/' + example + cluster]\n"
        "        main()\n"
        "    except SystemExit as exc:\n"
        "        assert not exc.code, exc.code\n"
        "heavy = ('torch', 'deepspeed', 'kubernetes', 'submitit', 'transformers', 'accelerate')\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in heavy)\n"
        "print(heavy)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"

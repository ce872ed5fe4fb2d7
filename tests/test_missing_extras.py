"""An optional extra that is not installed, and a kubeconfig that cannot be read:
one line that says which extra to install or which file is wrong, never a traceback."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import click
import pytest
from click.testing import CliRunner
from helpers.render_util import EXAMPLES
from shardctl.orchestrator.cli import cli
from shardctl.orchestrator.cli.common import handle_errors


def _shardctl_without(package: str, args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """`shardctl ARGS` in a fresh interpreter where `package` cannot be imported (as in
    a virtual environment that has only the training extra)."""
    code = textwrap.dedent(
        f"""
        import sys
        sys.modules[{package!r}] = None  # import raises ModuleNotFoundError
        sys.argv = ["shardctl", *{args!r}]
        from shardctl.orchestrator.cli import main
        main()
        """
    )
    return subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("command", ["submit", "doctor"])
def test_cluster_k8s_without_the_kubernetes_package_names_the_extra(
    tmp_path: Path, command: str
) -> None:
    proc = _shardctl_without(
        "kubernetes", [command, str(EXAMPLES / "k8s.yaml"), "--cluster", "k8s"], tmp_path
    )
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: --cluster k8s needs the Python package 'kubernetes', which is not installed; "
        "install it with: pip install 'shardctl[k8s]'"
    )


def test_a_missing_optional_package_anywhere_under_a_command_names_its_extra() -> None:
    @click.command("probe")
    @handle_errors
    def probe() -> None:
        raise ModuleNotFoundError("No module named 'wandb'", name="wandb")

    result = CliRunner().invoke(probe, [])
    assert result.exit_code == 1
    assert result.stderr == (
        "error: probe needs the Python package 'wandb', which is not installed; install it "
        "with: pip install 'shardctl[wandb]'\n"
    )


def test_a_missing_module_that_is_no_extra_stays_a_traceback() -> None:
    # A module of the user's own or one inside an installed package: a bug to see whole.
    @click.command("probe")
    @handle_errors
    def probe() -> None:
        raise ModuleNotFoundError("No module named 'torch._C'", name="torch._C")

    result = CliRunner().invoke(probe, [])
    assert isinstance(result.exception, ModuleNotFoundError)


KUBECONFIGS = {
    "garbage-yaml": "apiVersion: v1\nclusters: [\n  - {{{ ::\n\tbad",
    "a-list": "- just\n- a list\n",
    "a-word": "hello\n",
    "not-utf8": b"\xff\xfe\x00binary",
    "a-folder": None,
}


@pytest.mark.parametrize("case", sorted(KUBECONFIGS))
def test_an_unusable_kubeconfig_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    pytest.importorskip("kubernetes")
    path = tmp_path / "kubeconfig"
    content = KUBECONFIGS[case]
    if content is None:
        path.mkdir()
    elif isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    monkeypatch.setenv("SHARDCTL_KUBECONFIG", str(path))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    result = CliRunner().invoke(cli, ["submit", str(EXAMPLES / "k8s.yaml"), "--cluster", "k8s"])
    assert result.exit_code == 1, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"error: no usable kubeconfig ({path}): "), lines[0]

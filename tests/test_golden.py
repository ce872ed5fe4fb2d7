"""Golden files: every artifact of every example for every cluster, byte for byte.

tests/golden/<example>/<cluster>/<file> holds what `render_artifacts` returned
when a person last reviewed it. A change shows up as a unified diff. After
reviewing the diff, regenerate every golden file with one command:

    SHARDCTL_REGEN_GOLDEN=1 pytest tests/test_golden.py
"""

from __future__ import annotations

import difflib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.render_util import EXAMPLES, ROOT
from shardctl.orchestrator.clusters import render_artifacts
from shardctl.orchestrator.errors import RenderError, SpecError
from shardctl.orchestrator.spec import parse_spec
from shardctl.orchestrator.yamlio import read_yaml_file

GOLDEN = ROOT / "tests" / "golden"
CLUSTERS = ("local", "slurm", "k8s")
EXAMPLE_NAMES = sorted(p.stem for p in EXAMPLES.glob("*.yaml"))
REGEN = os.environ.get("SHARDCTL_REGEN_GOLDEN") == "1"
REGEN_HINT = "review the diff, then regenerate: SHARDCTL_REGEN_GOLDEN=1 pytest tests/test_golden.py"


def _render(example: str, cluster: str) -> dict[str, str] | None:
    """The artifacts, or None while the cluster's renderer module does not exist.

    A spec the cluster refuses (a local example has no k8s.image) renders as
    `refused.txt`, the message the user reads: reviewed like any other artifact.

    The spec is read as one built in code (`parse_spec`): its relative paths stay as
    written, so the golden files name no machine's folders (`load_spec` would take
    them from the examples' folder: tests/test_spec_paths.py)."""
    spec = parse_spec(read_yaml_file(EXAMPLES / f"{example}.yaml"))
    try:
        return render_artifacts(spec, cluster)
    except RenderError as exc:
        if "missing from this installation" in str(exc):
            return None
        raise
    except SpecError as exc:
        return {"refused.txt": f"{exc}\n"}


def _diff(name: str, golden: str, rendered: str) -> str:
    return "".join(
        difflib.unified_diff(
            golden.splitlines(keepends=True),
            rendered.splitlines(keepends=True),
            fromfile=f"golden/{name}",
            tofile=f"rendered/{name}",
        )
    )


@pytest.mark.parametrize("cluster", CLUSTERS)
@pytest.mark.parametrize("example", EXAMPLE_NAMES)
def test_golden(example: str, cluster: str) -> None:
    folder = GOLDEN / example / cluster
    files = _render(example, cluster)
    if files is None:
        assert not folder.exists(), (
            f"golden files exist for {cluster} but its renderer module is missing"
        )
        pytest.skip(f"no {cluster} renderer module in this installation yet")
    if REGEN:
        if folder.exists():
            shutil.rmtree(folder)
        folder.mkdir(parents=True)
        for name, content in files.items():
            (folder / name).write_bytes(content.encode("utf-8"))
        return
    assert folder.is_dir(), f"no golden files for {example}/{cluster}; {REGEN_HINT}"
    golden = {p.name: p.read_bytes().decode("utf-8") for p in sorted(folder.iterdir())}
    problems = []
    for name in sorted(set(golden) - set(files)):
        problems.append(f"{name}: in golden files but no longer rendered")
    for name in sorted(set(files) - set(golden)):
        problems.append(f"{name}: rendered but has no golden file\n{_diff(name, '', files[name])}")
    for name in sorted(set(files) & set(golden)):
        if files[name] != golden[name]:
            problems.append(_diff(name, golden[name], files[name]))
    if problems:
        pytest.fail(
            f"{example}/{cluster} differs from its golden files ({REGEN_HINT}):\n"
            + "\n".join(problems),
            pytrace=False,
        )


def test_no_stale_golden_folders() -> None:
    expected = {(e, c) for e in EXAMPLE_NAMES for c in CLUSTERS}
    present = {(p.parent.name, p.name) for p in GOLDEN.glob("*/*") if p.is_dir()}
    assert present <= expected, f"golden folders without an example: {present - expected}"


def _all_renderings() -> dict[str, str]:
    out = {}
    for example in EXAMPLE_NAMES:
        for cluster in CLUSTERS:
            for name, content in (_render(example, cluster) or {}).items():
                out[f"{example}/{cluster}/{name}"] = content
    return out


def test_rendering_is_deterministic_across_processes(tmp_path: Path) -> None:
    """Another interpreter, another hash seed, another working directory: same bytes."""
    code = (
        "import json, sys\n"
        f"sys.path.insert(0, {str(ROOT / 'tests')!r})\n"
        "from test_golden import _all_renderings\n"
        "print(json.dumps(_all_renderings()))\n"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
        cwd=tmp_path, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    import json

    assert json.loads(done.stdout) == _all_renderings()


def test_no_machine_paths_in_any_artifact() -> None:
    machine = [str(ROOT), str(Path.home()), sys.prefix, "/tmp/"]
    # The checkout's parent only as a folder prefix: when it is /tmp, a pod's own
    # `/tmp` mount is not a machine path.
    if str(ROOT.parent) != "/":
        machine.append(f"{ROOT.parent}/")
    for key, content in _all_renderings().items():
        for path in machine:
            assert path not in content, f"{key} contains the machine path {path!r}"


def test_every_rendered_shell_script_parses() -> None:
    """bash reads every script of every example for every cluster (a quote inside a
    rendered message once broke the TrainJob launch script)."""
    for key, content in _all_renderings().items():
        if key.endswith((".sh", ".sbatch")):
            done = subprocess.run(
                ["bash", "-n"], input=content, text=True, capture_output=True, timeout=30
            )
            assert done.returncode == 0, f"{key}: {done.stderr}"

"""`shardctl plot RUN` writes a PNG of the loss curve from logs/metrics.jsonl."""

from __future__ import annotations

import json
import struct
from pathlib import Path

from click.testing import CliRunner
from shardctl.orchestrator.cli import cli
from shardctl.orchestrator.clusters.base import JobRef
from shardctl.orchestrator.clusters.records import remember
from shardctl.train.metrics import read_metrics


def _write_metrics(run_dir: Path) -> None:
    logs = run_dir / "logs"
    logs.mkdir(parents=True)
    rows = [{"step": s, "loss": 5.0 - 0.1 * s, "lr": 1e-3, "grad_norm": 1.0} for s in range(1, 6)]
    # A resumed run logs steps 4-5 again (the crash came before their checkpoint);
    # the last line of a step wins. A line cut short by a kill is skipped.
    rows += [{"step": 4, "loss": 9.0, "lr": 1e-3}, {"step": 5, "loss": 8.0, "lr": 1e-3}]
    text = "".join(json.dumps(r) + "\n" for r in rows) + '{"step": 6, "lo'
    (logs / "metrics.jsonl").write_text(text)


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def test_plot_writes_a_png_of_the_deduplicated_curve(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    _write_metrics(run_dir)
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert [r["loss"] for r in rows][3:] == [9.0, 8.0]
    res = CliRunner().invoke(cli, ["plot", str(run_dir)])
    assert res.exit_code == 0, res.output
    assert f"wrote {run_dir / 'loss.png'} (5 steps)" in res.output
    width, height = _png_size(run_dir / "loss.png")
    assert (width, height) == (800, 450)
    out = tmp_path / "elsewhere" / "curve.png"
    res = CliRunner().invoke(cli, ["plot", str(run_dir), "--out", str(out)])
    assert res.exit_code == 0 and _png_size(out) == (800, 450)


def test_plot_by_job_name_and_by_spec_file(tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / "named"
    _write_metrics(run_dir)
    remember(JobRef(cluster="local", job_id="1", name="named", run_dir=str(run_dir)))
    res = CliRunner().invoke(cli, ["plot", "named"])
    assert res.exit_code == 0 and (run_dir / "loss.png").is_file()
    spec = tmp_path / "named.yaml"
    spec.write_text(
        "name: named\ntrain:\n  model: {llama: {vocab_size: 256}}\n"
        "  data: {builtin: python-stdlib}\n"
        f"  steps: 5\nrun_dir: {run_dir}\ncheckpoint: {{every_steps: 5}}\n"
    )
    (run_dir / "loss.png").unlink()
    res = CliRunner().invoke(cli, ["plot", str(spec)])
    assert res.exit_code == 0 and (run_dir / "loss.png").is_file()


def test_plot_without_metrics_is_a_clear_usage_error(tmp_path: Path) -> None:
    res = CliRunner().invoke(cli, ["plot", str(tmp_path)])
    assert res.exit_code == 2
    assert "metrics.jsonl does not exist" in res.output
    res = CliRunner().invoke(cli, ["plot", "no-such-job"])
    assert res.exit_code == 1 and "no submitted job" in res.output

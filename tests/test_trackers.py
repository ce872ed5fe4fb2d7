"""Metrics trackers (`logging:`): TensorBoard, W&B (offline) and MLflow (a local store
in tmp), the real packages, read back with their own libraries.

Fast: the spec section (defaults, every refusal); a requested tracker whose package
is absent (`sys.modules[name] = None` in a child: the package missing, not mocked)
stops the built-in loop and `api.log_metrics` with the pip extra to install.
Slow: the real loop on 2 ranks writes the same scalars as metrics.jsonl to all three;
a restarted run continues the same TensorBoard folder (a step logged twice is purged),
MLflow run and W&B run id; a user script under torchrun logs through `api.log_metrics`.
No test touches the network: W&B runs offline with every folder of its own in tmp.
"""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers.ckpt_run import child_env, run, torchrun_argv
from helpers.shared_runs import TINY_RUN_LOGGING, TinyRun, offline_env
from helpers.train_run import metrics, tiny_spec, train, train_ok
from shardctl.orchestrator.errors import SpecError
from shardctl.orchestrator.rundir import CONTRACT_ENV
from shardctl.orchestrator.spec import Logging, load_spec
from shardctl.train import trackers

ALL = ["tensorboard", "wandb", "mlflow"]
SCALARS = ("loss", "lr", "grad_norm", "tokens_per_s")


# ------------------------------------------------------------------ readers


def tensorboard_scalars(folder: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def mlflow_history(uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    from mlflow.tracking import MlflowClient

    history = MlflowClient(tracking_uri=uri).get_metric_history(run_id, key)
    return sorted((m.step, m.value) for m in history)


def wandb_records(path: Path) -> list[Any]:
    """The records of a `.wandb` file, decoded by W&B's own protobuf classes.

    wandb 0.31 has no Python reader left (its Go core reads these files); the framing
    is LevelDB's log format: a 7-byte file header (":W&B", magic, version), then 32 KiB
    blocks of records with a 7-byte header (crc32c, length, type: full/first/middle/last).
    """
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    block, pos, pending, out = 32768, 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        _crc, size, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if left < 7 or (kind == 0 and size == 0):  # block trailer / padding
            pos += left
            continue
        chunk, pos = data[pos + 7 : pos + 7 + size], pos + 7 + size
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            out.append(record)
    return out


def wandb_history(run_dir: Path) -> tuple[set[str], list[dict[str, Any]]]:
    """(run ids, history rows) of every offline run file under `run_dir/wandb`."""
    ids, rows = set(), []
    for path in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb")):
        for rec in wandb_records(path):
            kind = rec.WhichOneof("record_type")
            if kind == "run":
                ids.add(rec.run.run_id)
            elif kind == "history":
                items = rec.history.item
                rows.append(
                    {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items}
                )
    return ids, rows


def kept_ids(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "logs" / "trackers.json").read_text())


# ------------------------------------------------------------------ the spec


def _spec(tmp_path: Path, logging: Any) -> Path:
    return tiny_spec(tmp_path, "job", logging=logging)


def test_logging_defaults_and_resolution(tmp_path: Path) -> None:
    spec = load_spec(tiny_spec(tmp_path, "job"))
    assert spec.logging == Logging()
    # Unset: TensorBoard when installed (it is here), metrics.jsonl alone otherwise.
    assert spec.logging.backends is None and spec.logging.wandb_mode == "online"
    assert trackers.requested(spec.logging) == ["tensorboard"]
    full = spec.logging.resolved(spec.name, spec.run_dir)
    root = (tmp_path / "job").absolute()
    assert (full.project, full.run_name) == ("job", "job")
    assert full.tensorboard_dir == str(root / "tensorboard")
    assert full.mlflow_tracking_uri == f"sqlite:///{root}/mlflow.db"  # four slashes
    given = load_spec(_spec(tmp_path, {"backends": [], "project": "p", "run_name": "r 1"}))
    assert given.logging.resolved("job", "x").project == "p"
    assert given.logging.backends == []
    assert spec.to_yaml_dict()["logging"]["backends"] is None
    assert trackers.requested(given.logging) == []


@pytest.mark.parametrize(
    ("logging", "expected"),
    [
        ({"backends": ["wandb", "wandb"]}, "logging.backends: ['wandb'] given more than once"),
        ({"backends": ["neptune"]}, "'tensorboard', 'wandb' or 'mlflow' (got 'neptune')"),
        ({"backends": "tensorboard"}, "logging.backends"),
        ({"wandb_mode": "disabled"}, "'online' or 'offline' (got 'disabled')"),
        ({"project": "a/b"}, "logging.project: 'a/b' cannot name a W&B project"),
        ({"run_name": ""}, "logging.run_name: '' cannot name"),
        ({"project": "x" * 129}, "1-128 printable characters"),
        ({"mlflow_tracking_uri": " "}, "logging.mlflow_tracking_uri: ' ' is not a tracking URI"),
        ({"tensorboard_dir": "a\nb"}, "logging.tensorboard_dir"),
        ({"backend": ["wandb"]}, "unknown key 'logging.backend'"),
    ],
)
def test_logging_refusals_name_field_value_and_accepted(
    tmp_path: Path, logging: Any, expected: str
) -> None:
    with pytest.raises(SpecError) as err:
        load_spec(_spec(tmp_path, logging))
    assert expected in str(err.value)


# ------------------------------------------------------------------ missing packages


def _child(code: str, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    res = run([sys.executable, "-c", textwrap.dedent(code)], timeout, env=env)
    return res


@pytest.mark.parametrize(("backend", "module"), [("wandb", "wandb"), ("mlflow", "mlflow")])
def test_missing_package_stops_the_loop_at_start(tmp_path: Path, backend: str, module: str) -> None:
    spec = _spec(tmp_path, {"backends": ["tensorboard", backend]})
    env = {k: v for k, v in child_env().items() if k not in CONTRACT_ENV}
    env.update(offline_env(tmp_path), RANK="0", WORLD_SIZE="1")
    res = _child(
        f"""
        import sys
        sys.modules[{module!r}] = None  # the package is absent: import raises ImportError
        from shardctl.train.__main__ import main
        sys.exit(main([{str(spec)!r}]))
        """,
        env,
    )
    assert res.returncode == 1, res.stdout[-3000:]
    assert f"logging.backends '{backend}' needs the Python package '{module}'" in res.stdout
    assert f"pip install 'shardctl[{backend}]'" in res.stdout
    # Stopped before anything was built or written.
    assert not (tmp_path / "job" / "checkpoints").exists()
    assert not (tmp_path / "job" / "tensorboard").exists()


def test_unset_backends_without_tensorboard_still_log_metrics(tmp_path: Path) -> None:
    """The default asks for nothing: an environment without tensorboard trains on and
    says where the metrics went; only a tracker the spec lists is required."""
    spec = _spec(tmp_path, {"project": "p"})
    env = {k: v for k, v in child_env().items() if k not in CONTRACT_ENV}
    env.update(offline_env(tmp_path), SHARDCTL_SPEC=str(spec))
    res = _child(
        """
        import sys
        sys.modules["tensorboard"] = None
        from shardctl.train import api
        api.log_metrics(1, loss=1.5)
        api.close_metrics()
        """,
        env,
    )
    assert res.returncode == 0, res.stdout[-3000:]
    assert "no TensorBoard event files (the tensorboard package is not installed" in res.stdout
    rows = (tmp_path / "job" / "logs" / "metrics.jsonl").read_text().splitlines()
    assert json.loads(rows[-1])["loss"] == 1.5
    assert not (tmp_path / "job" / "tensorboard").exists()


def test_missing_package_stops_log_metrics(tmp_path: Path) -> None:
    spec = _spec(tmp_path, {"backends": ["mlflow"]})
    env = {k: v for k, v in child_env().items() if k not in CONTRACT_ENV}
    env.update(offline_env(tmp_path), SHARDCTL_SPEC=str(spec))
    res = _child(
        """
        import sys
        sys.modules["mlflow"] = None
        from shardctl.orchestrator.errors import MissingDependencyError
        from shardctl.train import api
        try:
            api.log_metrics(1, loss=1.0)
        except MissingDependencyError as exc:
            print("refused:", exc)
        """,
        env,
    )
    assert res.returncode == 0, res.stdout[-3000:]
    assert "refused: logging.backends 'mlflow' needs" in res.stdout
    assert "pip install 'shardctl[mlflow]'" in res.stdout


# ------------------------------------------------------------------ the built-in loop


@pytest.mark.slow
def test_loop_writes_the_metrics_to_every_tracker(tiny_run: TinyRun) -> None:
    """The shared tiny run (6 steps, logged every 2) asked for all three trackers."""
    assert TINY_RUN_LOGGING["backends"] == ALL
    run_dir = tiny_run.run_dir
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == [2, 4, 6]
    ids = kept_ids(run_dir)

    for key in SCALARS:
        want = [(r["step"], r[key]) for r in rows]
        # TensorBoard keeps float32; MLflow and W&B the float64 of metrics.jsonl.
        tb = tensorboard_scalars(run_dir / "tensorboard", key)
        assert [s for s, _ in tb] == [2, 4, 6]
        assert [v for _, v in tb] == pytest.approx([v for _, v in want], rel=1e-6)
        uri = ids["mlflow"]["tracking_uri"]
        assert uri == f"sqlite:///{run_dir}/mlflow.db"
        assert mlflow_history(uri, ids["mlflow"]["run_id"], key) == want

    wb_ids, history = wandb_history(run_dir)
    assert wb_ids == {ids["wandb"]["id"]}
    assert [(h["_step"], h["loss"]) for h in history] == [(r["step"], r["loss"]) for r in rows]

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=ids["mlflow"]["tracking_uri"])
    mrun = client.get_run(ids["mlflow"]["run_id"])
    assert mrun.info.status == "FINISHED" and mrun.info.run_name == "r1"
    assert client.get_experiment(mrun.info.experiment_id).name == "proj"


@pytest.mark.slow
def test_a_restarted_run_continues_the_same_trackers(tmp_path: Path) -> None:
    run_dir = tmp_path / "job"
    logging = {"backends": ALL, "wandb_mode": "offline"}
    env = offline_env(tmp_path)
    common = {"checkpoint": {"every_steps": 4, "keep": 3}, "logging": logging}
    # 1: preempted after step 4 (saved there): trackers closed as preempted.
    spec = tiny_spec(tmp_path, "job", train={"steps": 8}, **common)
    res = train(spec, env={**env, "SHARDCTL_STOP_AFTER_STEP": "4"})
    assert res.returncode != 0 and (run_dir / "PREEMPTED").exists(), res.stdout[-3000:]
    first = kept_ids(run_dir)
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=first["mlflow"]["tracking_uri"])
    assert client.get_run(first["mlflow"]["run_id"]).info.status == "KILLED"
    # 2: to the end; then 3: a crash after step 8 logged but before its checkpoint
    # (its checkpoint and DONE removed), run again to 10 from step 4's checkpoint...
    train_ok(spec, env=env)
    shutil.rmtree(run_dir / "checkpoints" / "step-00000008")
    (run_dir / "DONE").unlink()
    longer = tiny_spec(tmp_path, "job", train={"steps": 10}, **common)
    res = train_ok(longer, env=env)
    assert "resumed at step 4" in res.stdout

    assert kept_ids(run_dir) == first  # same W&B id, same MLflow run
    assert len(list((run_dir / "tensorboard").glob("events.out.tfevents.*"))) == 3
    # ... TensorBoard's reader shows each step once: steps 5-8 of the second start were
    # purged by the third (purge_step 5), which logged them again.
    tb = tensorboard_scalars(run_dir / "tensorboard", "loss")
    assert [s for s, _ in tb] == list(range(1, 11))
    last = {r["step"]: r["loss"] for r in metrics(run_dir)}  # the last line of each step
    assert [v for _, v in tb] == pytest.approx([last[s] for s in range(1, 11)], rel=1e-6)
    # MLflow keeps every value it was given: steps 5-8 twice; the run is FINISHED again.
    steps = [
        s
        for s, _ in mlflow_history(
            first["mlflow"]["tracking_uri"], first["mlflow"]["run_id"], "loss"
        )
    ]
    assert sorted(set(steps)) == list(range(1, 11)) and len(steps) == 14
    assert client.get_run(first["mlflow"]["run_id"]).info.status == "FINISHED"
    wb_ids, history = wandb_history(run_dir)
    assert wb_ids == {first["wandb"]["id"]}
    assert len(list((run_dir / "wandb").glob("offline-run-*"))) == 3
    assert sorted({h["_step"] for h in history}) == list(range(1, 11))


# ------------------------------------------------------------------ a user script


SCRIPT = """
import os
from shardctl.train import api

for step in range(1, 6):
    api.log_metrics(step, loss=1.0 / step, lr=1e-3, rank_seen=float(os.environ["RANK"]))
"""


@pytest.mark.slow
def test_a_user_script_logs_through_the_api(tmp_path: Path) -> None:
    (tmp_path / "user.py").write_text(SCRIPT)
    spec_path = tmp_path / "own.yaml"
    spec_path.write_text(
        yaml.safe_dump(
            {
                "name": "own",
                "run_dir": str(tmp_path / "own"),
                "resources": {"nodes": 1, "procs_per_node": 2, "device": "cpu"},
                "entrypoint": {"script": "user.py"},
                "logging": {"backends": ALL, "wandb_mode": "offline"},
            }
        )
    )
    run_dir = tmp_path / "own"
    env = {k: v for k, v in child_env().items() if k not in CONTRACT_ENV}
    env.update(
        offline_env(tmp_path),
        SHARDCTL_SPEC=str(spec_path),
        SHARDCTL_RUN_DIR=str(run_dir),
        SHARDCTL_JOB_NAME="own",
        PYTHONUNBUFFERED="1",
    )
    argv = torchrun_argv(2, "-m", "shardctl.train.entry", "script", str(tmp_path / "user.py"))
    res = run(argv, 180, env=env)
    assert res.returncode == 0, res.stdout[-4000:]

    from shardctl.train.metrics import read_metrics

    rows = read_metrics(run_dir)
    assert [(r["step"], r["loss"], r["rank_seen"]) for r in rows] == [
        (s, 1.0 / s, 0.0) for s in range(1, 6)
    ]  # rank 0 alone wrote
    assert len(metrics(run_dir)) == 5
    tb = tensorboard_scalars(run_dir / "tensorboard", "loss")
    assert tb == [(s, pytest.approx(1.0 / s, rel=1e-6)) for s in range(1, 6)]
    ids = kept_ids(run_dir)
    uri, run_id = ids["mlflow"]["tracking_uri"], ids["mlflow"]["run_id"]
    assert mlflow_history(uri, run_id, "loss") == [(s, 1.0 / s) for s in range(1, 6)]
    from mlflow.tracking import MlflowClient

    assert MlflowClient(tracking_uri=uri).get_run(run_id).info.status == "FINISHED"
    _, history = wandb_history(run_dir)
    assert [(h["_step"], h["loss"]) for h in history] == [(s, 1.0 / s) for s in range(1, 6)]


def test_outside_shardctl_log_metrics_writes_nothing(tmp_path: Path) -> None:
    env = {k: v for k, v in child_env().items() if k not in CONTRACT_ENV}
    res = run(
        [sys.executable, "-c", "from shardctl.train import api; api.log_metrics(1, loss=2.0)"],
        60,
        env={**env, **offline_env(tmp_path)},
    )
    assert res.returncode == 0 and "metrics are not written" in res.stdout, res.stdout

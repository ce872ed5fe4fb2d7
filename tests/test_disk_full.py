"""Full and read-only file systems: every writer names the path (with free and needed
bytes), leaves nothing half-written and keeps what was there before.

A real full disk is a small tmpfs (mounting needs root: skipped otherwise, saying so);
a read-only one is a tmpfs remounted read-only (chmod does not stop root). Each mount
is undone in a `finally`. One real training launch: a save that runs out of space.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner
from helpers.consolidate_util import make_dcp_step, tiny_llama
from helpers.train_run import tiny_spec, train
from shardctl.orchestrator.cli import cli
from shardctl.orchestrator.durable import storage_error
from shardctl.orchestrator.errors import StorageError
from shardctl.orchestrator.outcome import FAILED_FILE, Evidence, Kind, classify

needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="a small tmpfs (a really full disk) can only be mounted as root"
)


@contextlib.contextmanager
def tmpfs(size: str, *, read_only: bool = False) -> Iterator[Path]:
    """A fresh tmpfs of `size` (e.g. "400k"), unmounted and removed afterwards."""
    where = Path(tempfile.mkdtemp(prefix="shardctl-tmpfs-"))
    mounted = False
    try:
        res = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        if res.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip()}")
        mounted = True
        if read_only:
            subprocess.run(["mount", "-o", "remount,ro", str(where)], check=True, timeout=30)
        yield where
    finally:
        if mounted:
            subprocess.run(["umount", str(where)], check=False, timeout=60)
        shutil.rmtree(where, ignore_errors=True)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run folder with one complete synthetic DCP checkpoint (step 1)."""
    root = tmp_path_factory.mktemp("run")
    model = tiny_llama(tied=False, seed=1)
    make_dcp_step(root / "checkpoints", 1, model.state_dict(), model.config.to_dict())
    return root


@pytest.fixture(scope="module")
def foreign_dcp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Another tool's checkpoint: a plain script's `dcp.save({"model", "optim"})` folder
    of a tiny Llama after one AdamW step."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    model = tiny_llama(tied=False, seed=1).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator())
    model(input_ids=tokens, labels=tokens).loss.backward()
    optimizer.step()
    folder = tmp_path_factory.mktemp("foreign") / "dcp"
    optim = get_optimizer_state_dict(model, optimizer)
    dcp.save(
        {"model": get_model_state_dict(model), "optim": optim},
        checkpoint_id=str(folder),
        no_dist=True,
    )
    return folder


# ------------------------------------------------------------------------ the messages


def test_torchs_hidden_enospc_is_named_by_the_free_space_left(tmp_path: Path) -> None:
    """torch's zip writer reports a full disk as "unexpected pos"; asked right after,
    the free space tells, and the message says full, with free and needed bytes."""
    import torch

    if os.geteuid() != 0:
        pytest.skip("a small tmpfs (a really full disk) can only be mounted as root")
    with tmpfs("256k") as full:
        with pytest.raises(BaseException) as info, open(full / "t.pt", "wb") as f:
            torch.save({"w": torch.zeros(200_000)}, f)
        problem = storage_error(info.value, full, what="t.pt", needed=800_000)
    assert isinstance(problem, StorageError), repr(info.value)
    text = str(problem)
    assert f"{full} is full" in text and "free" in text and "800000 bytes) needed" in text


def test_efbig_says_file_size_limit_not_full(tmp_path: Path) -> None:
    """RLIMIT_FSIZE (ulimit -f) gives EFBIG: the message must not claim a full disk."""
    code = (
        "import resource, signal, sys; from pathlib import Path\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))\n"
        "from shardctl.orchestrator.durable import storage_error\n"
        "out = Path(sys.argv[1])\n"
        "try:\n"
        "    out.write_bytes(b'x' * 100000)\n"
        "except OSError as exc:\n"
        "    print(storage_error(exc, out.parent, what=str(out), needed=100000))\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "big")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert "EFBIG" in res.stdout and "file size limit" in res.stdout, res.stdout
    assert "is full" not in res.stdout


# ------------------------------------------------------------------ consolidate, convert


@needs_root
def test_consolidate_onto_a_full_disk_names_it_and_keeps_the_old_model(run_dir: Path) -> None:
    with tmpfs("64k") as full:
        out = full / "model"
        out.mkdir()
        (out / "old.txt").write_text("the previous model")
        res = CliRunner().invoke(
            cli, ["consolidate", str(run_dir), "--out", str(out), "--force", "--no-progress"]
        )
        assert res.exit_code == 1, res.output
        assert f"{full} is full" in res.output and "needed" in res.output, res.output
        assert "Traceback" not in res.output
        assert sorted(p.name for p in full.iterdir()) == ["model"]  # no model.tmp left
        assert (out / "old.txt").read_text() == "the previous model"


@needs_root
def test_consolidate_convert_and_plot_onto_a_read_only_disk(
    run_dir: Path, foreign_dcp: Path
) -> None:
    from shardctl.train.metrics import metrics_path

    metrics_path(run_dir).parent.mkdir(parents=True, exist_ok=True)
    metrics_path(run_dir).write_text(
        "".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in (1, 2, 3))
    )
    with tmpfs("1m", read_only=True) as ro:
        for args in (
            ["consolidate", str(run_dir), "--out", str(ro / "model"), "--no-progress"],
            ["convert", str(run_dir), "--to", "deepspeed", "--world-size", "1",
             "--out", str(ro / "ds")],
            ["convert", str(foreign_dcp), "--to", "deepspeed", "--world-size", "1",
             "--out", str(ro / "ds-foreign")],
            ["plot", str(run_dir), "--out", str(ro / "loss.png")],
        ):  # fmt: skip
            res = CliRunner().invoke(cli, args)
            assert res.exit_code == 1, (args, res.output)
            assert f"{ro} is read-only" in res.output, (args, res.output)
            assert "Traceback" not in res.output
        assert list(ro.iterdir()) == []


# ------------------------------------------------------------- a save during training


@needs_root
def test_a_save_on_a_full_disk_fails_the_run_saying_why_and_keeps_the_previous(
    tmp_path: Path,
) -> None:
    """checkpoint.dir on a tmpfs that holds one tiny checkpoint (~800 KB) but not two:
    the step-4 save fails; step 2 stays complete and verifies, no .tmp is left, and
    the FAILED marker (what `status` shows) names the folder with free/needed bytes."""
    from shardctl.train.manifest import verify

    with tmpfs("1200k") as full:
        spec = tiny_spec(
            tmp_path,
            "job",
            strategy={"precision": "fp32"},
            checkpoint={"every_steps": 2, "keep": 2, "dir": str(full)},
        )
        res = train(spec, env={"SHARDCTL_RUN_DIR": str(tmp_path / "job")})
        assert res.returncode == 1, res.stdout[-4000:]  # torchrun's code for a failed rank
        assert sorted(p.name for p in full.iterdir()) == ["step-00000002"], res.stdout[-4000:]
        assert verify(full / "step-00000002") == []
    marker = json.loads((tmp_path / "job" / FAILED_FILE).read_text())
    reason = marker["reason"]
    assert f"{full} is full" in reason and "free" in reason and "needed" in reason, reason
    assert "step-00000004.tmp was removed" in reason and "step-00000002 is intact" in reason
    # No torch traceback, no C++ source location: what `status` shows is shardctl's line.
    assert "Traceback" not in reason and ".cc:" not in reason and "\n" not in reason, reason
    # A full disk is as full on the next attempt: not retried (exit 78, permanent).
    assert marker["code"] == 78, marker
    outcome = classify(Evidence.gather(tmp_path / "job", None, 1))
    assert outcome.kind is Kind.PERMANENT and reason in outcome.summary()


def test_a_users_script_stopped_by_a_full_disk_records_why(tmp_path: Path) -> None:
    """`entrypoint:` scripts: a shardctl error (here the StorageError a save raises)
    that ends the script is the reason of its FAILED marker."""
    import time

    from shardctl.train import entry

    script = tmp_path / "train.py"
    script.write_text(
        "from shardctl.orchestrator.errors import StorageError\n"
        "raise StorageError('cannot write checkpoint step-00000004: /ck is full')\n"
    )
    started = time.time()
    code = entry.run("script", str(script), [])
    entry.record(code, started, str(tmp_path / "run"), 1)
    marker = json.loads((tmp_path / "run" / FAILED_FILE).read_text())
    assert (marker["code"], marker["rank"]) == (1, 1)
    assert marker["reason"] == "cannot write checkpoint step-00000004: /ck is full"

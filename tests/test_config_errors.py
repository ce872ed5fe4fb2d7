"""A configuration error is not a crash: the built-in loop ends it with exit 78 (do not
retry), one clear line naming the field and no traceback, and records FAILED with code
78 so that no supervisor restarts it; `validate` refuses what it can see beforehand.

The run-time cases run one rank of `python -m shardctl.train` directly (no launcher:
the exit code is the rank's own), each bounded by a timeout and killed by process group.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers.ckpt_run import ROOT, child_env, kill_group
from helpers.train_run import tiny_spec
from shardctl.orchestrator.errors import PermanentError
from shardctl.orchestrator.outcome import FAILED_FILE, Evidence, Kind, classify
from shardctl.orchestrator.rundir import EXIT_DO_NOT_RETRY

RANK_TIMEOUT_S = 300


def one_rank(spec: Path, run_dir: Path) -> subprocess.CompletedProcess:
    """Rank 0 of a world of one, as a launcher would start it (output merged)."""
    env = {
        **child_env(),
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
        "SHARDCTL_RUN_DIR": str(run_dir),
    }
    argv = [sys.executable, "-m", "shardctl.train", str(spec)]
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=ROOT,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=RANK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        out, _ = proc.communicate()
        raise AssertionError(f"rank timed out after {RANK_TIMEOUT_S}s:\n{out[-4000:]}") from None
    return subprocess.CompletedProcess(argv, proc.returncode, out, None)


def single(tmp: Path, **over: Any) -> tuple[Path, Path]:
    """A one-rank tiny spec (fp32 on CPU) with `over` merged in; (spec, run dir)."""
    resources = {"nodes": 1, "procs_per_node": 1, "device": "cpu", **over.pop("resources", {})}
    strategy = {"precision": "fp32", **over.pop("strategy", {})}
    spec = tiny_spec(tmp, "job", resources=resources, strategy=strategy, **over)
    return spec, tmp / "job"


def assert_not_retried(res: subprocess.CompletedProcess, run_dir: Path, *words: str) -> str:
    """Exit 78, one error line holding `words`, no traceback, FAILED (78) judged a
    permanent failure. Returns the error line."""
    out = res.stdout
    assert res.returncode == EXIT_DO_NOT_RETRY, f"rc {res.returncode}:\n{out[-4000:]}"
    assert "Traceback" not in out, out[-4000:]
    errors = [line for line in out.splitlines() if "error:" in line]
    assert len(errors) == 1, out[-4000:]
    for word in words:
        assert word in errors[0], errors[0]
    marker = json.loads((run_dir / FAILED_FILE).read_text())
    assert marker["code"] == EXIT_DO_NOT_RETRY, marker
    outcome = classify(Evidence.gather(run_dir, None, 1))
    assert outcome.kind is Kind.PERMANENT, outcome
    return errors[0]


def test_permanent_error_exits_with_the_do_not_retry_code() -> None:
    # errors.py imports nothing, so the number is written there twice.
    assert PermanentError.exit_code == EXIT_DO_NOT_RETRY == 78


def _text(tmp: Path, content: bytes) -> dict[str, Any]:
    corpus = tmp / "corpus.txt"
    corpus.write_bytes(content)
    return {"train": {"data": {"text": str(corpus), "builtin": None}}}


def _tokens(tmp: Path, name: str, write: Callable[[Path], None], **data: Any) -> dict[str, Any]:
    path = tmp / name
    write(path)
    return {"train": {"data": {"tokens": str(path), "builtin": None, **data}}}


def _pretrained_broken(tmp: Path) -> dict[str, Any]:
    folder = tmp / "model"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama",')
    return {"train": {"model": {"llama": None, "pretrained": str(folder)}}}


def _resume_empty(tmp: Path) -> dict[str, Any]:
    (tmp / "nothing").mkdir()
    return {"checkpoint": {"resume": str(tmp / "nothing")}}


# (case, spec overrides made in tmp, words the one error line holds)
CASES: list[tuple[str, Callable[[Path], dict[str, Any]], tuple[str, ...]]] = [
    (
        "unknown wrap class",
        lambda tmp: {"strategy": {"wrap": ["NoSuchBlock"]}},
        ("strategy.wrap", "NoSuchBlock", "LlamaDecoderLayer"),
    ),
    (
        "byte text, vocab_size under 256",
        lambda tmp: {"train": {"model": {"llama": {"vocab_size": 200}}}},
        ("vocab_size", "200", "256"),
    ),
    (
        "token ids past vocab_size",
        lambda tmp: _tokens(
            tmp, "ids.npy", lambda p: np.save(p, np.full(4096, 300, dtype=np.uint16))
        ),
        ("train.data.tokens", "token id 300", "vocab_size is 256"),
    ),
    ("empty corpus", lambda tmp: _text(tmp, b""), ("train.data.text", "fewer than one sequence")),
    (
        "10-byte corpus",
        lambda tmp: _text(tmp, b"0123456789"),
        ("train.data.text", "11 tokens", "train.seq_len"),
    ),
    (
        "float64 .npy",
        lambda tmp: _tokens(tmp, "f.npy", lambda p: np.save(p, np.zeros(4096, dtype=np.float64))),
        ("train.data.tokens", "float64", "uint16"),
    ),
    (
        "raw tokens cut mid-token",
        lambda tmp: _tokens(tmp, "cut.bin", lambda p: p.write_bytes(b"\x01" * 8191)),
        ("train.data.tokens", "8191 bytes", "uint16"),
    ),
    (
        "pretrained config.json not JSON",
        _pretrained_broken,
        ("train.model.pretrained", "config.json", "not JSON"),
    ),
    ("resume folder without a checkpoint", _resume_empty, ("checkpoint.resume", "nothing")),
]


@pytest.mark.slow
@pytest.mark.parametrize("make", [c[1] for c in CASES], ids=[c[0] for c in CASES])
def test_a_configuration_error_ends_the_rank_with_78_and_one_line(
    tmp_path: Path, make: Callable[[Path], dict[str, Any]]
) -> None:
    words = next(c[2] for c in CASES if c[1] is make)
    spec, run_dir = single(tmp_path, **make(tmp_path))
    assert_not_retried(one_rank(spec, run_dir), run_dir, *words)


@pytest.mark.slow
@pytest.mark.skipif(
    any(Path("/dev").glob("nvidia[0-9]*")), reason="this machine has a GPU: cuda is available"
)
def test_device_cuda_without_a_gpu_is_not_retried(tmp_path: Path) -> None:
    spec, run_dir = single(tmp_path, resources={"device": "cuda"})
    res = one_rank(spec, run_dir)
    if "torch sees no CUDA device" not in res.stdout and res.returncode == 0:
        pytest.skip("torch sees a CUDA device here")
    assert_not_retried(res, run_dir, "resources.device", "cuda")

"""A configuration error is not a crash: the built-in loop ends it with exit 78 (do not
retry), one clear line naming the field and no traceback, and records FAILED with code
78 so that no supervisor restarts it; `validate` refuses what it can see beforehand.

The run-time cases run one rank of `python -m shardctl.train` directly (no launcher:
the exit code is the rank's own), each bounded by a timeout and killed by process group.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from helpers.ckpt_run import child_env, run
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
    return run([sys.executable, "-m", "shardctl.train", str(spec)], RANK_TIMEOUT_S, env)


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


# -- before any rank starts: validate and submit --dry-run refuse what they can see ------


def _validate(tmp: Path, patch: dict[str, Any], *args: str) -> Any:
    from click.testing import CliRunner
    from helpers.render_util import example_data, merge
    from shardctl.orchestrator.cli import cli

    path = tmp / "job.yaml"
    path.write_text(yaml.safe_dump(merge(example_data(), patch)))
    return CliRunner().invoke(cli, ["validate", str(path), *args])


def _corpus(tmp: Path, content: bytes | None) -> dict[str, Any]:
    """`content` None: a FIFO (it would block every rank that opens it)."""
    corpus = tmp / "corpus"
    if content is None:
        os.mkfifo(corpus)
    else:
        corpus.write_bytes(content)
    return {"train": {"data": {"builtin": None, "text": str(corpus)}}}


def _npy(tmp: Path, array: np.ndarray) -> dict[str, Any]:
    np.save(tmp / "t.npy", array)
    return {"train": {"data": {"builtin": None, "tokens": str(tmp / "t.npy")}}}


def _raw(tmp: Path, content: bytes) -> dict[str, Any]:
    (tmp / "t.bin").write_bytes(content)
    return {"train": {"data": {"builtin": None, "tokens": str(tmp / "t.bin")}}}


def _resume_with(tmp: Path, name: str | None) -> dict[str, Any]:
    folder = tmp / "old"
    (folder / "sub").mkdir(parents=True)
    if name is not None:
        (folder / "sub" / name).write_text("{}")
    (folder / "notes.txt").write_text("not a checkpoint")
    return {"checkpoint": {"resume": str(folder)}}


# (case, spec patch made in tmp, the one line validate prints, in parts)
REFUSED: list[tuple[str, Callable[[Path], dict[str, Any]], tuple[str, ...]]] = [
    ("fifo corpus", lambda tmp: _corpus(tmp, None), ("train.data.text", "is not a regular file")),
    (
        "/dev/null corpus",
        lambda tmp: {"train": {"data": {"builtin": None, "text": "/dev/null"}}},
        ("train.data.text '/dev/null' is not a regular file or folder here",),
    ),
    (
        "empty corpus",
        lambda tmp: _corpus(tmp, b""),
        ("train.data.text", "has 1 tokens", "train.seq_len + 1 = 129"),
    ),
    ("10-byte corpus", lambda tmp: _corpus(tmp, b"0123456789"), ("has 11 tokens",)),
    ("corpus folder of hidden files only", lambda tmp: _hidden_only(tmp), ("holds no files",)),
    (
        "float64 .npy",
        lambda tmp: _npy(tmp, np.zeros(4096, dtype=np.float64)),
        ("train.data.tokens", "dtype float64", "uint16"),
    ),
    ("2-D .npy", lambda tmp: _npy(tmp, np.zeros((64, 64), dtype=np.uint16)), ("shape (64, 64)",)),
    (
        "raw tokens cut mid-token",
        lambda tmp: _raw(tmp, b"\x01" * 8191),
        ("train.data.tokens", "8191 bytes are not a whole number of uint16 tokens"),
    ),
    (
        "short token file",
        lambda tmp: _npy(tmp, np.zeros(100, dtype=np.uint16)),
        ("has 100 tokens", "= 129"),
    ),
    (
        "token id past vocab_size",
        lambda tmp: _npy(tmp, np.arange(4096, dtype=np.uint16)),
        ("train.data.tokens", "holds token id 4095", "vocab_size is 256"),
    ),
    (
        "byte text, vocab_size under 256",
        lambda tmp: {"train": {"model": {"llama": {"vocab_size": 200}}}},
        ("train.model.llama.vocab_size is 200", "byte-level", ">= 256"),
    ),
    (
        "pretrained config.json not JSON",
        lambda tmp: {"train": {"model": {"llama": None, "pretrained": _broken_model(tmp)}}},
        ("train.model.pretrained", "config.json that is not JSON (line 1"),
    ),
    (
        "resume folder without a checkpoint",
        lambda tmp: _resume_with(tmp, None),
        ("checkpoint.resume", "holds no checkpoint (no manifest.json"),
    ),
    (
        "unknown wrap class",
        lambda tmp: {"strategy": {"wrap": ["LlamaDecoderLayer", "NoSuchBlock"]}},
        ("strategy.wrap names ['NoSuchBlock']", "LlamaDecoderLayer", "LlamaRMSNorm"),
    ),
]


def _hidden_only(tmp: Path) -> dict[str, Any]:
    (tmp / "texts").mkdir()
    (tmp / "texts" / ".notes").write_text("the ranks skip hidden files")
    return {"train": {"data": {"builtin": None, "text": str(tmp / "texts")}}}


def _broken_model(tmp: Path) -> str:
    (tmp / "model").mkdir()
    (tmp / "model" / "config.json").write_text('{"vocab_size": 256,')
    return str(tmp / "model")


@pytest.mark.parametrize("make", [c[1] for c in REFUSED], ids=[c[0] for c in REFUSED])
def test_validate_refuses_what_every_rank_would_fail_on(
    tmp_path: Path, make: Callable[[Path], dict[str, Any]]
) -> None:
    words = next(c[2] for c in REFUSED if c[1] is make)
    result = _validate(tmp_path, make(tmp_path))
    assert result.exit_code == 2, result.output
    assert len(result.stderr.splitlines()) == 1, result.stderr
    assert "Traceback" not in result.output
    for word in words:
        assert word in result.stderr, result.stderr


@pytest.mark.parametrize("mark", ["manifest.json", ".metadata", "latest", "model.safetensors"])
def test_a_resume_folder_holding_any_tools_checkpoint_passes_validate(
    tmp_path: Path, mark: str
) -> None:
    """Foreign layouts (DCP, DeepSpeed, the Trainer's weights) are the ranks' to judge."""
    result = _validate(tmp_path, _resume_with(tmp_path, mark))
    assert result.exit_code == 0, result.output


def test_token_ids_within_vocab_size_pass_validate(tmp_path: Path) -> None:
    result = _validate(tmp_path, _npy(tmp_path, np.arange(4096, dtype=np.uint16) % 256))
    assert result.exit_code == 0, result.output


@pytest.mark.skipif(
    any(Path("/dev").glob("nvidia[0-9]*")) or Path("/dev/kfd").exists(),
    reason="this machine has a GPU",
)
def test_device_cuda_is_refused_only_where_this_machine_runs_the_ranks(tmp_path: Path) -> None:
    patch = {"resources": {"device": "cuda"}, "strategy": {"precision": "bf16-mixed"}}
    local = _validate(tmp_path, patch)
    assert local.exit_code == 2, local.output
    assert "resources.device is 'cuda' but this machine" in local.stderr, local.stderr
    assert "accepted here: device: cpu" in local.stderr
    slurm = _validate(tmp_path, patch, "--cluster", "slurm")  # the nodes may have GPUs
    assert slurm.exit_code == 0, slurm.output


# -- a full checkpoint disk: its reason is one line, never a torch traceback ----------


def test_a_failed_dcp_save_is_said_by_its_first_ranks_own_error_in_one_line() -> None:
    """DCP's CheckpointException holds every failed rank's traceback in its text; the
    reason of a full disk shows the first rank's own error, without torch's C++ place."""
    import traceback

    from shardctl.orchestrator.durable import one_line
    from shardctl.train.checkpoint import _first_failure
    from torch.distributed.checkpoint.api import CheckpointException

    inner = RuntimeError("[enforce fail at inline_container.cc:603] . unexpected pos 64 vs 0")
    wrapped = CheckpointException("ranks:dict_keys([0])", {0: (inner, traceback.StackSummary())})
    assert "Traceback" in str(wrapped)  # what the reason used to show
    assert _first_failure(wrapped) is inner
    assert one_line(_first_failure(wrapped)) == "unexpected pos 64 vs 0"
    assert one_line(ValueError("first\n  Traceback (most recent call last):\n  x")) == "first"


# -- a diverged loss stops the run before its weights are saved ------------------------


def _diverging(tmp: Path, **train: Any) -> tuple[Path, Path]:
    """lr 10 without warm-up: the tiny model's loss leaves ln(256) ≈ 5.5 for hundreds
    within a step or two. A checkpoint after every step."""
    return single(
        tmp,
        train={"lr": 10.0, "warmup_steps": 0, "steps": 6, "log_every": 3, **train},
        checkpoint={"every_steps": 1},
    )


@pytest.mark.slow
def test_a_diverged_loss_stops_before_its_checkpoint_and_is_not_retried(tmp_path: Path) -> None:
    spec, run_dir = _diverging(tmp_path)
    line = assert_not_retried(one_rank(spec, run_dir), run_dir, "the loss diverged at step")
    step = int(line.split("diverged at step ")[1].split(":")[0])
    assert 1 < step <= 6, line
    # The step whose loss diverged is never a checkpoint; the ones before it are kept.
    saved = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert saved[-1] == f"step-{step - 1:08d}", saved
    assert f"step-{step - 1:08d} is the newest checkpoint" in line and "on_divergence" in line
    # Its metrics line shows the loss although log_every skips that step.
    lines = (run_dir / "logs" / "metrics.jsonl").read_text().splitlines()
    last = json.loads(lines[-1])
    assert last["step"] == step and last["loss"] > 10 * np.log(256), last


@pytest.mark.slow
def test_on_divergence_continue_trains_on(tmp_path: Path) -> None:
    spec, run_dir = _diverging(tmp_path, on_divergence="continue", steps=3)
    res = one_rank(spec, run_dir)
    assert res.returncode == 0, res.stdout[-4000:]
    assert (run_dir / "checkpoints" / "step-00000003").is_dir()


def test_a_nan_or_infinite_loss_has_diverged_whatever_the_vocab(tmp_path: Path) -> None:
    """Without a known vocab_size only a NaN or an infinite loss counts; with one, a
    loss above 10 × ln(vocab_size) does too."""
    from types import SimpleNamespace

    from shardctl.train.loop import Trainer

    trainer = Trainer.__new__(Trainer)
    trainer.spec = SimpleNamespace(train=SimpleNamespace(on_divergence="stop"))
    trainer.ckpt = SimpleNamespace(wait=lambda: None, storage=tmp_path)
    trainer.loss_ceiling = float("inf")
    assert trainer._diverged(3, 1e30) is None
    for loss in (float("nan"), float("inf")):
        error = trainer._diverged(3, loss)
        assert isinstance(error, PermanentError), loss
        assert "diverged at step 3" in str(error) and "no checkpoint yet" in str(error)
    trainer.loss_ceiling = 10 * float(np.log(256))
    assert trainer._diverged(3, 55.0) is None
    assert "at most 55.5" in str(trainer._diverged(3, 56.0))
    trainer.spec.train.on_divergence = "continue"
    assert trainer._diverged(3, float("nan")) is None


def test_the_llama_class_tables_are_the_installed_transformers() -> None:
    """`validate` judges strategy.wrap from tables copied from transformers: rebuilt
    here from a real LlamaForCausalLM and the activations its hidden_act may pick."""
    from helpers.train_run import TINY_LLAMA
    from shardctl.orchestrator import inputs
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.activations import ACT2CLS

    model = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA))
    activations = {(c[0] if isinstance(c, tuple) else c).__name__ for c in ACT2CLS.values()}
    found = {type(m).__name__ for m in model.modules()}
    assert found - activations == inputs.LLAMA_MODULE_CLASSES, "update LLAMA_MODULE_CLASSES"
    assert activations == inputs.LLAMA_ACTIVATION_CLASSES, "update LLAMA_ACTIVATION_CLASSES"


def test_a_wrap_list_of_the_models_classes_passes_validate(tmp_path: Path) -> None:
    result = _validate(tmp_path, {"strategy": {"wrap": ["LlamaDecoderLayer", "Embedding"]}})
    assert result.exit_code == 0, result.output

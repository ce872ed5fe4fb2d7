"""The Hugging Face Trainer integration (`shardctl.train.hf`) and its example script.

Unit tests build checkpoint folders by hand (no processes); the slow ones run
examples/hf_trainer_script.py on 2 CPU ranks under torchrun and accelerate launch,
through shardctl's runner as `submit` starts every rank of a script
(`-m shardctl.train.entry script PATH`).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers.ckpt_run import ROOT, child_env, free_port, kill_group, torchrun_argv
from safetensors.torch import save_file
from shardctl.orchestrator import proctree
from shardctl.orchestrator.rundir import EXIT_PREEMPTED
from shardctl.train.hf import (
    PreemptionCallback,
    checkpoint_problem,
    last_complete_checkpoint,
)
from transformers import TrainerControl
from transformers.trainer_utils import get_last_checkpoint

SCRIPT = ROOT / "examples" / "hf_trainer_script.py"


def make_checkpoint(out: Path, step: int, *, ranks: int = 2) -> Path:
    """The files of a complete plain-DDP Trainer checkpoint (tiny stand-ins)."""
    ckpt = out / f"checkpoint-{step}"
    ckpt.mkdir(parents=True)
    save_file({"w": torch.zeros(4)}, ckpt / "model.safetensors")
    torch.save({"state": {}}, ckpt / "optimizer.pt")
    torch.save({"last_epoch": step}, ckpt / "scheduler.pt")
    for rank in range(ranks):
        torch.save({"cpu": torch.zeros(2)}, ckpt / f"rng_state_{rank}.pth")
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    return ckpt


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


# -- last_complete_checkpoint -----------------------------------------------------------

TORN = {
    "no trainer_state.json": lambda c: (c / "trainer_state.json").unlink(),
    "half a trainer_state.json": lambda c: (c / "trainer_state.json").write_text('{"global_st'),
    "trainer_state.json of another step": lambda c: (c / "trainer_state.json").write_text(
        '{"global_step": 3}'
    ),
    "truncated model.safetensors": lambda c: truncate(c / "model.safetensors"),
    "no model weights": lambda c: (c / "model.safetensors").unlink(),
    "truncated optimizer.pt": lambda c: truncate(c / "optimizer.pt"),
    "no optimizer": lambda c: (c / "optimizer.pt").unlink(),
    "truncated rng state of rank 1": lambda c: truncate(c / "rng_state_1.pth"),
    "FSDP model folder without .metadata": lambda c: (c / "pytorch_model_fsdp_0").mkdir(),
    "DeepSpeed folder without latest": lambda c: (c / "global_step9").mkdir(),
}


@pytest.mark.parametrize("tear", TORN.values(), ids=TORN.keys())
def test_a_torn_checkpoint_is_skipped_with_a_warning(
    tmp_path: Path, tear, caplog: pytest.LogCaptureFixture
) -> None:
    good = make_checkpoint(tmp_path, 5)
    torn = make_checkpoint(tmp_path, 9)
    tear(torn)
    # transformers' own helper takes the highest number, and train() would crash on it.
    assert get_last_checkpoint(str(tmp_path)) == str(torn)
    with caplog.at_level(logging.WARNING, logger="shardctl.train.hf"):
        assert last_complete_checkpoint(tmp_path) == str(good)
    assert f"skipping torn checkpoint {torn}" in caplog.text


def test_newest_complete_checkpoint_by_step_number(tmp_path: Path) -> None:
    for step in (2, 10, 9):  # 10 > 9 although "10" < "9" as text
        make_checkpoint(tmp_path, step)
    (tmp_path / "checkpoint-11").write_text("a file, not a folder")
    (tmp_path / "checkpoint-x").mkdir()
    assert last_complete_checkpoint(tmp_path) == str(tmp_path / "checkpoint-10")


def test_none_when_there_is_nothing_to_resume(tmp_path: Path) -> None:
    assert last_complete_checkpoint(tmp_path / "missing") is None
    assert last_complete_checkpoint(tmp_path) is None
    (make_checkpoint(tmp_path, 4) / "trainer_state.json").unlink()
    assert last_complete_checkpoint(tmp_path) is None


def test_other_layouts_of_a_complete_checkpoint(tmp_path: Path) -> None:
    # FSDP SHARDED_STATE_DICT: DCP folders for model and optimizer, no optimizer.pt.
    fsdp = make_checkpoint(tmp_path, 1)
    (fsdp / "optimizer.pt").unlink()
    for name in ("pytorch_model_fsdp_0", "optimizer_0"):
        (fsdp / name).mkdir()
        (fsdp / name / ".metadata").write_bytes(b"x")
    assert checkpoint_problem(fsdp) is None
    # DeepSpeed ZeRO-3 without gathered weights: everything in global_stepN/.
    ds = make_checkpoint(tmp_path, 2)
    (ds / "model.safetensors").unlink()
    (ds / "optimizer.pt").unlink()
    (ds / "global_step2").mkdir()
    (ds / "global_step2" / "mp_rank_00_model_states.pt").write_bytes(b"x")
    (ds / "latest").write_text("global_step2")
    assert checkpoint_problem(ds) is None
    # Sharded weights: every shard the index names must be whole.
    sharded = make_checkpoint(tmp_path, 3)
    (sharded / "model.safetensors").rename(sharded / "model-00001-of-00001.safetensors")
    index = {"weight_map": {"w": "model-00001-of-00001.safetensors"}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    assert checkpoint_problem(sharded) is None
    truncate(sharded / "model-00001-of-00001.safetensors")
    assert "shard model-00001-of-00001.safetensors" in checkpoint_problem(sharded)
    # save_only_model=True: no optimizer by design.
    model_only = make_checkpoint(tmp_path, 4)
    (model_only / "optimizer.pt").unlink()
    assert "no optimizer" in checkpoint_problem(model_only)
    assert checkpoint_problem(model_only, require_optimizer=False) is None


def test_file_names_are_the_trainers() -> None:
    import accelerate.utils.constants as acc
    import transformers.trainer as tr
    from shardctl.train import hf

    assert (hf.TRAINER_STATE_NAME, hf.OPTIMIZER_NAME, hf.SCHEDULER_NAME, hf.SCALER_NAME) == (
        tr.TRAINER_STATE_NAME, tr.OPTIMIZER_NAME, tr.SCHEDULER_NAME, tr.SCALER_NAME,
    )  # fmt: skip
    assert (hf.FSDP_MODEL_PREFIX, hf.FSDP_OPTIMIZER_PREFIX) == (
        acc.FSDP_MODEL_NAME,
        acc.OPTIMIZER_NAME,
    )


# -- PreemptionCallback, one process ----------------------------------------------------


@pytest.fixture
def restore_signals():
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR2)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def _args_state(tmp_path: Path, step: int):
    args = SimpleNamespace(device=torch.device("cpu"), output_dir=str(tmp_path), process_index=0)
    state = SimpleNamespace(global_step=step, is_world_process_zero=True)
    return args, state


def test_callback_without_a_signal_changes_nothing(tmp_path: Path, restore_signals) -> None:
    before = signal.getsignal(signal.SIGTERM)
    cb = PreemptionCallback(run_dir=tmp_path)
    args, state = _args_state(tmp_path, 1)
    control = TrainerControl()
    cb.on_train_begin(args, state, control)
    assert signal.getsignal(signal.SIGTERM) != before  # caught while training
    for step in range(1, 4):
        state.global_step = step
        cb.on_step_end(args, state, control)
        cb.on_save(args, state, control)  # a regular save: no exit
    assert control == TrainerControl()
    cb.on_train_end(args, state, control)
    assert signal.getsignal(signal.SIGTERM) == before
    assert not (tmp_path / "PREEMPTED").exists()


def test_a_signal_saves_then_exits_42(tmp_path: Path, restore_signals) -> None:
    (tmp_path / "PREEMPTED").write_text('{"step": 1}')  # from the start before
    cb = PreemptionCallback(run_dir=tmp_path)
    args, state = _args_state(tmp_path, 6)
    control = TrainerControl()
    cb.on_train_begin(args, state, control)
    assert not (tmp_path / "PREEMPTED").exists()  # this start supersedes it
    os.kill(os.getpid(), signal.SIGUSR2)
    state.global_step = 7
    cb.on_step_end(args, state, control)
    assert control.should_save and control.should_training_stop
    with pytest.raises(SystemExit) as exit_:
        cb.on_save(args, state, control)
    assert exit_.value.code == EXIT_PREEMPTED
    marker = json.loads((tmp_path / "PREEMPTED").read_text())
    assert marker == {
        "kind": "preempted",
        "step": 7,
        "signal": "SIGUSR2",
        "reason": "signal SIGUSR2",
    }


def test_a_signal_after_the_last_step_is_not_held(tmp_path: Path, restore_signals) -> None:
    seen: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    cb = PreemptionCallback(run_dir=tmp_path)
    args, state = _args_state(tmp_path, 3)
    cb.on_train_begin(args, state, TrainerControl())
    os.kill(os.getpid(), signal.SIGTERM)  # during the final save, say
    cb.on_train_end(args, state, TrainerControl())
    assert seen == [signal.SIGTERM]  # the handler from before got it after all


# -- the example script, 2 CPU ranks (slow) ---------------------------------------------


def _start(argv: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=ROOT,
        start_new_session=True,
    )


def _finish(proc: subprocess.Popen, timeout: float) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        out, _ = proc.communicate()
        raise AssertionError(f"timed out after {timeout}s:\n{out[-4000:]}") from None
    return out


def _rank_pid(launcher: int, rank: int) -> int | None:
    for p in proctree.descendants(launcher):
        try:
            env = Path(f"/proc/{p.pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env and proctree.catches(p.pid, signal.SIGTERM):
            return p.pid
    return None


def _losses(out: str) -> int:
    """Steps logged by this start (rank 0 prints one dict per step)."""
    return sum(line.startswith("{'loss'") for line in out.splitlines())


# How `shardctl submit` runs a script on every rank (shardctl.train.entry records how
# it ended and leaves without C++'s exit-time teardown, where gloo's threads can abort
# a finished rank).
RUN_SCRIPT = ["-m", "shardctl.train.entry", "script", str(SCRIPT)]


def _env(run_dir: Path, **extra: str) -> dict[str, str]:
    env = child_env()
    env.pop("SHARDCTL_STOP_AFTER_STEP", None)
    env.update(SHARDCTL_RUN_DIR=str(run_dir), TOKENIZERS_PARALLELISM="false", **extra)
    return env


@pytest.mark.slow
def test_sigterm_to_one_rank_saves_on_every_rank_and_resumes(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    env = _env(run_dir)
    # Many steps, no periodic save: the only checkpoint is the preemption's.
    argv = torchrun_argv(2, *RUN_SCRIPT, "--max-steps", "2000", "--save-steps", "5000")
    proc = _start(argv, env)
    try:
        deadline = time.monotonic() + 240
        while (rank1 := _rank_pid(proc.pid, 1)) is None:  # its handler is in: training
            assert proc.poll() is None, proc.communicate()[0][-4000:]
            assert time.monotonic() < deadline, "rank 1 never started training"
            time.sleep(0.2)
        os.kill(rank1, signal.SIGTERM)  # only rank 1 hears it
        out = _finish(proc, 180)
    finally:
        kill_group(proc)
    assert proc.returncode != 0, out[-3000:]  # torchrun turns the ranks' 42 into 1
    assert "rank 0: exiting with code 42" in out and "rank 1: exiting with code 42" in out
    codes = [line.split(":")[1].split()[0] for line in out.splitlines() if "exitcode  :" in line]
    assert codes and set(codes) == {str(EXIT_PREEMPTED)}, out[-3000:]
    marker = json.loads((run_dir / "PREEMPTED").read_text())
    step = marker["step"]
    assert marker["reason"] == "signal SIGTERM" and 1 <= step < 2000
    ckpt = run_dir / "checkpoints" / f"checkpoint-{step}"
    assert checkpoint_problem(ckpt) is None, checkpoint_problem(ckpt)
    assert {"rng_state_0.pth", "rng_state_1.pth"} <= {p.name for p in ckpt.iterdir()}
    assert last_complete_checkpoint(run_dir / "checkpoints") == str(ckpt)

    # The next start continues at that step: 3 more steps, then a normal finish.
    argv = torchrun_argv(2, *RUN_SCRIPT, "--max-steps", str(step + 3), "--save-steps", "5000")
    out = _finish(_start(argv, env), 240)
    assert f"resuming from {ckpt}" in out, out[-3000:]
    assert _losses(out) == 3 and f"finished at step {step + 3}" in out, out[-3000:]
    assert not (run_dir / "PREEMPTED").exists()
    final = json.loads(
        (run_dir / "checkpoints" / f"checkpoint-{step + 3}" / "trainer_state.json").read_text()
    )
    logged = [h["step"] for h in final["log_history"] if "loss" in h]
    assert logged == list(range(1, step + 4))  # the first start's steps, then 3 more


ACCELERATE = [
    str(Path(sys.executable).parent / "accelerate"), "launch",
    # No GPU here: --multi_gpu is what starts 2 ranks (through torchrun; they find
    # no GPU and form a gloo group). `--cpu --num_processes 2` starts ONE process.
    "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
    "--mixed_precision", "no", "--dynamo_backend", "no",
]  # fmt: skip


@pytest.mark.slow
def test_accelerate_launch_finishes_without_a_signal(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    argv = [*ACCELERATE, "--main_process_port", str(free_port()), *RUN_SCRIPT,
            "--max-steps", "4", "--save-steps", "2"]  # fmt: skip
    proc = _start(argv, _env(run_dir))
    out = _finish(proc, 240)
    assert proc.returncode == 0, out[-3000:]
    assert "starting from scratch" in out and _losses(out) == 4, out[-3000:]
    ckpt = run_dir / "checkpoints" / "checkpoint-4"
    assert checkpoint_problem(ckpt) is None
    assert (ckpt / "rng_state_1.pth").exists()  # two ranks, not one
    assert not (run_dir / "PREEMPTED").exists()


@pytest.mark.slow
def test_accelerate_launch_preempted_exits_42_on_every_rank(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    argv = [*ACCELERATE, "--main_process_port", str(free_port()), *RUN_SCRIPT,
            "--max-steps", "20", "--save-steps", "100"]  # fmt: skip
    proc = _start(argv, _env(run_dir, SHARDCTL_STOP_AFTER_STEP="2"))
    out = _finish(proc, 240)
    assert proc.returncode != 0, out[-3000:]  # accelerate, like torchrun, says 1
    assert "rank 0: exiting with code 42" in out and "rank 1: exiting with code 42" in out
    assert json.loads((run_dir / "PREEMPTED").read_text())["step"] == 2
    assert checkpoint_problem(run_dir / "checkpoints" / "checkpoint-2") is None

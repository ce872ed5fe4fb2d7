"""`shardctl.train.api`, the library for a user's own training script.

One process: configuration from the run contract (and without it), a plain module's
save/resume (weights, optimizer, per-rank state, RNG), a torn newest checkpoint skipped.
Two ranks (slow): examples/fsdp2_script.py stopped at step K resumes at K and ends
bit-exact with an uninterrupted run; a signal to ONE rank stops every rank at the same
step with a checkpoint, the PREEMPTED marker and exit 42 on every rank.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers.ckpt_run import ROOT, child_env, free_port, kill_group, run, torchrun_argv
from helpers.train_run import tiny_spec
from shardctl.orchestrator.errors import UsageError
from shardctl.orchestrator.rundir import CONTRACT_ENV, EXIT_PREEMPTED
from shardctl.train import api

EXAMPLE = ROOT / "examples" / "fsdp2_script.py"
WORKER = ROOT / "tests" / "helpers" / "api_worker.py"


@pytest.fixture(autouse=True)
def _no_contract_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in CONTRACT_ENV:
        monkeypatch.delenv(name, raising=False)


def _sub_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in child_env().items() if k not in CONTRACT_ENV}
    return {**env, **extra}


# ------------------------------------------------------------------ configuration


def test_from_env_without_the_contract_needs_a_directory(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="SHARDCTL_CHECKPOINT_DIR"):
        api.Checkpointer.from_env()
    before = signal.getsignal(signal.SIGTERM)
    with api.Checkpointer.from_env(default_directory=tmp_path / "d") as ckpt:
        assert signal.getsignal(signal.SIGTERM) != before  # installed while it lives
        assert ckpt.config == api.CheckpointConfig(dir=str(tmp_path / "d"))
        assert (ckpt.config.every_steps, ckpt.config.keep, ckpt.config.resume) == (100, 3, "auto")
        assert ckpt.run_dir is None and ckpt.env == api.RunEnv()
    assert signal.getsignal(signal.SIGTERM) == before  # close() put it back
    ckpt = api.Checkpointer.from_env(
        directory=tmp_path / "x", default_directory="unused", every_steps=5, install_signals=False
    )
    assert (ckpt.config.dir, ckpt.config.every_steps) == (str(tmp_path / "x"), 5)
    with pytest.raises(UsageError, match="keep=1"):
        api.Checkpointer.from_env(directory=tmp_path, keep=1, install_signals=False)


def test_from_env_reads_the_contract_and_arguments_win(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = tiny_spec(
        tmp_path,
        "job",
        checkpoint={"every_steps": 3, "keep": 4, "async": True, "resume": "never"},
    )
    monkeypatch.setenv("SHARDCTL_SPEC", str(spec))
    # Without SHARDCTL_CHECKPOINT_DIR the spec's folder and run dir are used.
    ckpt = api.Checkpointer.from_env(install_signals=False)
    assert ckpt.config == api.CheckpointConfig(
        dir=str(tmp_path / "job" / "checkpoints"),
        every_steps=3,
        keep=4,
        async_save=True,
        resume="never",
    )
    assert ckpt.run_dir is not None and ckpt.run_dir.root == tmp_path / "job"
    assert ckpt.strategy == api.Strategy("full_shard", 3, "bf16-mixed")

    monkeypatch.setenv("SHARDCTL_CHECKPOINT_DIR", str(tmp_path / "scratch"))
    monkeypatch.setenv("SHARDCTL_RUN_DIR", str(tmp_path / "run"))
    monkeypatch.setenv("SHARDCTL_JOB_NAME", "job")
    monkeypatch.setenv("SHARDCTL_ATTEMPT", "2")
    ckpt = api.Checkpointer.from_env(every_steps=7, install_signals=False)
    assert ckpt.config.dir == str(tmp_path / "scratch")  # the environment beats the spec
    assert (ckpt.config.every_steps, ckpt.config.keep) == (7, 4)  # the argument beats both
    assert ckpt.run_dir is not None and ckpt.run_dir.root == tmp_path / "run"
    assert (ckpt.env.job_name, ckpt.env.attempt) == ("job", 2)


# ------------------------------------------------------------------ one process


class Counter:
    """A per-rank Stateful: how many samples this rank consumed."""

    def __init__(self) -> None:
        self.seen = 0

    def state_dict(self) -> dict[str, int]:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.seen = state["seen"]


def _model(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, counter: Counter) -> None:
    model(torch.randn(3, 4)).pow(2).mean().backward()  # consumes the RNG the library saves
    opt.step()
    opt.zero_grad()
    counter.seen += 3


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_plain_module_saves_and_resumes_in_one_process(tmp_path: Path) -> None:
    conf = api.CheckpointConfig(dir=str(tmp_path / "ck"), every_steps=2, keep=2)
    model, opt = _model(seed=1)
    counter = Counter()
    ckpt = api.Checkpointer(conf, run_dir=tmp_path / "run", install_signals=False)
    with pytest.raises(UsageError, match="before resume"):
        ckpt.step_done(1)
    assert ckpt.resume(api.model_state(model, opt), per_rank={"data": counter}) == 0
    saved = []
    for step in range(1, 6):
        _train_step(model, opt, counter)
        saved.append(ckpt.step_done(step))
    assert saved == [False, True, False, True, False]
    ckpt.finish(5)
    assert json.loads((tmp_path / "run" / "DONE").read_text())["step"] == 5
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["step-00000004", "step-00000005"]
    weights, opt_state, next_draw = _snapshot(model), opt.state_dict(), torch.rand(4)

    model2, opt2 = _model(seed=2)  # other weights, empty optimizer state
    counter2 = Counter()
    ckpt2 = api.Checkpointer(conf, install_signals=False)
    assert ckpt2.resume(api.model_state(model2, opt2), per_rank={"data": counter2}) == 5
    ckpt2.close()
    assert counter2.seen == 15
    assert torch.equal(torch.rand(4), next_draw)  # this rank's RNG continues where it was
    for key, value in _snapshot(model2).items():
        assert torch.equal(value, weights[key]), key
    state2 = opt2.state_dict()["state"]
    for pid, entry in opt_state["state"].items():
        for name, value in entry.items():
            assert torch.equal(state2[pid][name], value), (pid, name)


def test_torn_newest_checkpoint_is_skipped_on_resume(tmp_path: Path) -> None:
    conf = api.CheckpointConfig(dir=str(tmp_path), every_steps=2, keep=3)
    model, opt = _model(seed=1)
    ckpt = api.Checkpointer(conf, install_signals=False)
    ckpt.resume(api.model_state(model, opt))
    snapshots = {}
    for step in range(1, 5):
        _train_step(model, opt, Counter())
        ckpt.step_done(step)
        snapshots[step] = _snapshot(model)
    ckpt.close()
    # step 4: one flipped byte in the tensor data; step 6: a save that never finished.
    shard = next((tmp_path / "step-00000004" / "dcp").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    (tmp_path / "step-00000006.tmp" / "dcp").mkdir(parents=True)

    model2, opt2 = _model(seed=2)
    ckpt2 = api.Checkpointer(conf, install_signals=False)
    assert ckpt2.resume(api.model_state(model2, opt2)) == 2
    for key, value in _snapshot(model2).items():
        assert torch.equal(value, snapshots[2][key]), key
    _train_step(model2, opt2, Counter())
    ckpt2.step_done(3)
    _train_step(model2, opt2, Counter())
    assert ckpt2.step_done(4)  # replaces the corrupt step 4; the .tmp leftover goes
    ckpt2.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000002", "step-00000004"]


# ------------------------------------------------------------------ two ranks


def _final_state(step_dir: Path, tmp: Path) -> dict[str, torch.Tensor]:
    """A DCP checkpoint as one flat dict of tensors, read in this process."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp / f"{step_dir.parent.name}.pt"
    dcp_to_torch_save(step_dir / "dcp", out)
    flat: dict[str, torch.Tensor] = {}

    def walk(prefix: str, obj: object) -> None:
        if isinstance(obj, dict):
            for k, v in obj.items():
                walk(f"{prefix}.{k}", v)
        elif isinstance(obj, torch.Tensor):
            flat[prefix] = obj

    walk("", torch.load(out, weights_only=False))
    return flat


@pytest.mark.slow
def test_example_stopped_at_k_resumes_at_k_bit_exact(tmp_path: Path) -> None:
    args = ("--steps", "12", "--every-steps", "4", "--log-every", "1")

    def example(name: str, **env: str) -> subprocess.CompletedProcess:
        extra = {"SHARDCTL_RUN_DIR": str(tmp_path / name), **env}
        ck = str(tmp_path / name / "checkpoints")
        argv = torchrun_argv(2, EXAMPLE, *args, "--checkpoint-dir", ck)
        return run(argv, timeout=240, env=_sub_env(**extra))

    whole = example("whole")
    assert whole.returncode == 0, whole.stdout[-4000:]
    stopped = example("stopped", SHARDCTL_STOP_AFTER_STEP="6")
    assert stopped.returncode != 0, stopped.stdout[-4000:]  # torchrun turns 42 into 1
    assert f"saved step 6; exiting with code {EXIT_PREEMPTED}" in stopped.stdout
    assert stopped.stdout.count("exitcode: 42") in (1, 2), stopped.stdout[-4000:]
    marker = json.loads((tmp_path / "stopped" / "PREEMPTED").read_text())
    assert marker["step"] == 6 and "SHARDCTL_STOP_AFTER_STEP" in marker["reason"]
    assert "step 7 loss" not in stopped.stdout

    resumed = example("stopped")
    assert resumed.returncode == 0, resumed.stdout[-4000:]
    assert "resumed at step 6" in resumed.stdout and "step 6 loss" not in resumed.stdout
    assert not (tmp_path / "stopped" / "PREEMPTED").exists()
    assert json.loads((tmp_path / "stopped" / "DONE").read_text())["step"] == 12
    a = _final_state(tmp_path / "whole" / "checkpoints" / "step-00000012", tmp_path)
    b = _final_state(tmp_path / "stopped" / "checkpoints" / "step-00000012", tmp_path)
    assert a.keys() == b.keys() and any(k.startswith(".optim.state") for k in a)
    for key in a:
        assert torch.equal(a[key], b[key]), key


def _start_ranks(
    tmp_path: Path, out: Path, world: int = 2, extra_env: dict[str, str] | None = None
) -> list[subprocess.Popen]:
    """The ranks as torchrun would start them (same variables), but each one our own
    child: its exit code is its own, not the launcher's summary."""
    port = str(free_port())
    procs = []
    for rank in range(world):
        env = _sub_env(
            RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
            LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
            SHARDCTL_RUN_DIR=str(tmp_path / "run"),
            SHARDCTL_CHECKPOINT_DIR=str(tmp_path / "run" / "checkpoints"),
            **(extra_env or {}),
        )  # fmt: skip
        log = open(out / f"log-{rank}.txt", "w")  # noqa: SIM115 (closed with the process)
        procs.append(
            subprocess.Popen(
                [sys.executable, str(WORKER), "--out", str(out)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=ROOT,
                start_new_session=True,
            )
        )
        log.close()
    return procs


def rank_logs(out: Path) -> str:
    """The end of each rank's log (in `out`), for a failure message."""
    return "\n".join(p.read_text()[-3000:] for p in sorted(out.glob("log-*")))


def stopped_steps(procs: list[subprocess.Popen], out: Path, stop: Callable[[], None]) -> set[int]:
    """`stop` the ranks (wait for them, signal some); every one must then exit
    EXIT_PREEMPTED. Returns the steps they recorded in `out`. Each rank's process group
    is killed on leaving, whatever happened."""
    try:
        stop()
        codes = [p.wait(timeout=120) for p in procs]
    finally:
        for p in procs:
            with contextlib.suppress(Exception):
                kill_group(p)
    assert codes == [EXIT_PREEMPTED] * len(procs), rank_logs(out)
    return {json.loads((out / f"rank-{r}.json").read_text())["step"] for r in range(len(procs))}


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR2], ids=["SIGTERM", "SIGUSR2"])
def test_signal_to_one_rank_stops_every_rank_at_the_same_step(
    tmp_path: Path, sig: signal.Signals
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    procs = _start_ranks(tmp_path, out)

    def signal_rank_1() -> None:
        deadline = time.monotonic() + 180
        while not all((out / f"started-{r}").exists() for r in range(2)):
            assert all(p.poll() is None for p in procs), rank_logs(out)
            assert time.monotonic() < deadline, "the ranks never got going\n" + rank_logs(out)
            time.sleep(0.1)
        os.kill(procs[1].pid, sig)  # only rank 1 hears it

    steps = stopped_steps(procs, out, signal_rank_1)
    assert len(steps) == 1, steps  # every rank stopped after the same step
    step = steps.pop()
    marker = json.loads((tmp_path / "run" / "PREEMPTED").read_text())
    assert marker == {
        "kind": "preempted",
        "step": step,
        "signal": sig.name,
        "reason": f"signal {sig.name}",
    }
    ckpt = tmp_path / "run" / "checkpoints" / f"step-{step:08d}"
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert (manifest["step"], manifest["world_size"]) == (step, 2)
    assert {"train_state/rank-00000.pt", "train_state/rank-00001.pt"} <= set(manifest["files"])


@pytest.mark.slow
def test_deepspeed_engine_stop_and_resume_is_bit_exact(tmp_path: Path) -> None:
    import deepspeed  # noqa: F401  (a dev dependency: missing, the test fails, never skips)

    script = ROOT / "tests" / "helpers" / "api_deepspeed.py"

    def ds(name: str, **env: str) -> subprocess.CompletedProcess:
        argv = [sys.executable, str(script), "--dir", str(tmp_path / name)]
        argv += ["--out", str(tmp_path / f"{name}.pt")]
        one_rank = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}  # DeepSpeed wants them
        return run(argv, timeout=240, env=_sub_env(**one_rank, **env))

    assert ds("whole").returncode == 0
    stopped = ds("stopped", SHARDCTL_STOP_AFTER_STEP="3")
    assert stopped.returncode == EXIT_PREEMPTED, stopped.stdout[-4000:]
    manifest = json.loads((tmp_path / "stopped" / "step-00000003" / "manifest.json").read_text())
    assert (manifest["backend"], manifest["zero_stage"]) == ("deepspeed", 1)
    resumed = ds("stopped")
    assert resumed.returncode == 0 and "resumed at step 3" in resumed.stdout, resumed.stdout[-4000:]
    a, b = (torch.load(tmp_path / f"{n}.pt") for n in ("whole", "stopped"))
    assert all(torch.equal(a[k], b[k]) for k in a)

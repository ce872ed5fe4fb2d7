"""The memory tier (`checkpoint.memory_every_steps`): copies in node-local memory every
K steps, restored when newer than the newest durable checkpoint and verified.

Every test puts the tier in its own tmp folder, never the real /dev/shm path.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers.ckpt_run import ROOT, child_env, kill_group
from helpers.train_run import assert_bit_equal, final_weights, loop_argv, tiny_spec, train_ok
from shardctl.orchestrator.errors import SpecError, UsageError
from shardctl.orchestrator.rundir import CONTRACT_ENV
from shardctl.orchestrator.spec import load_spec
from shardctl.train import api
from shardctl.train.memory_tier import default_memory_dir, room_problem


@pytest.fixture(autouse=True)
def _no_contract_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in CONTRACT_ENV:
        monkeypatch.delenv(name, raising=False)


def _restores(run_dir: Path) -> list[dict]:
    path = run_dir / "logs" / "restores.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


# ------------------------------------------------------------------ the spec


def _spec_error(tmp_path: Path, **checkpoint: object) -> str:
    path = tiny_spec(tmp_path, "bad", checkpoint=checkpoint)
    with pytest.raises(SpecError) as info:
        load_spec(path)
    return str(info.value)


def test_memory_interval_not_below_the_durable_one_is_refused(tmp_path: Path) -> None:
    text = _spec_error(tmp_path, every_steps=4, memory_every_steps=4)
    assert "checkpoint.memory_every_steps (4) is not smaller than checkpoint.every_steps (4)" in (
        text
    )
    assert "accepted: 1..3" in text


@pytest.mark.parametrize("value", [0, -2, 2.5, 1e30, "3", True])
def test_memory_interval_bad_values_get_the_usual_errors(tmp_path: Path, value: object) -> None:
    text = _spec_error(tmp_path, every_steps=4, memory_every_steps=value)
    assert "checkpoint.memory_every_steps" in text
    assert "Traceback" not in text


def test_default_folder_is_per_run_under_dev_shm(tmp_path: Path) -> None:
    a = default_memory_dir("job", tmp_path / "a")
    b = default_memory_dir("job", tmp_path / "b")
    assert a.parent == Path("/dev/shm/shardctl") and a.name.startswith("job-")
    assert a != b  # two runs of the same name never share copies


def test_a_tmpfs_too_small_names_both_sizes(tmp_path: Path) -> None:
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    problem = room_problem(tmp_path, free)  # two copies of all the free space: no room
    assert problem is not None and " free, but the memory tier needs about " in problem
    assert room_problem(tmp_path, 1024) is None


def test_a_memory_dir_that_is_or_lies_under_a_file_is_one_line(tmp_path: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("the user's")
    for where in (afile, afile / "below"):
        problem = room_problem(where, 1024)
        assert problem == (
            f"checkpoint.memory_dir {str(where)!r}: {str(afile)!r} is a file, not a folder; "
            "accepted: a folder this user may write on a tmpfs (unset: /dev/shm/shardctl/...)"
        )
    assert afile.read_text() == "the user's"


# ------------------------------------------------------------ a user's script


class Counter:
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


def _steps(ckpt: api.Checkpointer, model, opt, counter: Counter, steps: range) -> dict:
    for step in steps:
        model(torch.randn(3, 4)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        counter.seen += 3
        ckpt.step_done(step)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _two_tiers(durable: Path, memory: Path) -> api.CheckpointConfig:
    """The Checkpointer tests' configuration: durable every 4 steps, memory every 3."""
    return api.CheckpointConfig(
        dir=str(durable), every_steps=4, keep=2, memory_every_steps=3, memory_dir=str(memory)
    )


def test_checkpointer_resumes_from_the_memory_copy_newer_than_disk(tmp_path: Path) -> None:
    memory = tmp_path / "mem"
    conf = _two_tiers(tmp_path / "ck", memory)
    model, opt = _model(1)
    ckpt = api.Checkpointer(conf, run_dir=tmp_path / "run", install_signals=False)
    ckpt.resume(api.model_state(model, opt), per_rank={"data": Counter()})
    weights = _steps(ckpt, model, opt, Counter(), range(1, 7))
    ckpt.close()  # the process "dies" after step 6: disk has step 4, memory step 6
    assert [p.name for p in (tmp_path / "ck").iterdir()] == ["step-00000004"]
    assert [p.name for p in memory.iterdir()] == ["step-00000006"]  # only the newest

    model2, opt2 = _model(2)
    counter = Counter()
    ckpt2 = api.Checkpointer(conf, run_dir=tmp_path / "run", install_signals=False)
    assert ckpt2.resume(api.model_state(model2, opt2), per_rank={"data": counter}) == 6
    ckpt2.close()
    for key, value in model2.state_dict().items():
        assert torch.equal(value, weights[key]), key
    assert _restores(tmp_path / "run")[-1]["tier"] == "memory"
    assert _restores(tmp_path / "run")[-1]["step"] == 6


def test_a_corrupt_memory_copy_is_refused_and_the_durable_tier_serves(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    memory = tmp_path / "mem"
    conf = _two_tiers(tmp_path / "ck", memory)
    model, opt = _model(1)
    ckpt = api.Checkpointer(conf, run_dir=tmp_path / "run", install_signals=False)
    ckpt.resume(api.model_state(model, opt))
    at_4 = _steps(ckpt, model, opt, Counter(), range(1, 5))
    _steps(ckpt, model, opt, Counter(), range(5, 7))
    ckpt.close()
    shard = next((memory / "step-00000006" / "dcp").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte
    shard.write_bytes(bytes(data))

    model2, opt2 = _model(2)
    ckpt2 = api.Checkpointer(conf, run_dir=tmp_path / "run", install_signals=False)
    with caplog.at_level("WARNING"):
        assert ckpt2.resume(api.model_state(model2, opt2)) == 4
    ckpt2.close()
    assert "the memory copy of step 6 failed verification" in caplog.text
    assert "sha256" in caplog.text
    for key, value in model2.state_dict().items():
        assert torch.equal(value, at_4[key]), key
    last = _restores(tmp_path / "run")[-1]
    assert (last["tier"], last["step"]) == ("durable", 4)
    assert "failed verification" in last["refused"]


def test_checkpointer_memory_interval_checked(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match=r"memory_every_steps=4; accepted: an integer from 1"):
        api.CheckpointConfig(dir=str(tmp_path), every_steps=4, memory_every_steps=4)


# ------------------------------------------------- the built-in loop, 2 ranks


def _rank_pid(launcher: subprocess.Popen, rank: int) -> int:
    import psutil

    for child in psutil.Process(launcher.pid).children(recursive=True):
        try:
            if child.environ().get("RANK") == str(rank) and "shardctl.train" in child.cmdline():
                return child.pid
        except psutil.NoSuchProcess:
            continue
    raise AssertionError(f"no rank {rank} below the launcher")


def _wait_for(paths: list[Path], proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        assert proc.poll() is None, f"the run ended first: {proc.communicate()[0][-4000:]}"
        assert time.monotonic() < deadline, f"not held at the step within {timeout} s"
        time.sleep(0.1)


def _kill_rank_1_when_held(
    spec: Path, step: int, hold: Path, ready: list[Path], then: Callable[[], None]
) -> None:
    """Run SPEC until every rank is held at `step`'s agreement and `ready` exist, call
    `then`, SIGKILL rank 1; return once the launcher ended (with a failure)."""
    hold.mkdir()
    env = {**child_env(), "SHARDCTL_HOLD_AT_STEP": f"{step}:{hold}"}
    proc = subprocess.Popen(
        loop_argv(spec), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=env, cwd=ROOT, start_new_session=True,
    )  # fmt: skip
    try:
        _wait_for([hold / "held-0", hold / "held-1", *ready], proc, timeout=300)
        then()
        os.kill(_rank_pid(proc, 1), signal.SIGKILL)
        out, _ = proc.communicate(timeout=120)
    finally:
        kill_group(proc)
    assert proc.returncode != 0, out[-3000:]


@pytest.mark.slow
def test_rank_killed_three_steps_after_a_memory_copy_resumes_from_it(tmp_path: Path) -> None:
    """Memory copy at step 4 (K=4, durable every 8), rank 1 SIGKILLed at step 7: the
    restart resumes at step 4 from memory and ends bit-identical to a run restored from
    the same step-4 folder on disk (memory tier off: nothing written to its folder)."""
    memory = tmp_path / "tier"
    train = {"steps": 10, "log_every": 1}
    spec = tiny_spec(
        tmp_path, "mem", train=train,
        checkpoint={"every_steps": 8, "memory_every_steps": 4, "memory_dir": str(memory)},
    )  # fmt: skip
    disk = tmp_path / "disk" / "checkpoints"

    def copy_to_disk() -> None:  # the copy to restore from on disk, taken while held
        disk.mkdir(parents=True)
        shutil.copytree(memory / "step-00000004", disk / "step-00000004")

    # Held at step 7, and the copy of step 4 (written behind training) committed.
    committed = memory / "step-00000004" / "manifest.json"
    _kill_rank_1_when_held(spec, 7, tmp_path / "hold", [committed], copy_to_disk)
    assert not (tmp_path / "mem" / "checkpoints").exists()  # no durable step reached

    again = train_ok(spec).stdout
    assert "resumed at step 4 (from memory: checkpoint verified" in again
    last = _restores(tmp_path / "mem")[-1]
    assert (last["tier"], last["step"]) == ("memory", 4)
    assert last["lost_steps"] < 4  # steps 5 and 6 logged, then lost: fewer than K
    assert not memory.exists()  # finished: the final durable step is newer, memory freed

    off = tmp_path / "mem-off"
    reference = tiny_spec(
        tmp_path, "disk", train=train,
        checkpoint={"every_steps": 8, "memory_dir": str(off), "dir": str(disk)},
    )  # fmt: skip
    assert "resumed at step 4 (from durable: checkpoint verified" in train_ok(reference).stdout
    assert not off.exists()  # memory tier off: nothing written to its folder

    from_memory = final_weights(tmp_path / "mem" / "checkpoints" / "step-00000010", tmp_path / "a")
    from_disk = final_weights(disk / "step-00000010", tmp_path / "b")
    assert_bit_equal(from_memory, from_disk)


# ------------------------------------------------------------------ status


def test_status_says_which_tier_served_and_the_steps_lost(tmp_path: Path) -> None:
    from click.testing import CliRunner
    from shardctl.orchestrator.cli import cli
    from shardctl.orchestrator.clusters.base import JobRef
    from shardctl.orchestrator.clusters.records import remember

    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    (run / "local.exit").write_text("0\n")
    (run / "logs" / "restores.jsonl").write_text(
        '{"step": 8, "tier": "durable", "lost_steps": 5, "refused": null}\n'
        '{"step": 12, "tier": "memory", "lost_steps": 3, "refused": null}\n'
    )
    remember(JobRef("local", "9", "tiers", str(run), {"attempt": 1}))
    res = CliRunner().invoke(cli, ["status", "tiers"])
    assert res.exit_code == 0, res.output
    assert "restored from memory at step 12 (3 steps lost)" in res.output
    res = CliRunner().invoke(cli, ["status", "tiers", "-o", "json"])
    restore = json.loads(res.stdout)["restore"]
    assert (restore["tier"], restore["step"], restore["lost_steps"]) == ("memory", 12, 3)


def test_finish_frees_the_memory_copies(tmp_path: Path) -> None:
    memory = tmp_path / "mem"
    conf = api.CheckpointConfig(
        dir=str(tmp_path / "ck"), every_steps=4, keep=2, memory_every_steps=2,
        memory_dir=str(memory),
    )  # fmt: skip
    memory.mkdir()
    (memory / "notes.txt").write_text("the user's\n")  # a folder the user named
    (memory / "draft.tmp").write_text("the user's too\n")
    model, opt = _model(1)
    ckpt = api.Checkpointer(conf, install_signals=False)
    ckpt.resume(api.model_state(model, opt))
    _steps(ckpt, model, opt, Counter(), range(1, 7))
    assert any(p.name.startswith("step-00000006") for p in memory.iterdir())  # maybe in flight
    ckpt.finish(6)  # the durable step 6 is as new: the copy goes, the user's files stay
    assert sorted(p.name for p in memory.iterdir()) == ["draft.tmp", "notes.txt"]
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["step-00000004", "step-00000006"]


def test_a_tmpfs_too_small_stops_before_the_first_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from shardctl.train import memory_tier

    monkeypatch.setattr(memory_tier, "free_bytes", lambda path: 1000)  # a 1000-byte tmpfs
    conf = api.CheckpointConfig(
        dir=str(tmp_path / "ck"), every_steps=4, memory_every_steps=2,
        memory_dir=str(tmp_path / "mem"),
    )  # fmt: skip
    model, opt = _model(1)
    ckpt = api.Checkpointer(conf, install_signals=False)
    with pytest.raises(api.DoNotRetry) as info:
        ckpt.resume(api.model_state(model, opt))
    ckpt.close()
    # 58 parameters of 4 bytes, 3 times (AdamW's two moments): 696 bytes a copy, twice.
    assert "1000 bytes free, but the memory tier needs about 1.4 KiB (2 copies of 696 bytes" in (
        info.value.reason
    )
    assert "checkpoint.memory_dir" in info.value.reason
    assert not (tmp_path / "mem").exists()


def test_copies_of_a_deleted_run_dir_are_not_taken_for_a_new_run(tmp_path: Path) -> None:
    memory, run = tmp_path / "mem", tmp_path / "run"
    conf = _two_tiers(run / "ck", memory)
    model, opt = _model(1)
    ckpt = api.Checkpointer(conf, run_dir=run, install_signals=False)
    ckpt.resume(api.model_state(model, opt))
    _steps(ckpt, model, opt, Counter(), range(1, 4))
    ckpt.close()  # a crash after step 3: its copy stays in memory
    assert [p.name for p in memory.iterdir()] == ["step-00000003"]
    shutil.rmtree(run)  # the user starts over: same name, same run dir, same memory folder

    model2, opt2 = _model(2)
    ckpt2 = api.Checkpointer(conf, run_dir=run, install_signals=False)
    assert ckpt2.resume(api.model_state(model2, opt2)) == 0  # from scratch, not step 3
    ckpt2.close()
    assert not memory.exists()


@pytest.mark.slow
def test_a_corrupt_memory_copy_in_the_loop_falls_back_to_disk(tmp_path: Path) -> None:
    """Durable step 3, memory copy of step 4 with one flipped byte: the restart says the
    copy failed verification and resumes at step 3 from the durable tier."""
    memory = tmp_path / "tier"
    spec = tiny_spec(
        tmp_path, "bad", train={"steps": 6},
        checkpoint={"every_steps": 3, "memory_every_steps": 2, "memory_dir": str(memory)},
    )  # fmt: skip
    committed = memory / "step-00000004" / "manifest.json"
    _kill_rank_1_when_held(spec, 5, tmp_path / "hold", [committed], lambda: None)
    shard = next((memory / "step-00000004" / "dcp").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))

    out = train_ok(spec).stdout
    assert "the memory copy of step 4 failed verification" in out
    assert "sha256" in out
    assert "resumed at step 3 (from durable: checkpoint verified" in out
    last = _restores(tmp_path / "bad")[-1]
    assert (last["tier"], last["step"]) == ("durable", 3)


def test_validate_says_the_memory_tier(tmp_path: Path) -> None:
    from click.testing import CliRunner
    from shardctl.orchestrator.cli import cli

    path = tiny_spec(
        tmp_path, "said",
        checkpoint={"every_steps": 4, "memory_every_steps": 2, "memory_dir": str(tmp_path / "m")},
    )  # fmt: skip
    res = CliRunner().invoke(cli, ["validate", str(path)])
    assert res.exit_code == 0, res.output
    assert f"(+ a copy in memory every 2 steps, in {tmp_path / 'm'})" in res.output


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_restart_in_place_resumes_from_memory_and_status_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`shardctl submit` on this machine (the supervisor, attempt tokens and fencing):
    rank 1 SIGKILLed once a memory copy exists and before the first durable checkpoint;
    the supervisor restarts every rank, which resume from memory; `status` says so."""
    from click.testing import CliRunner
    from helpers.local_run import rank_pids, release, status, wait_for
    from shardctl.orchestrator.cli import cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    memory = tmp_path / "tier"
    spec = tiny_spec(
        tmp_path, "inplace", train={"steps": 200, "log_every": 1},
        checkpoint={"every_steps": 180, "memory_every_steps": 4, "memory_dir": str(memory)},
        restart={"max_in_allocation": 1},
    )  # fmt: skip
    run_dir = tmp_path / "inplace"
    res = CliRunner().invoke(cli, ["submit", str(spec)])
    assert res.exit_code == 0, res.output
    try:
        wait_for("a memory copy", lambda: any(memory.glob("step-*/manifest.json")), 400)
        os.kill(rank_pids(run_dir, 0, restart=0)[1], signal.SIGKILL)
        wait_for("the end", lambda: status("inplace")["state"] != "RUNNING", 600)
    finally:
        release([], "inplace")
    st = status("inplace")
    out = (run_dir / "logs" / "launcher.out").read_text()
    assert st["state"] == "SUCCEEDED", (st, out[-3000:])
    assert "(from memory: checkpoint verified" in out, out[-3000:]
    assert st["restore"]["tier"] == "memory" and st["restore"]["step"] % 4 == 0
    text = CliRunner().invoke(cli, ["status", "inplace"]).output
    assert f"restored from memory at step {st['restore']['step']} (" in text

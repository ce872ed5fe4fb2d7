"""Your own training script through `shardctl submit`: arguments, the run contract,
and how its exit becomes the job's state (real torchrun, 2 ranks, this machine)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.train_run import script_spec
from shardctl.orchestrator.errors import SpecError
from shardctl.orchestrator.spec import load_spec, parse_spec, with_command

ROOT = Path(__file__).resolve().parent.parent
CODE = ROOT / "tests" / "data" / "usercode"
SHARDCTL = str(Path(sys.executable).parent / "shardctl")
HOSTILE_ARGS = [
    "--lr", "1e-3", "it's \"quoted\"", "$(touch PWNED)", "`id`", "a\nb", "tab\there",
    "ünïcødé ✓", "", "--", "*", "~", "$HOME",
]  # fmt: skip


def _submit(tmp_path: Path, spec: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [SHARDCTL, "submit", str(spec), "--wait", *extra],
        capture_output=True, text=True, timeout=240, cwd=tmp_path, start_new_session=True,
    )  # fmt: skip


def _status(name: str) -> str:
    out = subprocess.run(
        [SHARDCTL, "status", name], capture_output=True, text=True, timeout=60, check=True
    )
    return out.stdout


def test_a_relative_script_is_taken_from_the_spec_files_folder(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "train.py").write_text("print('hi')\n")
    spec = tmp_path / "sub" / "job.yaml"
    spec.write_text("name: rel\nentrypoint: {script: train.py}\n")
    assert load_spec(spec).entrypoint.script == str(tmp_path / "sub" / "train.py")


def test_the_command_after_double_dash_replaces_the_workload(tmp_path: Path) -> None:
    spec = load_spec(ROOT / "examples" / "tiny-llama.yaml")
    mod = with_command(spec, ["-m", "mypkg.train", "--x", "1"])
    assert mod.train is None and mod.entrypoint.module == "mypkg.train"
    assert mod.entrypoint.args == ["--x", "1"] and mod.resources == spec.resources
    with pytest.raises(SpecError, match="-m needs a module name"):
        with_command(spec, ["-m"])
    script = with_command(spec, ["train.py"])
    assert Path(script.entrypoint.script).is_absolute()
    assert with_command(spec, []) is spec
    with pytest.raises(SpecError):
        parse_spec({"name": "x", "entrypoint": {"module": "1bad"}})


@pytest.mark.slow
def test_hostile_args_and_the_run_contract_reach_every_rank(tmp_path: Path) -> None:
    spec = script_spec(tmp_path, "args", {"script": str(CODE / "train.py"), "args": HOSTILE_ARGS})
    res = _submit(tmp_path, spec)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    seen = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    assert len(seen) == 2, res.stdout
    for rank in seen:
        assert rank["argv"] == HOSTILE_ARGS  # byte for byte, on every rank
        c = rank["contract"]
        assert c["SHARDCTL_JOB_NAME"] == "args" and c["SHARDCTL_ATTEMPT"] == "0"
        assert c["SHARDCTL_RUN_DIR"] == str(tmp_path / "args")
        assert c["SHARDCTL_CHECKPOINT_DIR"] == str(tmp_path / "args" / "checkpoints")
        assert Path(c["SHARDCTL_SPEC"]).resolve() == tmp_path / "args" / "job.yaml"
    assert not list(tmp_path.glob("PWNED*")) and not list((tmp_path / "args").glob("PWNED*"))
    assert "SUCCEEDED" in _status("args")


LAUNCHERS = {
    # FSDP under accelerate on CPU is refused (accelerate would run DDP): DeepSpeed.
    "accelerate": {"launcher": "accelerate", "strategy": {"backend": "deepspeed", "zero_stage": 2}},
    "deepspeed": {"launcher": "deepspeed", "strategy": {"backend": "deepspeed"}},
}


@pytest.mark.slow
@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_accelerate_and_deepspeed_launch_your_script_with_the_rendered_config(
    tmp_path: Path, launcher: str
) -> None:
    """`accelerate launch` hands an `Accelerator()` the rendered DeepSpeed config and a
    2-rank group; `deepspeed` hands the script ds_config.json. Hostile args intact."""
    entrypoint = {"script": str(CODE / "launcher_probe.py"), "args": HOSTILE_ARGS}
    spec = script_spec(tmp_path, f"via-{launcher}", entrypoint, **LAUNCHERS[launcher])
    res = _submit(tmp_path, spec)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    seen = [json.loads(line[6:]) for line in res.stdout.splitlines() if line.startswith("PROBE ")]
    assert sorted(r["rank"] for r in seen) == [0, 1], res.stdout[-3000:]
    for rank in seen:
        assert rank["world"] == 2 and rank["argv"] == HOSTILE_ARGS
        if launcher == "deepspeed":
            assert rank["zero_stage"] == 3  # strategy.sharding full_shard
            continue
        # On CPU the ranks are one gloo group and stay DeepSpeed (no ACCELERATE_USE_CPU,
        # with which accelerate would drop DeepSpeed for DDP).
        assert (rank["distributed_type"], rank["num_processes"]) == ("DEEPSPEED", 2)
        assert "distributed_type: DEEPSPEED" in rank["config"]
        env = rank["env"]
        assert env["ACCELERATE_USE_DEEPSPEED"] == "true" and "ACCELERATE_USE_CPU" not in env
    assert "SUCCEEDED" in _status(f"via-{launcher}")


@pytest.mark.slow
def test_exit_3_is_failed_with_code_3_and_exit_42_is_preempted(tmp_path: Path) -> None:
    spec = script_spec(tmp_path, "codes", {"script": str(CODE / "exit_with.py"), "args": ["3"]})
    res = _submit(tmp_path, spec)
    assert res.returncode == 3, res.stdout[-2000:] + res.stderr[-2000:]
    assert "FAILED [exit 3]" in _status("codes")
    assert "a rank exited with code 3" in res.stderr
    # The same run, now preempted: PREEMPTED, exit 42, and the next start is attempt 2.
    res = _submit(tmp_path, spec, "--", str(CODE / "exit_with.py"), "42")
    assert res.returncode == 42, res.stdout[-2000:] + res.stderr[-2000:]
    assert "attempt 1 rank 0" in res.stdout
    assert "PREEMPTED" in _status("codes") and "submit the spec again" in _status("codes")
    assert "Traceback" not in res.stdout + res.stderr
    res = _submit(tmp_path, spec, "--", str(CODE / "exit_with.py"), "0")
    assert res.returncode == 0 and "attempt 2 rank 0" in res.stdout
    assert "SUCCEEDED" in _status("codes") and "step None" not in _status("codes")
    # Exit 0 leaves DONE (no step: the script kept none) like the built-in loop's.
    assert json.loads((tmp_path / "codes" / "DONE").read_text())["step"] is None


def test_a_missing_script_is_refused_before_anything_starts(tmp_path: Path) -> None:
    spec = script_spec(tmp_path, "missing", {"script": str(tmp_path / "nope.py")})
    res = _submit(tmp_path, spec)
    assert res.returncode == 2 and "entrypoint.script" in res.stderr
    assert "is not a Python file" in res.stderr and not (tmp_path / "missing").exists()
    assert os.environ.get("SHARDCTL_ATTEMPT") is None


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


@pytest.mark.slow
@pytest.mark.parametrize(
    ("script", "args", "progress", "resumed"),
    [
        # A plain FSDP2 loop on shardctl.train.api: checkpoints every 5 steps.
        ("fsdp2_script.py", ["--steps", "400", "--log-every", "1"], r"^step (\d+) loss",
         r"resumed at step (\d+)"),
        # A Hugging Face Trainer script with the two lines (callback + resume helper).
        ("hf_trainer_script.py", ["--max-steps", "400", "--save-steps", "1000"],
         r"'epoch'", r"resuming from .*checkpoint-(\d+)"),
    ],
)  # fmt: skip
def test_your_script_is_cancelled_saves_and_resumes_from_that_step(
    tmp_path: Path, script: str, args: list[str], progress: str, resumed: str
) -> None:
    """cancel mid-run → every rank saves → the next submit resumes from that step."""
    import re
    import time

    from shardctl.orchestrator.clusters.base import JobState
    from shardctl.orchestrator.clusters.local import LocalCluster

    spec_path = script_spec(
        tmp_path, "own", {"script": str(ROOT / "examples" / script), "args": args},
        checkpoint={"every_steps": 5, "keep": 2},
    )  # fmt: skip
    local = LocalCluster()
    old_cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        ref = local.submit(load_spec(spec_path))
        out = tmp_path / "own" / "logs" / "launcher.out"
        err = tmp_path / "own" / "logs" / "launcher.err"
        deadline = time.monotonic() + 240
        while len(re.findall(progress, _read(out) + _read(err), re.M)) < 3:
            assert local.status(ref).state == JobState.RUNNING, _read(err)[-3000:]
            assert time.monotonic() < deadline, "no progress in 240 s"
            time.sleep(0.5)
        local.cancel(ref, grace_s=120)
    finally:
        os.chdir(old_cwd)
        if local.status(ref).state == JobState.RUNNING:
            local.cancel(ref, grace_s=5)
    marker = json.loads((tmp_path / "own" / "PREEMPTED").read_text())
    saved = int(marker["step"])
    assert saved >= 1 and "SIGTERM" in marker["reason"]
    st = local.status(ref)
    assert st.state == JobState.CANCELLED and f"checkpoint at step {saved}" in st.detail
    # Submit again, shortened to end a few steps after the saved one.
    end = saved + 3
    flag = "--steps" if script.startswith("fsdp2") else "--max-steps"
    res = _submit(tmp_path, spec_path, "--", str(ROOT / "examples" / script), *args, flag, str(end))
    shown = res.stdout + res.stderr
    assert res.returncode == 0, shown[-4000:]
    assert int(re.search(resumed, shown).group(1)) == saved
    assert "SUCCEEDED" in _status("own")

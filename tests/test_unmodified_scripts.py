"""Scripts nobody patched for shardctl (issue 31, items 4 and 5): an unmodified Hugging
Face Trainer script resumes and saves on a stop signal (`train/hf_auto.py`); a rank
never keeps a stop signal its launcher ignored; a rank with no handler for the
preemption signal says that nothing was saved, and the job is a preemption
(requeued); `status` says "no progress known" for a script that logs no steps, never
"0 steps lost"; a second submit of a script that succeeded says it is complete.

Real torchrun, 2 CPU ranks, this machine; every process a test starts has a timeout
and is ended by its pid."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from helpers.ckpt_run import child_env
from helpers.train_run import script_spec
from shardctl.orchestrator import proctree
from shardctl.orchestrator.goodput import goodput
from shardctl.orchestrator.outcome import Decision, Evidence, Kind, judge
from shardctl.orchestrator.rundir import ATTEMPTS_FILE, ENV_HF_TRAINER_AUTO, PREEMPTED_FILE
from shardctl.train.preemption import DEFAULT_WARNING_HOLD_S, WARNING_HOLD_ENV, warning_hold_s

ROOT = Path(__file__).resolve().parent.parent
CODE = ROOT / "tests" / "data" / "usercode"
SHARDCTL = str(Path(sys.executable).parent / "shardctl")


def _shardctl(tmp_path: Path, *words: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [SHARDCTL, *words], capture_output=True, text=True, timeout=timeout, cwd=tmp_path,
        env=child_env(),
    )  # fmt: skip


@contextlib.contextmanager
def _submitted(tmp_path: Path, spec: Path, env: dict[str, str]) -> Iterator[subprocess.Popen[str]]:
    """`shardctl submit SPEC --wait` run from `tmp_path` in a session of its own; on
    leaving, however, a submit still waiting has its job (named as its spec) cancelled
    and is killed by its pid."""
    job = subprocess.Popen(
        [SHARDCTL, "submit", str(spec), "--wait"], cwd=tmp_path, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        yield job
    finally:
        if job.poll() is None:
            _shardctl(tmp_path, "cancel", spec.stem, timeout=120)
            job.kill()
            job.wait(timeout=30)


def _wait_for(found, what: str, seconds: float, log: Path | None = None):
    """Poll `found()` until it returns something true, for at most `seconds`."""
    deadline = time.monotonic() + seconds
    while not (value := found()):
        if time.monotonic() > deadline:
            tail = log.read_text()[-3000:] if log is not None and log.exists() else ""
            raise AssertionError(f"{what}: not within {seconds} s\n{tail}")
        time.sleep(0.2)
    return value


# ----------------------------------------------------------------- signals of a rank


def _entry(
    tmp_path: Path,
    script: Path,
    *args: str,
    ignore: tuple[int, ...] = (),
    stderr=subprocess.PIPE,
    hold_s: str | None = None,
):
    """`python -m shardctl.train.entry script SCRIPT ARGS` as a rank, started with the
    signals `ignore` ignored (as Slurm's node task starts the launcher); `hold_s`: how
    long a warning waits for the script's handler (`SHARDCTL_WARNING_HOLD_S`)."""

    def ignored() -> None:
        for sig in ignore:
            signal.signal(sig, signal.SIG_IGN)

    env = {**child_env(), "SHARDCTL_RUN_DIR": str(tmp_path / "run"), "RANK": "0"}
    env.pop(WARNING_HOLD_ENV, None)
    if hold_s is not None:
        env[WARNING_HOLD_ENV] = hold_s
    return subprocess.Popen(
        [sys.executable, "-m", "shardctl.train.entry", "script", str(script), *args],
        env=env, cwd=tmp_path, preexec_fn=ignored, stdout=subprocess.PIPE,
        stderr=stderr, text=True,
    )  # fmt: skip


def test_a_rank_does_not_keep_the_stop_signals_its_launcher_ignored(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import signal\n"
        "for s in (signal.SIGUSR2, signal.SIGTERM, signal.SIGINT):\n"
        "    print(s.name, signal.getsignal(s) is signal.SIG_IGN)\n"
    )
    ignore = (signal.SIGUSR2, signal.SIGTERM, signal.SIGINT)
    proc = _entry(tmp_path, probe, ignore=ignore)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert out.split("\n")[:3] == ["SIGUSR2 False", "SIGTERM False", "SIGINT False"], out


def test_a_rank_without_a_handler_says_nothing_was_saved_and_is_a_preemption(
    tmp_path: Path,
) -> None:
    """SIGUSR2 inherited ignored, a script with no handler: the rank holds the warning
    for its hold (1 s here), then says it, records PREEMPTED with `saved: false`, and
    ends by the signal; the classifier requeues."""
    started = time.time()
    with _rank(tmp_path, CODE / "no_handler.py", str(tmp_path), hold_s="1") as proc:
        _warn_when_ready(tmp_path, proc, 60)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGUSR2, err  # ended as it would without shardctl
    assert (
        "SIGUSR2 arrived before the script installed a handler for it: it is held up to 1 s" in err
    )
    assert "SIGUSR2 arrived and the script has no handler for it: nothing was saved" in err
    marker = json.loads((tmp_path / "run" / PREEMPTED_FILE).read_text())
    assert (marker["kind"], marker["saved"], marker["rank"]) == ("preempted", False, 0)
    assert (marker["signal"], marker["step"]) == ("SIGUSR2", None)
    # What a supervisor makes of it: torchrun's exit 1 and that marker.
    verdict = judge(Evidence.gather(tmp_path / "run", started, 1), max_retries=3)
    assert verdict.outcome.kind is Kind.PREEMPTED and verdict.decision is Decision.RETRY
    assert "nothing saved: rank 0 had no handler for SIGUSR2" in verdict.summary()


def _warned_while_held(
    tmp_path: Path,
    script: Path,
    *args: str,
    held: str,
    release: str,
    start_s: float,
    end_s: float,
    hold_s: str | None = None,
) -> tuple[int, str, str]:
    """SCRIPT run as a rank whose launcher ignored SIGUSR2, warned (SIGUSR2) once it says
    it is ready (`ready-0`) and before it has a handler; once the rank says it holds the
    warning (`held` on its stderr), the script is let go on (`tmp_path/release` made)
    and waited for, `end_s` at most. Returns its exit code, stdout and stderr."""
    err_log = tmp_path / "rank.err"
    with (
        err_log.open("w") as err_file,
        _rank(tmp_path, script, *args, stderr=err_file, hold_s=hold_s) as proc,
    ):
        _warn_when_ready(tmp_path, proc, start_s)
        _wait_for(lambda: held in _read(err_log) or proc.poll() is not None,
                  "the rank's word on the signal", 60, err_log)  # fmt: skip
        (tmp_path / release).touch()
        out, _ = proc.communicate(timeout=end_s)
    return proc.returncode, out, err_log.read_text()


@contextlib.contextmanager
def _rank(
    tmp_path: Path, script: Path, *args: str, **entry: Any
) -> Iterator[subprocess.Popen[str]]:
    """`_entry`'s rank of SCRIPT, started with SIGUSR2 ignored (as Slurm's node task
    starts the launcher); on leaving, however, killed by its pid if it still runs."""
    proc = _entry(tmp_path, script, *args, ignore=(signal.SIGUSR2,), **entry)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


def _warn_when_ready(tmp_path: Path, proc: subprocess.Popen[str], seconds: float) -> None:
    """Once the script says it has started (`ready-0` holding its pid, `seconds` at
    most), SIGUSR2 to it: the rank's own process, which catches the signal though its
    script has no handler (yet). Slurm's node task and the watchdog pass USR2 on only
    to a rank that catches it (`proctree.forward_to_catchers`)."""
    pid = int(_wait_for(lambda: _read(tmp_path / "ready-0"), "the script's start", seconds))
    assert pid == proc.pid
    assert proctree.catches(pid, signal.SIGUSR2)
    os.kill(pid, signal.SIGUSR2)


@pytest.mark.parametrize("handler", ["own", "shardctl"])
def test_a_handler_installed_while_the_warning_is_held_gets_it(
    tmp_path: Path, handler: str
) -> None:
    """A warning that lands while the script is still starting (no handler yet): the
    rank holds it, and the handler the script installs within the hold — its own
    `signal.signal` or shardctl's preemption flag — gets it; the rank lives and saves
    as the script would. Without the hold the rank died of the signal at once."""
    held = "SIGUSR2 arrived before the script installed a handler for it"
    code, out, err = _warned_while_held(
        tmp_path, CODE / "late_handler.py", str(tmp_path), handler, hold_s="120",
        held=held, release="install", start_s=60, end_s=90,
    )  # fmt: skip
    assert code == 0, err[-3000:]
    assert out.strip() == "got SIGUSR2", out
    assert held in err and "nothing was saved" not in err, err[-3000:]
    assert not (tmp_path / "run" / PREEMPTED_FILE).exists()


def test_the_hold_is_read_from_the_environment_and_a_bad_value_is_the_default() -> None:
    assert warning_hold_s({}) == DEFAULT_WARNING_HOLD_S == 30.0
    assert warning_hold_s({WARNING_HOLD_ENV: " 12.5 "}) == 12.5
    assert warning_hold_s({WARNING_HOLD_ENV: "0"}) == 0.0  # end the rank at once
    for bad in ("", "ten", "-1", "inf", "nan", "1e400"):
        assert warning_hold_s({WARNING_HOLD_ENV: bad}) == 30.0, bad


def test_a_trainer_script_holds_an_early_warning_and_saves_at_its_first_step(
    tmp_path: Path,
) -> None:
    """An unmodified Trainer script whose rank gets SIGUSR2 once the Trainer is built
    but before `train()` (a time-limit warning during a slow start-up): the rank holds
    it for the callback shardctl adds, which saves checkpoint-1 and exits 42; without
    the hold the rank died of the signal with nothing saved (CI, a Slurm time limit)."""
    out_dir = tmp_path / "out"
    args = ["--output-dir", str(out_dir), "--max-steps", "20", "--save-steps", "100",
            "--hold-before-train", str(tmp_path)]  # fmt: skip
    held = "SIGUSR2 arrived before the Trainer began training"
    code, out, err = _warned_while_held(
        tmp_path, CODE / "hf_unmodified.py", *args,
        held=held, release="go", start_s=180, end_s=180,
    )  # fmt: skip
    assert code == 42, err[-3000:]
    assert held in err and "nothing was saved" not in err, err[-3000:]
    assert "started at step 0" in out and "finished" not in out, out
    marker = json.loads((tmp_path / "run" / PREEMPTED_FILE).read_text())
    assert (marker["step"], marker["signal"]) == (1, "SIGUSR2"), marker
    assert _complete_checkpoints(out_dir) == [1]


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except FileNotFoundError:
        return ""


@pytest.mark.slow
def test_the_local_status_says_nothing_was_saved_and_a_success_is_complete(
    tmp_path: Path,
) -> None:
    """Through `shardctl submit` on 2 ranks: SIGUSR2 to one rank of a script without a
    handler → PREEMPTED (exit 42), `status` says nothing was saved and that no
    progress is known (not "0 steps lost"); then the same script run to the end and
    submitted again with the same command: complete, nothing started."""
    spec = script_spec(tmp_path, "unmod-nohandler", {"script": str(CODE / "no_handler.py"),
                                                "args": [str(tmp_path)]})  # fmt: skip
    with _submitted(tmp_path, spec, child_env()) as job:
        pid = int(_wait_for(lambda: _read(tmp_path / "ready-1"), "rank 1's start", 180))
        os.kill(pid, signal.SIGUSR2)
        out, err = job.communicate(timeout=180)
    assert job.returncode == 42, out[-2000:] + err[-3000:]
    assert "nothing was saved" in _read(tmp_path / "unmod-nohandler/logs/launcher.err")
    status = _shardctl(tmp_path, "status", "unmod-nohandler", timeout=60).stdout
    assert "PREEMPTED" in status and "nothing saved: rank 1 had no handler for SIGUSR2" in status
    assert "steps lost" not in status and "no progress known" in status, status
    assert "no progress known" in err

    # The same run, now to its end (exit 0 on both ranks), then the same command again.
    done = [str(CODE / "exit_with.py"), "0"]
    first = _shardctl(tmp_path, "submit", str(spec), "--wait", "--", *done)
    assert first.returncode == 0, first.stderr[-3000:]
    again = _shardctl(tmp_path, "submit", str(spec), "--wait", "--", *done)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "run complete" in again.stdout and "nothing to do" in again.stdout, again.stdout
    # Another command is another piece of work: it runs.
    other = _shardctl(tmp_path, "submit", str(spec), "--wait", "--", str(CODE / "exit_with.py"),
                      "00")  # fmt: skip
    assert other.returncode == 0 and "run complete" not in other.stdout, other.stdout


# ----------------------------------------------------------------- goodput


def test_goodput_of_a_script_that_logs_no_steps_is_no_progress_known(tmp_path: Path) -> None:
    """Two attempts (a preemption, then a finish) and no metrics.jsonl: not 0 %, not
    "0 steps lost" (the second attempt may have redone everything)."""
    lines = [
        {"job": "j", "start": 100.0, "end": 160.0, "kind": "preempted", "decision": "retry",
         "checkpoint_step": None},
        {"job": "j", "start": 161.0, "end": 250.0, "kind": "done", "decision": "finish",
         "checkpoint_step": None},
    ]  # fmt: skip
    (tmp_path / ATTEMPTS_FILE).write_text("".join(json.dumps(e) + "\n" for e in lines))
    good = goodput(tmp_path, "j", now=300.0)
    assert good is not None
    assert (good.effective, good.lost_steps, good.restarts) == (None, None, 1)
    line = good.line()
    assert line.startswith("goodput ? (no progress known: no step logged in logs/metrics.jsonl")
    assert "log_metrics" in line and "steps lost" not in line and "trained" not in line
    assert good.to_json()["lost_steps"] is None


def test_a_trainers_new_checkpoint_is_progress_for_the_requeue_rule(tmp_path: Path) -> None:
    """A requeued Trainer script that saved a new checkpoint-N made progress
    (`outcome.attempt_progress`), wherever its output_dir is; a torn one is not."""
    from shardctl.orchestrator.outcome import TRAINER_OUTPUT_FILE, attempt_progress

    run_dir, out = tmp_path / "run", tmp_path / "elsewhere"
    for step, state in ((5, {"global_step": 5}), (10, None)):  # checkpoint-10: torn
        (out / f"checkpoint-{step}").mkdir(parents=True)
        if state is not None:
            (out / f"checkpoint-{step}" / "trainer_state.json").write_text(json.dumps(state))
    run_dir.mkdir()
    before = attempt_progress(run_dir, run_dir / "checkpoints", None, "j")
    assert (before.step, before.advanced) == (None, False)  # output_dir not known yet
    (run_dir / TRAINER_OUTPUT_FILE).write_text(json.dumps({"output_dir": str(out)}))
    found = attempt_progress(run_dir, run_dir / "checkpoints", None, "j")
    assert (found.step, found.advanced, found.stalled) == (5, True, 0)


# ----------------------------------------------------------------- the HF Trainer


def test_the_spec_switch_reaches_the_ranks_and_turns_the_wrapping_off(tmp_path: Path) -> None:
    from shardctl.orchestrator.launch import env_lines
    from shardctl.orchestrator.spec import load_spec

    on = script_spec(tmp_path, "on", {"script": str(CODE / "no_handler.py")})
    off = script_spec(tmp_path, "off", {"script": str(CODE / "no_handler.py"),
                                  "hf_trainer_auto": False})  # fmt: skip
    assert load_spec(on).entrypoint.hf_trainer_auto is True
    text = "\n".join(line.text for line in env_lines(load_spec(off), []))
    assert f"export {ENV_HF_TRAINER_AUTO}=0" in text
    text = "\n".join(line.text for line in env_lines(load_spec(on), []))
    assert ENV_HF_TRAINER_AUTO not in text
    # A rank with the switch off puts no finder on sys.meta_path (nothing is wrapped).
    probe = (
        "import sys; from shardctl.train import hf_auto; before = list(sys.meta_path); "
        "hf_auto.install(); print(sys.meta_path == before)"
    )
    for value, unchanged in (("0", "True"), ("1", "False")):
        env = {**child_env(), ENV_HF_TRAINER_AUTO: value}
        done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                              text=True, timeout=60)  # fmt: skip
        assert done.stdout.strip() == unchanged, done.stderr


class _FakeTrainer:
    """What `prepare_unmodified` reads of a Trainer: its callbacks, its output folder."""

    def __init__(self, output_dir: Path, callbacks: tuple | list = ()) -> None:
        self.callback_handler = SimpleNamespace(callbacks=list(callbacks))
        self.args = SimpleNamespace(output_dir=str(output_dir), save_only_model=False)

    def add_callback(self, cb: object) -> None:
        self.callback_handler.callbacks.append(cb)

    def is_world_process_zero(self) -> bool:
        return True


def test_the_two_line_patch_keeps_its_one_callback_and_its_own_resume(tmp_path: Path) -> None:
    from shardctl.train.hf import PreemptionCallback, prepare_unmodified

    patched = _FakeTrainer(tmp_path, [PreemptionCallback()])
    args, kwargs = prepare_unmodified(patched, (), {"resume_from_checkpoint": "/given"})
    assert kwargs == {"resume_from_checkpoint": "/given"} and args == ()
    assert len(patched.callback_handler.callbacks) == 1
    bare = _FakeTrainer(tmp_path)
    args, kwargs = prepare_unmodified(bare, (), {})  # no checkpoint-N yet: nothing to pass
    assert kwargs == {} and args == ()
    assert [type(cb) for cb in bare.callback_handler.callbacks] == [PreemptionCallback]


def test_a_complete_checkpoint_is_passed_to_the_first_train_only(tmp_path: Path) -> None:
    import shardctl.train.hf as hf

    ckpt = tmp_path / "checkpoint-3"
    ckpt.mkdir()
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": 3}))
    (ckpt / "model.safetensors").write_bytes(b"\x02" + bytes(7) + b"{}")  # empty, whole
    import zipfile

    with zipfile.ZipFile(ckpt / "optimizer.pt", "w") as z:
        z.writestr("x", "y")
    torn = tmp_path / "checkpoint-4"  # newer, but its save never finished
    torn.mkdir()
    assert hf.checkpoint_problem(ckpt) is None
    hf._first_train = True  # as in a fresh rank
    try:
        # A search trial is left alone, and it counts as the first train().
        trial = (None, "trial")
        assert hf.prepare_unmodified(_FakeTrainer(tmp_path), trial, {}) == (trial, {})
        hf._first_train = True
        args, kwargs = hf.prepare_unmodified(_FakeTrainer(tmp_path), (None,), {})
        assert args == (str(ckpt),) and kwargs == {}
        # A second train() in the same process starts where the script says.
        assert hf.prepare_unmodified(_FakeTrainer(tmp_path), (), {}) == ((), {})
    finally:
        hf._first_train = True


def _complete_checkpoints(out: Path) -> list[int]:
    from shardctl.train.hf import last_complete_checkpoint

    found = last_complete_checkpoint(out)
    return [int(Path(found).name.split("-")[1])] if found else []


@pytest.mark.slow
def test_an_unmodified_trainer_script_is_cancelled_and_resumes_from_its_checkpoint(
    tmp_path: Path,
) -> None:
    """`shardctl submit --wait` of a Trainer script without shardctl's lines; cancelled
    once its first complete checkpoint-N exists: the ranks save the step they agree on;
    the same command submitted again starts at that step, not at 0."""
    out_dir = tmp_path / "out"
    # Paced (0.2 s a step): the cancel lands before step 60 on a quiet machine too.
    args = ["--output-dir", str(out_dir), "--max-steps", "60", "--save-steps", "5",
            "--pause", "0.2"]  # fmt: skip
    spec = script_spec(
        tmp_path, "unmod-hf", {"script": str(CODE / "hf_unmodified.py"), "args": args}
    )
    env = {**child_env(), "TOKENIZERS_PARALLELISM": "false"}
    log = tmp_path / "unmod-hf" / "logs" / "launcher.err"
    with _submitted(tmp_path, spec, env) as job:
        _wait_for(lambda: _complete_checkpoints(out_dir), "a complete checkpoint-N", 300, log)
        cancel = _shardctl(tmp_path, "cancel", "unmod-hf", timeout=240)
        assert cancel.returncode == 0, cancel.stderr
        first_out, _ = job.communicate(timeout=240)
    assert "started at step 0" in first_out, first_out[-2000:]
    # The callback shardctl added saved the step every rank agreed on, on SIGTERM.
    marker = json.loads((tmp_path / "unmod-hf" / PREEMPTED_FILE).read_text())
    saved = marker["step"]
    assert isinstance(saved, int) and 5 <= saved < 60 and marker["signal"] == "SIGTERM"
    assert _complete_checkpoints(out_dir) == [saved]
    status = _shardctl(tmp_path, "status", "unmod-hf", timeout=60).stdout
    assert "CANCELLED" in status and f"checkpoint at step {saved}" in status, status
    # The callback recorded where the checkpoints go: the requeue rule sees them.
    recorded = json.loads((tmp_path / "unmod-hf" / "trainer-output.json").read_text())
    assert recorded["output_dir"] == str(out_dir)
    assert "0 steps lost" not in status, status

    # The same command again: it resumes from checkpoint-<saved> and runs to 60.
    again = _shardctl(tmp_path, "submit", str(spec), "--wait", timeout=400)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-3000:]
    shown = again.stdout + again.stderr
    assert f"started at step {saved}" in again.stdout, again.stdout[-3000:]
    assert re.search(rf"shardctl: resuming from \S*checkpoint-{saved}\b", shown), shown[-3000:]
    assert "finished at step 60" in again.stdout
    state = json.loads((out_dir / "checkpoint-60" / "trainer_state.json").read_text())
    assert state["global_step"] == 60
    # The losses logged by this start: steps saved+1 … 60, none redone from step 0.
    steps = [e["step"] for e in state["log_history"] if "loss" in e]
    assert steps == list(range(1, 61)), steps
    status = _shardctl(tmp_path, "status", "unmod-hf", timeout=60).stdout
    assert "SUCCEEDED" in status and "0 steps lost" not in status, status
    # Once more, the same command: the run is complete, nothing starts.
    third = _shardctl(tmp_path, "submit", str(spec), "--wait", timeout=120)
    assert third.returncode == 0 and "run complete" in third.stdout, third.stdout

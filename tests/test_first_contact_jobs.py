"""Issue 35 (first contact, round 4), the jobs command line on this machine: the test
session's own state dir, `submit` refusing an unwritable state or run dir before
anything starts, `status` reading the end of a long metrics.jsonl, one exit code for a
cancel, goodput of a run that requeues without progress, a second Ctrl-C, the code
that ran, and `ls`'s filters.

Expectations are written by hand in each test; the real local runs are tiny and each
process a test starts has a deadline and is ended by its pid."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from helpers.ckpt_run import ROOT, kill_group
from helpers.train_run import tiny_spec
from shardctl.orchestrator.cli import cli
from shardctl.orchestrator.cli.jobs import job_exit_code
from shardctl.orchestrator.clusters import owner
from shardctl.orchestrator.clusters.base import JobRef, JobState, JobStatus
from shardctl.orchestrator.clusters.local import LocalCluster
from shardctl.orchestrator.clusters.records import jobs_dir, recall, remember, state_dir
from shardctl.orchestrator.goodput import goodput
from shardctl.orchestrator.progress import read_progress
from shardctl.orchestrator.rundir import SUBMIT_CLAIM_FILE
from shardctl.orchestrator.spec import load_spec, with_command

# ------------------------------------------------------- 1. the session's state dir


@pytest.fixture(scope="module")
def state_dir_seen_by_a_module_fixture() -> str:
    """What a module fixture (one that submits a job for its tests) sees: it is set up
    before any function fixture, so the per-test state dir is not there yet."""
    return os.environ.get("SHARDCTL_STATE_DIR", "")


def test_the_suite_never_writes_the_user_s_state_dir(
    state_dir_seen_by_a_module_fixture: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    tmp_root = tmp_path_factory.getbasetemp().resolve()
    seen = Path(state_dir_seen_by_a_module_fixture).resolve()
    assert seen.is_relative_to(tmp_root), seen
    assert state_dir().resolve().is_relative_to(tmp_root)
    # A process the test starts inherits it.
    child = subprocess.run(
        [sys.executable, "-c", "from shardctl.orchestrator.clusters.records import state_dir; "
         "print(state_dir())"],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    assert Path(child.stdout.strip()).resolve().is_relative_to(tmp_root)
    assert not Path(child.stdout.strip()).resolve().is_relative_to(Path.home() / ".local" / "state")


# ------------------------------------- 2. an unwritable state or run dir, refused first


def _never_started(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make starting the job a test failure: each refusal must come before it."""

    def schedule(self: object, dryrun: object) -> None:
        raise AssertionError("the job was started")

    monkeypatch.setattr(LocalCluster, "schedule", schedule)


def _refused(res: Any) -> str:
    """The one line `submit` printed on stderr for a refusal (exit 1, no traceback)."""
    assert res.exit_code == 1, res.output
    assert ("Traceback" not in res.output and res.exception is None) or isinstance(
        res.exception, SystemExit
    )
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    return lines[0]


def test_a_state_dir_that_is_a_file_is_refused_before_the_job_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real file in the state dir's place (no simulation)."""
    blocker = tmp_path / "state"
    blocker.write_text("not a folder\n")
    monkeypatch.setenv("SHARDCTL_STATE_DIR", str(blocker))
    _never_started(monkeypatch)
    spec = tiny_spec(tmp_path, "job")
    line = _refused(CliRunner().invoke(cli, ["submit", str(spec)]))
    assert f"state dir {blocker}: {blocker} is a file, not a directory" in line
    assert "nothing was submitted" in line and "SHARDCTL_STATE_DIR" in line
    assert blocker.read_text() == "not a folder\n"
    assert not (tmp_path / "job").exists()


# A write refused as on a read-only or a full file system, and how the refusal says it.
READ_ONLY_OR_FULL = pytest.mark.parametrize(
    ("code", "said"),
    [(errno.EROFS, "Read-only file system (EROFS)"),
     (errno.ENOSPC, "No space left on device (ENOSPC)")],
)  # fmt: skip


@READ_ONLY_OR_FULL
def test_a_read_only_or_full_state_dir_is_refused_before_the_job_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int, said: str
) -> None:
    """Simulated in-process: as root a chmod does not stop writes, so the one write of
    the state dir's probe (its `Path.open`) raises EROFS or ENOSPC."""
    real_open = Path.open

    def open_(self: Path, *args: Any, **kwargs: Any) -> Any:
        if self.name.startswith(".probe-"):
            raise OSError(code, os.strerror(code), str(self))
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(Path, "open", open_)
    _never_started(monkeypatch)
    spec = tiny_spec(tmp_path, "job")
    line = _refused(CliRunner().invoke(cli, ["submit", str(spec)]))
    assert f"cannot record jobs in the state dir {state_dir()}: {said}; nothing was" in line
    assert "SHARDCTL_STATE_DIR" in line
    assert not (tmp_path / "job").exists()


@READ_ONLY_OR_FULL
def test_a_read_only_or_full_run_dir_is_refused_before_the_job_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int, said: str
) -> None:
    """Simulated in-process: the one write of the run dir before the job starts, its
    `.submit.claim` (`os.open`), raises EROFS or ENOSPC (as root a chmod does not stop
    writes)."""
    real_open = os.open

    def open_(path: Any, *args: Any, **kwargs: Any) -> int:
        if str(path).endswith(SUBMIT_CLAIM_FILE):
            raise OSError(code, os.strerror(code), str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", open_)
    _never_started(monkeypatch)
    spec = tiny_spec(tmp_path, "job")
    line = _refused(CliRunner().invoke(cli, ["submit", str(spec)]))
    assert f"cannot write the run dir {tmp_path / 'job'}: {said}; nothing was" in line
    assert not (tmp_path / "job").exists()  # the folders the claim made are gone again
    assert list(jobs_dir().glob("*.json")) == []


def test_a_run_dir_with_no_room_left_is_refused_before_the_job_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Simulated in-process: the run dir's file system reports 4096 bytes free (the
    claim's few bytes still fit, the job's files would not)."""
    monkeypatch.setattr(owner, "free_bytes", lambda path: 4096)
    _never_started(monkeypatch)
    spec = tiny_spec(tmp_path, "job")
    line = _refused(CliRunner().invoke(cli, ["submit", str(spec)]))
    assert f"cannot write the run dir {tmp_path / 'job'}: No space left on device: 4096 " in line
    assert not (tmp_path / "job").exists()


# ----------------------------------------- 3. status and ls read a long run's tail


T0 = 1_000_000.0
# Hand-written run (one logged step per second): attempt 1 started at 0, logged steps
# 1..600,000 at 1..600,000 s, its newest checkpoint at step 500,000; it failed and was
# judged at 600,001 s. Attempt 2 resumed from 500,000: start-up until 600,010 s, steps
# 500,001..1,000,000 at 600,011..1,100,010 s, done then. 1,100,000 lines.
CHECKPOINT, CRASHED_AT, LAST = 500_000, 600_000, 1_000_000
RESUMED_AT = 600_011.0  # the first step of attempt 2 (10 s of start-up after the fault)
END = RESUMED_AT + LAST - (CHECKPOINT + 1)  # 1,100,010 s


def _write_long_run(root: Path) -> Path:
    (root / "logs").mkdir(parents=True)
    (root / "job.yaml").write_text(f"name: long\ntrain:\n  steps: {LAST}\n")
    (root / "attempts.jsonl").write_text(
        json.dumps({"job": "local-0", "start": T0, "end": T0 + CRASHED_AT + 1,
                    "kind": "failed", "decision": "restart", "checkpoint_step": CHECKPOINT})
        + "\n"
        + json.dumps({"job": "local-0", "start": T0 + CRASHED_AT + 1, "end": T0 + END,
                      "kind": "done", "decision": "finish", "checkpoint_step": LAST})
        + "\n"
    )  # fmt: skip
    first = (f'{{"step": {s}, "loss": 2.5, "time": {T0 + s}}}\n' for s in range(1, CRASHED_AT + 1))
    again = (
        f'{{"step": {s}, "loss": 2.5, "time": {T0 + RESUMED_AT + s - CHECKPOINT - 1}}}\n'
        for s in range(CHECKPOINT + 1, LAST + 1)
    )
    with (root / "logs" / "metrics.jsonl").open("w") as f:
        f.writelines(first)
        f.writelines(again)
    (root / "local.exit").write_text("0\n")
    return root


@pytest.fixture(scope="module")
def long_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write_long_run(tmp_path_factory.mktemp("long") / "long")


def test_goodput_of_a_million_logged_steps_reads_only_the_lines_that_decide_it(
    long_run: Path,
) -> None:
    # Kept: attempt 1's steps 1..500,000 (500,000 s: the first step's second and then
    # one per step) and attempt 2's 500,001..1,000,000 (500,000 s) = 1,000,000 s of a
    # wall time of 600,001 + 500,009 s; lost 600,000 - 500,000 steps; recovery 10 s.
    good = goodput(long_run, "local-0", now=T0 + END + 5)
    assert good is not None
    data = good.to_json()
    assert data["training_s"] == 1_000_000.0
    assert data["wall_s"] == 1_100_010.0
    assert data["effective"] == round(1_000_000 / 1_100_010, 4)
    assert (data["restarts"], data["lost_steps"]) == (1, 100_000)
    assert data["recoveries"] == [{"kind": "failed", "seconds": 10.0}]


def _bytes_read() -> int:
    """This process's bytes read so far (Linux: rchar of /proc/self/io)."""
    text = Path("/proc/self/io").read_text()
    return int(next(line.split()[1] for line in text.splitlines() if line.startswith("rchar:")))


def test_status_and_ls_of_a_million_logged_steps_read_the_tail_only(long_run: Path) -> None:
    size = (long_run / "logs" / "metrics.jsonl").stat().st_size
    assert size > 40 << 20
    remember(JobRef("local", "4242", "long", str(long_run), {"attempt": 0}))
    CliRunner().invoke(cli, ["status", "long"])  # imports done: they read files too
    before = _bytes_read()
    res = CliRunner().invoke(cli, ["status", "long"])
    read = _bytes_read() - before
    assert res.exit_code == 0, res.output
    assert f"step {LAST}/{LAST}" in res.stdout
    assert "goodput 91 %" in res.stdout and "100000 steps lost" in res.stdout
    assert read < 4 << 20, f"status read {read} bytes of a {size}-byte metrics.jsonl"
    before = _bytes_read()
    res = CliRunner().invoke(cli, ["ls", "-o", "json"])
    read = _bytes_read() - before
    (row,) = json.loads(res.stdout)["jobs"]
    assert (row["stale"], row["progress"]["step"]) == (False, LAST)
    assert row["goodput"]["lost_steps"] == 100_000
    assert read < 4 << 20, f"ls read {read} bytes of a {size}-byte metrics.jsonl"


def test_progress_reads_the_valid_tail_after_a_damaged_head(tmp_path: Path) -> None:
    root = tmp_path / "run"
    (root / "logs").mkdir(parents=True)
    with (root / "logs" / "metrics.jsonl").open("wb") as f:
        f.write(b"\x00\xff garbage \x01" * 1_000_000)  # 13 MB without a record
        f.write(b'\n{"step": 41, "loss": 3.0, "time": 5.0}\n{"step": 42, "loss": 2.0}\n')
    prog, why = read_progress(root)
    assert why == "" and prog is not None
    assert (prog.step, prog.loss) == (42, 2.0)


# --------------------------------------------- 4. one exit code for a cancel, anywhere


def _ended_local_run(root: Path, exit_code: int, markers: dict[str, str]) -> Path:
    (root / "logs").mkdir(parents=True)
    (root / "job.yaml").write_text("name: x\ntrain:\n  steps: 20\n")
    (root / "local.exit").write_text(f"{exit_code}\n")
    for name, text in markers.items():
        (root / name).write_text(text)
    return root


@pytest.mark.parametrize(
    ("markers", "code"),
    [
        # A cancel before any checkpoint: torchrun's 1 after the TERM, nothing saved.
        ({"CANCELLED": '{"kind": "cancelled"}\n'}, 143),
        # A cancel whose ranks saved step 4 on the way out: still a cancel.
        ({"CANCELLED": '{"kind": "cancelled"}\n',
          "PREEMPTED": '{"kind": "preempted", "step": 4, "signal": "SIGTERM"}\n'}, 143),
        # A preemption's save (a warning signal): 42, the one code that says "saved".
        ({"PREEMPTED": '{"kind": "preempted", "step": 4, "signal": "SIGUSR1"}\n'}, 42),
    ],
)  # fmt: skip
def test_status_watch_exits_143_for_a_cancel_and_42_only_for_a_preemption_s_save(
    tmp_path: Path, markers: dict[str, str], code: int
) -> None:
    run = _ended_local_run(tmp_path / "x", 1, markers)
    remember(JobRef("local", "9", "x", str(run)))
    res = CliRunner().invoke(cli, ["status", "x", "--watch"])
    assert res.exit_code == code, res.output
    assert ("CANCELLED" if code == 143 else "PREEMPTED") in res.stdout


def test_a_cancel_is_143_on_a_cluster_whose_own_code_says_otherwise() -> None:
    """Slurm's and Kubernetes' `exit_code_of` say 1 for a cancelled job; the command
    line says 143 for every cluster (an engineer checks it on the dev Slurm cluster)."""

    class Other:
        def exit_code_of(self, ref: JobRef, st: JobStatus) -> int:
            return 1

    ref = JobRef("slurm", "77", "s", "/nowhere")
    cancelled = JobStatus(JobState.CANCELLED, "CANCELLED by 0", "")
    failed = JobStatus(JobState.FAILED, "FAILED", "")
    assert job_exit_code(Other(), ref, cancelled) == 143  # type: ignore[arg-type]
    assert job_exit_code(Other(), ref, failed) == 1  # type: ignore[arg-type]


@pytest.mark.slow
def test_a_real_local_job_cancelled_before_its_first_checkpoint_exits_143(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SHARDCTL_STOP_AFTER_STEP", raising=False)
    spec = load_spec(tiny_spec(tmp_path, "early", train={"steps": 5000},
                               checkpoint={"every_steps": 5000}))  # fmt: skip
    local = LocalCluster()
    ref = local.submit(spec)
    remember(ref)
    try:
        # At once: the ranks are still starting, long before step 5000's checkpoint.
        # (A rank caught in its start-up may outlast the TERM: killed after 20 s.)
        local.cancel(ref, grace_s=20)
        res = CliRunner().invoke(cli, ["status", "early", "--watch"])
    finally:
        if local.status(ref).state is JobState.RUNNING:
            local.cancel(ref, grace_s=5)
    assert res.exit_code == 143, res.output
    assert "CANCELLED" in res.stdout
    assert not list((tmp_path / "early" / "checkpoints").glob("step-*"))


# ------------------------- 5. goodput of requeues without progress, and of a first step


def _goodput_run(root: Path, attempts: list[dict[str, Any]], rows: list[dict[str, Any]]) -> Path:
    (root / "logs").mkdir(parents=True)
    (root / "attempts.jsonl").write_text("".join(json.dumps(a) + "\n" for a in attempts))
    (root / "logs" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def test_a_run_that_requeues_after_every_step_has_next_to_no_goodput(tmp_path: Path) -> None:
    # Slurm job 55, five attempts: each started at 100 i s, spent 90 s starting up,
    # logged step i + 1 at 100 i + 90 s, saved it on the time limit's warning and was
    # requeued at 100 i + 95 s. No attempt logged two steps: no step time is known, so
    # all of it is start-up. (Before: each first step took its 90 s: 450 of 475 s, 95 %.)
    attempts = [
        {"job": "55", "start": T0 + 100 * i, "end": T0 + 100 * i + 95, "kind": "preempted",
         "decision": "retry", "checkpoint_step": i + 1}
        for i in range(5)
    ]  # fmt: skip
    rows = [{"step": i + 1, "loss": 2.0, "time": T0 + 100 * i + 90} for i in range(5)]
    good = goodput(_goodput_run(tmp_path / "r", attempts, rows), "55", now=T0 + 1000)
    assert good is not None
    data = good.to_json()
    assert (data["effective"], data["training_s"], data["wall_s"]) == (0.0, 0.0, 475.0)
    assert (data["restarts"], data["lost_steps"]) == (5, 0)
    assert data["notes"] == ["5 attempts logged one step and no step time is known: "
                             "counted as start-up"]  # fmt: skip
    assert good.percent() == "0 %"


def test_the_first_step_of_a_run_still_starting_is_not_100_percent(tmp_path: Path) -> None:
    # A local run claimed its attempt at T0, started up for 30 s, logged step 1 at 30 s;
    # asked at 30 s. (Before: the 30 s before step 1 were its step time: 100 %.)
    root = _goodput_run(tmp_path / "r", [], [{"step": 1, "loss": 9.0, "time": T0 + 30}])
    (root / "CURRENT_ATTEMPT").write_text("local-0\n")
    os.utime(root / "CURRENT_ATTEMPT", (T0, T0))
    first = goodput(root, "local-0", running=True, now=T0 + 30)
    assert first is not None and first.to_json()["effective"] == 0.0
    # Step 2 a second later: a pace of 1 s per step, step 1 took 1 s of the 30: 2 of 31 s.
    with (root / "logs" / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"step": 2, "loss": 8.0, "time": T0 + 31}) + "\n")
    second = goodput(root, "local-0", running=True, now=T0 + 31)
    assert second is not None
    assert second.to_json()["effective"] == round(2 / 31, 4)


def test_an_attempt_with_one_step_is_timed_at_the_job_s_pace(tmp_path: Path) -> None:
    # Attempt 1: steps 1..10 at 1..10 s (1 s per step), saved 10, preempted at 11 s.
    # Attempt 2: started at 11 s, 30 s of start-up, step 11 at 41 s, done at 41 s: its
    # one step takes the job's 1 s. Kept 10 + 1 of 11 + 30 s. (Before: 10 + 30 of 41.)
    attempts = [
        {"job": "55", "start": T0, "end": T0 + 11, "kind": "preempted", "decision": "retry",
         "checkpoint_step": 10},
        {"job": "55", "start": T0 + 11, "end": T0 + 41, "kind": "done", "decision": "finish",
         "checkpoint_step": 11},
    ]  # fmt: skip
    rows = [{"step": s, "loss": 2.0, "time": T0 + s} for s in range(1, 11)]
    rows.append({"step": 11, "loss": 2.0, "time": T0 + 41})
    good = goodput(_goodput_run(tmp_path / "r", attempts, rows), "55", now=T0 + 100)
    assert good is not None
    data = good.to_json()
    assert (data["training_s"], data["wall_s"]) == (11.0, 41.0)
    assert data["effective"] == round(11 / 41, 4) and data["notes"] == []


# ------------------------------------------ 6. a second Ctrl-C says what became of the run

# A workload that outlasts a cancel's SIGTERM (it ignores it), so that the cancel is
# still waiting for it when the next Ctrl-C comes; torchrun kills it 30 s on.
DEAF_SCRIPT = """\
import signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("deaf and ready", flush=True)
time.sleep(300)
"""
# The CLI as a terminal's foreground process runs it: Ctrl-C raises KeyboardInterrupt
# (a test runner without job control passes SIGINT on ignored).
FOREGROUND_CLI = (
    "import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "runpy.run_module('shardctl.orchestrator.cli', run_name='__main__', alter_sys=True)"
)


def _cli_process(args: list[str], cwd: Path, out: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("SHARDCTL_STOP_AFTER_STEP", None)
    with (out.with_suffix(".out")).open("wb") as stdout, out.with_suffix(".err").open("wb") as err:
        return subprocess.Popen(
            [sys.executable, "-c", FOREGROUND_CLI, *args], cwd=cwd, env=env,
            stdout=stdout, stderr=err, start_new_session=True,
        )  # fmt: skip


def _wait_for(path: Path, text: str, proc: subprocess.Popen[bytes], timeout: float) -> None:
    """Until `path` holds `text` (a deadline-bounded poll)."""
    deadline = time.monotonic() + timeout
    while text not in (path.read_text(errors="replace") if path.exists() else ""):
        assert proc.poll() is None, f"{proc.args} ended ({proc.returncode}) before {text!r}"
        assert time.monotonic() < deadline, f"no {text!r} in {path} after {timeout:.0f} s"
        time.sleep(0.2)


def _deaf_job(tmp_path: Path, name: str) -> Path:
    (tmp_path / "deaf.py").write_text(DEAF_SCRIPT)
    return tiny_spec(tmp_path, name, resources={"procs_per_node": 1})


def _cleanup(name: str, *procs: subprocess.Popen[bytes]) -> None:
    """Stop the job (`cancel`, then what is left by SIGKILL) and the CLI processes."""
    try:
        ref = recall(name)
    except Exception:
        ref = None
    if ref is not None and LocalCluster().status(ref).state is JobState.RUNNING:
        LocalCluster().cancel(ref, grace_s=5)
    for proc in procs:
        kill_group(proc)
        proc.wait(timeout=30)


@pytest.mark.slow
def test_a_second_ctrl_c_on_submit_wait_says_the_run_is_being_cancelled(tmp_path: Path) -> None:
    spec = _deaf_job(tmp_path, "deaf")
    out = tmp_path / "submit"
    proc = _cli_process(["submit", str(spec), "--wait", "--", "deaf.py"], tmp_path, out)
    try:
        _wait_for(out.with_suffix(".out"), "deaf and ready", proc, 240)
        proc.send_signal(signal.SIGINT)  # the first: cancel, and keep following
        _wait_for(out.with_suffix(".out"), "stopping the run", proc, 60)
        proc.send_signal(signal.SIGINT)  # the second, while the cancel waits
        rc = proc.wait(timeout=60)
        err = out.with_suffix(".err").read_text()
        assert rc == 130, err
        assert "Aborted!" not in err and "Traceback" not in err, err
        assert "stopped following; deaf is being cancelled" in err
        assert "`shardctl status deaf --watch`" in err
    finally:
        _cleanup("deaf", proc)


@pytest.mark.slow
def test_ctrl_c_on_cancel_says_the_run_is_being_cancelled(tmp_path: Path) -> None:
    spec = _deaf_job(tmp_path, "deaf2")
    local = LocalCluster()
    ref = local.submit(with_command(load_spec(spec), (str(tmp_path / "deaf.py"),)))
    remember(ref)
    launcher_out = tmp_path / "deaf2" / "logs" / "launcher.out"
    out = tmp_path / "cancel"
    proc = None
    try:
        deadline = time.monotonic() + 240
        while "deaf and ready" not in (launcher_out.read_text() if launcher_out.exists() else ""):
            assert time.monotonic() < deadline, "the job never started"
            time.sleep(0.2)
        proc = _cli_process(["cancel", "deaf2"], tmp_path, out)
        deadline = time.monotonic() + 60
        while not (tmp_path / "deaf2" / "CANCELLED").exists():  # its SIGTERM goes now
            assert time.monotonic() < deadline and proc.poll() is None, "no cancel"
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=60)
        err = out.with_suffix(".err").read_text()
        assert rc == 130, err
        assert "Aborted!" not in err and "Traceback" not in err, err
        assert "stopped waiting for the cancel; deaf2 is being cancelled" in err
    finally:
        _cleanup("deaf2", *([proc] if proc is not None else []))


# ------------------------------------------------- 7. the code that ran, recorded


def _git(repo: Path, *args: str) -> str:
    done = subprocess.run(
        ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.com", *args],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    return done.stdout.strip()


def _repo(folder: Path, files: dict[str, str]) -> str:
    """A git repository at `folder` with `files` committed; its commit."""
    folder.mkdir(parents=True, exist_ok=True)
    _git(folder, "init", "-q")
    for name, text in files.items():
        (folder / name).write_text(text)
    _git(folder, "add", *files)
    _git(folder, "commit", "-q", "-m", "first")
    return _git(folder, "rev-parse", "HEAD")


def _submit_without_starting(monkeypatch: pytest.MonkeyPatch, *args: str) -> dict[str, Any]:
    """`submit ARGS` with the start of the job left out (nothing runs); its record."""

    def schedule(self: LocalCluster, dryrun: Any) -> JobRef:
        return JobRef("local", "", dryrun.spec.name, dryrun.spec.run_dir, {"attempt": 0})

    monkeypatch.setattr(LocalCluster, "schedule", schedule)
    res = CliRunner().invoke(cli, ["submit", *args])
    assert res.exit_code == 0, res.output
    (record,) = jobs_dir().glob("*.json")
    return json.loads(record.read_text())


def test_submit_records_the_spec_s_commit_and_status_shows_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    repo = tmp_path / "project"
    repo.mkdir()
    spec = tiny_spec(repo, "run")
    commit = _repo(repo, {"run.yaml": spec.read_text()})
    (repo / "notes.txt").write_text("untracked: the tree is still clean\n")
    record = _submit_without_starting(monkeypatch, str(spec))
    assert record["extra"]["code"] == {
        "folder": str(repo), "repo": str(repo), "commit": commit, "dirty": False,
    }  # fmt: skip
    res = CliRunner().invoke(cli, ["status", "run"])
    assert f"  code: git {commit[:12]} (clean) in {repo}\n" in res.stdout
    data = json.loads(CliRunner().invoke(cli, ["status", "run", "-o", "json"]).stdout)
    assert data["code"]["commit"] == commit and data["code"]["dirty"] is False

    with spec.open("a") as f:  # a tracked file changed since the commit
        f.write("# tried another lr\n")
    for path in jobs_dir().glob("*.json"):
        path.unlink()
    record = _submit_without_starting(monkeypatch, str(spec))
    assert (record["extra"]["code"]["commit"], record["extra"]["code"]["dirty"]) == (commit, True)
    res = CliRunner().invoke(cli, ["status", "run"])
    assert f"code: git {commit[:12]} (dirty: tracked files differ from it)" in res.stdout


def test_an_entrypoint_records_its_script_s_repository(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    code = tmp_path / "code"
    commit = _repo(code, {"train.py": "print('hi')\n"})
    (tmp_path / "specs").mkdir()  # no repository: the script's is the one recorded
    spec = tiny_spec(tmp_path / "specs", "mine")
    record = _submit_without_starting(monkeypatch, str(spec), "--", str(code / "train.py"))
    assert record["extra"]["code"]["repo"] == str(code)
    assert record["extra"]["code"]["commit"] == commit


def test_outside_any_repository_nothing_is_recorded_and_nothing_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = tiny_spec(tmp_path, "bare")
    assert subprocess.run(["git", "-C", str(tmp_path), "rev-parse"], capture_output=True,
                          timeout=60).returncode != 0  # fmt: skip
    record = _submit_without_starting(monkeypatch, str(spec))
    assert record["extra"]["code"] == {
        "folder": str(tmp_path), "repo": None, "commit": None, "dirty": None,
    }  # fmt: skip
    res = CliRunner().invoke(cli, ["status", "bare"])
    assert f"  code: {tmp_path} is no git repository (no commit recorded)" in res.stdout


# ------------------------------------------------------------ 8. ls --state, a name glob


@pytest.fixture
def three_jobs(tmp_path: Path) -> None:
    """sweep-a SUCCEEDED, sweep-b FAILED, other PREEMPTED (local run dirs as they end)."""
    for name, code, markers in (
        ("sweep-a", 0, {}),
        ("sweep-b", 1, {}),
        ("other", 1, {"PREEMPTED": '{"kind": "preempted", "step": 4, "signal": "SIGUSR1"}\n'}),
    ):
        remember(JobRef("local", "1", name, str(_ended_local_run(tmp_path / name, code, markers))))


def _names(*args: str) -> set[str]:
    res = CliRunner().invoke(cli, ["ls", *args, "-o", "json"])
    assert res.exit_code == 0, res.output
    return {job["name"] for job in json.loads(res.stdout)["jobs"]}


@pytest.mark.usefixtures("three_jobs")
def test_ls_filters_by_state_and_by_a_name_glob() -> None:
    assert _names() == {"sweep-a", "sweep-b", "other"}
    assert _names("sweep-*") == {"sweep-a", "sweep-b"}
    assert _names("--state", "failed,preempted") == {"sweep-b", "other"}
    assert _names("--state", "FAILED", "--state", "SUCCEEDED", "sweep-*") == {"sweep-a", "sweep-b"}
    assert _names("--state", "RUNNING") == set()
    res = CliRunner().invoke(cli, ["ls", "--state", "running", "sweep-*"])
    assert res.stdout == "no submitted jobs match --state RUNNING and name 'sweep-*'\n"
    table = CliRunner().invoke(cli, ["ls", "other"]).stdout
    assert "other" in table and "sweep" not in table


@pytest.mark.usefixtures("three_jobs")
def test_ls_refuses_an_unknown_state_in_one_line_with_a_did_you_mean() -> None:
    res = CliRunner().invoke(cli, ["ls", "--state", "RUNNING,faild"])
    assert res.exit_code == 2
    assert res.stderr == (
        "error: --state 'FAILD' is not a job state (did you mean FAILED?); accepted: PENDING, "
        "RUNNING, SUCCEEDED, FAILED, CANCELLED, PREEMPTED, HUNG, UNKNOWN (repeat --state or "
        "separate them with commas)\n"
    )


# The same refusals on real file systems: a read-only and a full tmpfs (mounting one
# needs root; skipped otherwise, saying so).


@contextlib.contextmanager
def _file_system(kind: str) -> Iterator[Path]:
    """A read-only tmpfs, or a full one (a file took all its room)."""
    from test_disk_full import tmpfs

    with tmpfs("64k", read_only=kind == "read-only") as where:
        if kind == "full":
            fd = os.open(where / "filler", os.O_CREAT | os.O_WRONLY)
            with contextlib.suppress(OSError):  # ENOSPC: full
                while os.write(fd, b"\0" * 4096):
                    pass
            os.close(fd)
        yield where


REAL = [("read-only", "Read-only file system (EROFS)"), ("full", "No space left on device")]


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
@pytest.mark.parametrize(("kind", "said"), REAL)
def test_a_state_dir_on_a_real_read_only_or_full_disk_is_refused_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str, said: str
) -> None:
    _never_started(monkeypatch)
    spec = tiny_spec(tmp_path, "job")
    with _file_system(kind) as where:
        monkeypatch.setenv("SHARDCTL_STATE_DIR", str(where / "state"))
        line = _refused(CliRunner().invoke(cli, ["submit", str(spec)]))
    assert f"cannot record jobs in the state dir {where / 'state'}: {said}" in line
    assert not (tmp_path / "job").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
@pytest.mark.parametrize(("kind", "said"), REAL)
def test_a_run_dir_on_a_real_read_only_or_full_disk_is_refused_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str, said: str
) -> None:
    _never_started(monkeypatch)
    with _file_system(kind) as where:
        spec = tiny_spec(tmp_path, "job", run_dir=str(where / "job"),
                         checkpoint={"dir": str(tmp_path / "ckpt")})  # fmt: skip
        line = _refused(CliRunner().invoke(cli, ["submit", str(spec)]))
        assert f"cannot write the run dir {where / 'job'}: {said}" in line
        left = sorted(p.name for p in where.iterdir())
        assert left == ([] if kind == "read-only" else ["filler"])  # no claim, no folder
    assert list(jobs_dir().glob("*.json")) == []

"""`ls`, `status --watch`, `logs -f` and the `submit --wait` progress bar.

The fast tests build run dirs and records by hand; the slow ones run the real loop
(tiny specs, 2 CPU ranks) on the local cluster and drive the CLI in subprocesses, each
in its own session, killed by process group on a timeout.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner
from helpers.ckpt_run import ROOT, kill_group
from helpers.train_run import tiny_spec
from shardctl.orchestrator import outcome as oc
from shardctl.orchestrator.cli import cli
from shardctl.orchestrator.clusters.base import JobRef, JobState, JobStatus
from shardctl.orchestrator.clusters.local import LocalCluster
from shardctl.orchestrator.clusters.records import jobs_dir, remember
from shardctl.orchestrator.clusters.slurm import SlurmCluster
from shardctl.orchestrator.errors import UsageError
from shardctl.orchestrator.progress import (
    MetricsTail,
    ProgressDisplay,
    read_progress,
    straggler,
    total_steps,
)
from shardctl.orchestrator.rundir import RunDir
from shardctl.orchestrator.spec import load_spec

SHARDCTL = [sys.executable, "-m", "shardctl.orchestrator.cli"]


def invoke(*args: str) -> Any:
    return CliRunner().invoke(cli, list(args))


def fake_run(root: Path, steps: int = 20, rows: int = 3, nodes: int = 1) -> Path:
    """A run dir as the loop leaves it: job.yaml and `rows` logged steps."""
    (root / "logs").mkdir(parents=True)
    (root / "job.yaml").write_text(
        yaml.safe_dump(
            {"name": root.name, "resources": {"nodes": nodes, "procs_per_node": 2},
             "train": {"steps": steps}}
        )
    )  # fmt: skip
    with (root / "logs" / "metrics.jsonl").open("w") as f:
        for step in range(1, rows + 1):
            row = {"step": step, "loss": 5.0 - step / 10, "tokens_per_s": 1234.5, "time": 1.0}
            f.write(json.dumps(row) + "\n")
    return root


# ------------------------------------------------------------------ progress


def test_progress_reads_the_last_complete_line_and_the_total(tmp_path: Path) -> None:
    run = fake_run(tmp_path / "r", steps=20, rows=3)
    with (run / "logs" / "metrics.jsonl").open("a") as f:
        f.write('{"step": 4, "loss": 1.')  # cut short by a kill: ignored
    prog, why = read_progress(run)
    assert why == "" and prog is not None
    assert (prog.step, prog.total, prog.loss) == (3, 20, pytest.approx(4.7))
    assert prog.short() == "step 3/20 loss 4.7"
    assert total_steps(tmp_path) is None
    assert read_progress(tmp_path / "gone") == (
        None,
        f"run dir {tmp_path / 'gone'} is not on this machine",
    )
    (tmp_path / "empty").mkdir()
    assert "no step logged yet" in read_progress(tmp_path / "empty")[1]


def test_metrics_tail_returns_only_new_complete_lines(tmp_path: Path) -> None:
    run = fake_run(tmp_path / "r", rows=2)
    tail = MetricsTail(run)
    assert [r["step"] for r in tail.poll()] == [1, 2]
    assert tail.poll() == []
    path = run / "logs" / "metrics.jsonl"
    with path.open("a") as f:
        f.write('{"step": 3, "lo')
    assert tail.poll() == []  # half a line waits for its newline
    with path.open("a") as f:
        f.write('ss": 1.0}\nnot json\n{"step": "x"}\n')
    assert [r["step"] for r in tail.poll()] == [3]


def _logged_by_the_loop(run: Path, capsys: pytest.CaptureFixture[str], steps: int) -> str:
    """What the built-in loop's rank 0 leaves for the progress reader: a real
    `MetricsLogger` appends `steps` lines to metrics.jsonl; returns its console output."""
    from shardctl.train.metrics import MetricsLogger, rank_times

    capsys.readouterr()
    logger = MetricsLogger(run, enabled=True, total_steps=20)
    # Two ranks: rank 1 steps in 0.2 s where rank 0 takes 0.1 s, and loads data slower.
    ranks = rank_times([0.1, 0.2], [0.01, 0.05])
    for step in range(1, steps + 1):
        logger.log(step, loss=5.0 - step / 10, lr=1e-3, grad_norm=1.0, tokens_per_s=1234.5,
                   ranks=ranks)  # fmt: skip
    logger.close()
    return capsys.readouterr().out


def test_the_progress_reader_reads_the_line_the_loop_writes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = fake_run(tmp_path / "r", steps=20, rows=0)
    _logged_by_the_loop(run, capsys, steps=6)
    prog, why = read_progress(run)
    assert why == "" and prog is not None
    assert (prog.step, prog.total, prog.loss, prog.tokens_per_s) == (
        6, 20, pytest.approx(4.4), pytest.approx(1234.5),
    )  # fmt: skip
    assert prog.time is not None and abs(prog.time - time.time()) < 600
    assert [r["step"] for r in MetricsTail(run).poll()] == [1, 2, 3, 4, 5, 6]
    assert straggler(run) == (
        "rank 1 is the slowest in 6 of the last 6 logged steps (step time 0.2 s vs a "
        "median 0.15 s); rank 1 is the slowest at loading data in 6 of the last 6 logged "
        "steps (data time 0.05 s vs a median 0.03 s)"
    )


def test_the_progress_bar_on_a_terminal(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from rich.console import Console

    run = fake_run(tmp_path / "r", steps=20, rows=0)
    printed = _logged_by_the_loop(run, capsys, steps=7)
    assert printed.count("slowest rank 1") == 7  # the loop's own line, as the run prints it
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=120, color_system=None)
    with ProgressDisplay(run, "r", 20, console=console) as display:
        display.write(printed)
        display.write("resumed at step 5 (fr")
        display.write("om checkpoints)\nno newline at the end")
    text = buf.getvalue()
    assert "7/20" in text and "loss 4.3000" in text and "1,234 tok/s" in text and "ETA" in text
    assert "resumed at step 5 (from checkpoints)" in text
    assert "no newline at the end" in text
    assert "grad_norm" not in text and "slowest rank" not in text  # left to the bar


def test_submit_wait_without_a_terminal_prints_plain_lines(tmp_path: Path) -> None:
    """The CLI under a pipe never builds the bar (CliRunner's stdout is not a TTY)."""
    from shardctl.orchestrator.cli import jobs

    calls: list[dict[str, Any]] = []

    class Fake(LocalCluster):
        def follow(self, ref: JobRef, **kw: Any) -> int:  # type: ignore[override]
            calls.append(kw)
            return 0

        def status(self, ref: JobRef) -> JobStatus:
            return JobStatus(JobState.SUCCEEDED, "exit 0", "finished step 4")

    spec = load_spec(tiny_spec(tmp_path, "plain"))
    ref = JobRef("local", "1", "plain", str(tmp_path / "plain"))
    assert jobs.follow_submitted(Fake(), ref, spec) == 0
    assert calls == [{}]  # plain: no write/tick hooks


# ------------------------------------------------------------------------ ls


def test_ls_marks_stale_and_unreadable_records_and_never_crashes(tmp_path: Path) -> None:
    run = fake_run(tmp_path / "done", steps=20, rows=20)
    (run / "local.exit").write_text("0\n")
    remember(JobRef("local", "123", "done", str(run)))
    remember(JobRef("local", "124", "gone", str(tmp_path / "gone")))
    remember(JobRef("mars", "1", "alien", "/nowhere"))
    jobs_dir().joinpath("broken.json").write_text('{"cluster": "lo')
    res = invoke("ls")
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    assert lines[0].split() == ["NAME", "CLUSTER", "ID", "STATE", "STEP", "LOSS", "GOODPUT", "AGE"]
    row = {line.split()[0]: line.split() for line in lines[1:] if line and line[0] != "*"}
    assert row["done"][3:6] == ["SUCCEEDED", "20/20", "3"]
    assert row["gone"][3] == "UNKNOWN*" and row["gone"][4] == "—"
    assert row["broken"][3] == "?*" and row["alien"][3] == "?*"
    notes = "\n".join(line for line in lines if line.startswith("*"))
    assert "gone: local no longer knows the job" in notes
    assert "unreadable record" in notes and "broken.json" in notes
    assert "alien: cannot use cluster 'mars'" in notes and "accepted: local, slurm, k8s" in notes
    assert "Traceback" not in res.output

    data = json.loads(invoke("ls", "-o", "json").stdout)["jobs"]
    by = {j["name"]: j for j in data}
    assert by["done"]["progress"]["step"] == 20 and by["done"]["progress"]["total"] == 20
    assert by["done"]["stale"] is False and by["done"]["age_s"] >= 0
    assert by["gone"]["stale"] is True and by["gone"]["progress"] is None
    assert "not on this machine" in by["gone"]["why"]
    only = json.loads(invoke("ls", "--cluster", "local", "-o", "json").stdout)["jobs"]
    assert sorted(j["name"] for j in only) == ["done", "gone"]
    assert invoke("ps", "--cluster", "mars").exit_code == 2  # not a cluster: click says so


def test_ls_with_no_records() -> None:
    res = invoke("ls")
    assert res.exit_code == 0 and "no submitted jobs" in res.stdout


@pytest.mark.parametrize(
    ("args", "refused"),
    [
        (["ls", "--timeout", "nan"], "'nan' is not a number; accepted: 0.1 to 3600 seconds"),
        (["ls", "--timeout", "inf"], "inf is not in the range 0.1<=x<=3600"),
        (["ls", "--timeout", "1e30"], "1e+30 is not in the range 0.1<=x<=3600"),
        (["status", "j", "-w", "--interval", "nan"], "'nan' is not a number"),
        (["status", "j", "-w", "--interval", "1e30"], "is not in the range 0.1<=x<=3600"),
    ],
)
def test_a_wait_the_clock_cannot_count_is_refused(args: list[str], refused: str) -> None:
    # 1e30 s once reached a lock's wait as an OverflowError (a traceback).
    res = invoke(*args)
    assert res.exit_code == 2 and refused in " ".join(res.output.split()), res.output


def test_a_cluster_that_does_not_answer_does_not_hold_the_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from shardctl.orchestrator.clusters.slurm import SlurmCluster

    release = threading.Event()

    def hang(self: SlurmCluster, ref: JobRef) -> JobStatus:
        release.wait(60)
        return JobStatus(JobState.RUNNING, "RUNNING")

    def hang_many(self: SlurmCluster, refs: list[JobRef]) -> list[JobStatus]:
        return [hang(self, ref) for ref in refs]

    monkeypatch.setattr(SlurmCluster, "status", hang)
    monkeypatch.setattr(SlurmCluster, "status_many", hang_many)  # what `ls` asks Slurm
    remember(JobRef("slurm", "7", "stuck", str(tmp_path / "stuck")))
    remember(JobRef("local", "8", "here", str(tmp_path / "here")))
    try:
        started = time.monotonic()
        res = invoke("ls", "--timeout", "0.5", "-o", "json")
        took = time.monotonic() - started
    finally:
        release.set()
    assert res.exit_code == 0, res.output
    assert took < 30  # the hang lasts 60 s
    by = {j["name"]: j for j in json.loads(res.stdout)["jobs"]}
    assert by["stuck"]["stale"] and "gave no answer within 0.5 s" in by["stuck"]["why_stale"]
    assert by["here"]["state"] == "UNKNOWN"  # the other cluster answered


def test_an_unreachable_k8s_cluster_is_a_stale_row(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config",
            "clusters": [{"name": "c", "cluster": {"server": "http://127.0.0.1:9"}}],
            "users": [{"name": "u", "user": {"token": "t"}}],
            "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
            "current-context": "c",
        })
    )  # fmt: skip
    monkeypatch.setenv("SHARDCTL_KUBECONFIG", str(kubeconfig))
    remember(JobRef("k8s", "ns/far", "far", "/shardctl/runs/far", {"pvc": "runs"}))
    res = invoke("ls", "-o", "json", "--timeout", "60")
    assert res.exit_code == 0, res.output
    (row,) = json.loads(res.stdout)["jobs"]
    assert row["stale"] and "cannot reach the Kubernetes API server" in row["why_stale"]
    assert row["progress"] is None and "PersistentVolumeClaim" in row["why"]


# --------------------------------------------------------------- bad input


def test_logs_filters_need_follow_and_one_of_them(tmp_path: Path) -> None:
    remember(JobRef("local", "1", "j", str(fake_run(tmp_path / "j"))))
    res = invoke("logs", "j", "--node", "0")
    assert res.exit_code == 2 and "--node works with --follow/-f" in res.stderr
    res = invoke("logs", "j", "-f", "--node", "0", "--rank", "1")
    assert res.exit_code == 2 and "one of them" in res.stderr
    res = invoke("logs", "j", "-f", "--node", "-1")
    assert res.exit_code == 2 and "-1" in res.output
    res = invoke("status", "nope", "--watch")
    assert res.exit_code == 1 and "no submitted job named or with id 'nope'" in res.stderr


@pytest.mark.parametrize("nodes", [1, 2])
def test_logs_rank_out_of_range_names_the_world_size(tmp_path: Path, nodes: int) -> None:
    remember(JobRef("local", "1", "j", str(fake_run(tmp_path / "j", nodes=nodes))))
    world = nodes * 2
    res = invoke("logs", "j", "-f", "--rank", str(world))
    assert res.exit_code == 2, res.output
    assert f"--rank {world} is out of range: 'j' has world size {world}" in res.stderr
    assert f"accepted: 0..{world - 1}" in res.stderr
    assert "node" not in res.stderr.split("world size")[0]  # no talk of a node that is not there


def test_status_watch_of_an_ended_job_exits_with_its_code(tmp_path: Path) -> None:
    run = fake_run(tmp_path / "pre", steps=20, rows=4)
    (run / "local.exit").write_text("1\n")
    (run / "PREEMPTED").write_text('{"step": 4, "reason": "signal SIGUSR2"}\n')
    remember(JobRef("local", "9", "pre", str(run)))
    res = invoke("status", "pre", "--watch")
    assert res.exit_code == 42, res.output
    assert "PREEMPTED" in res.stdout and "step 4/20 loss 4.6" in res.stdout
    (run / "PREEMPTED").unlink()
    (run / "local.exit").write_text("0\n")
    res = invoke("status", "pre", "--watch", "-o", "json")
    assert res.exit_code == 0
    assert json.loads(res.stdout.splitlines()[-1])["state"] == "SUCCEEDED"


# Markers as the writers of today write them (`outcome`'s `*_marker` helpers), the
# launcher's exit code → what `status --watch` ends with and the state it shows.
@pytest.mark.parametrize(
    ("marker", "data", "launcher_rc", "exit_code", "shown"),
    [
        ("PREEMPTED", oc.preempted_marker(4, signal.SIGUSR2, "signal SIGUSR2"), 42, 42,
         ["PREEMPTED", "(signal SIGUSR2)", "step 4/20 loss 4.6"]),
        # The typed signal decides: the ranks saved on TERM alone, a cancel, not a preemption.
        ("PREEMPTED", oc.preempted_marker(4, signal.SIGTERM, "signal SIGTERM"), 42, 143,
         ["CANCELLED", "stopped by SIGTERM; checkpoint at step 4"]),
        ("FAILED", oc.failed_marker(78, 1, "bad config"), 1, 78,
         ["FAILED", "exit 78", "bad config"]),
        ("FAILED", oc.failed_marker(5, 1), 1, 5, ["FAILED", "a rank exited with code 5"]),
        ("CANCELLED", oc.cancelled_marker(), 143, 143, ["CANCELLED", "cancelled by the user"]),
        ("DONE", oc.done_marker(20), 0, 0, ["SUCCEEDED", "finished step 20"]),
    ],
)  # fmt: skip
def test_status_watch_reads_the_typed_markers(
    tmp_path: Path, marker: str, data: dict[str, Any], launcher_rc: int, exit_code: int,
    shown: list[str],
) -> None:  # fmt: skip
    run = fake_run(tmp_path / "typed", steps=20, rows=4)
    RunDir.of(run).write_marker(marker, data)
    (run / "local.exit").write_text(f"{launcher_rc}\n")
    remember(JobRef("local", "9", "typed", str(run)))
    res = invoke("status", "typed", "--watch")
    assert res.exit_code == exit_code, res.output
    for text in shown:
        assert text in res.stdout, (text, res.stdout)


# ------------------------------------------------------------ real local runs


# The CLI as a terminal's foreground process runs it: Ctrl-C (SIGINT) raises
# KeyboardInterrupt. A test runner started in the background without job control
# inherits SIGINT ignored, and Python then leaves it ignored in every child.
_FOREGROUND_CLI = (
    "import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "runpy.run_module('shardctl.orchestrator.cli', run_name='__main__', alter_sys=True)"
)


def _start(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", _FOREGROUND_CLI, *args], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, env=env, cwd=cwd, start_new_session=True,
    )  # fmt: skip


def _last_state(watch_output: str) -> str:
    """The last state line `status --watch` printed. Notes under it are indented: a
    straggler note follows whenever one rank was the slowest in most recent steps,
    which a loaded machine makes likely."""
    return [line for line in watch_output.splitlines() if line and not line[0].isspace()][-1]


def _first_line(proc: subprocess.Popen[str], timeout: float) -> str:
    """The first line `proc` prints, waiting at most `timeout` s (a reader thread: a
    plain readline would wait forever for a run that never prints)."""
    assert proc.stdout is not None
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    assert got, f"{proc.args} printed no line in {timeout:.0f} s"
    return got[0]


def _finish(proc: subprocess.Popen[str], timeout: float) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        out, err = proc.communicate()
        raise AssertionError(f"{proc.args} timed out:\n{out[-3000:]}\n{err[-3000:]}") from None
    return proc.returncode, out, err


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("SHARDCTL_STOP_AFTER_STEP", None)
    return env


@pytest.mark.slow
def test_a_real_run_with_the_bar_logs_follow_status_watch_and_ls(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rich.console import Console
    from shardctl.orchestrator.cli.jobs import follow_submitted

    monkeypatch.chdir(tmp_path)
    spec = load_spec(tiny_spec(tmp_path, "run", train={"steps": 6}, checkpoint={"every_steps": 6}))
    local = LocalCluster()
    ref = local.submit(spec)
    remember(ref)
    env = _env()
    follow = _start(["logs", "run", "-f"], env, tmp_path)
    watch = _start(["status", "run", "--watch", "--interval", "0.3"], env, tmp_path)
    buf = io.StringIO()
    try:
        code = follow_submitted(
            local, ref, spec, console=Console(file=buf, force_terminal=True, width=120)
        )
    finally:
        if local.status(ref).state == JobState.RUNNING:
            local.cancel(ref, grace_s=5)
    assert code == 0, local.logs(ref)[-4000:]
    bar = buf.getvalue()
    assert "6/6" in bar and "tok/s" in bar and "loss" in bar
    assert "finished 6 steps" in bar  # other lines still shown above the bar

    rc, out, err = _finish(follow, 120)
    assert rc == 0, err
    assert "step      6/6" in out and "finished 6 steps" in out
    rc, out, err = _finish(watch, 120)
    assert rc == 0, err
    assert out.splitlines()[0].startswith("run (local ")
    assert "SUCCEEDED" in _last_state(out) and "step 6/6" in _last_state(out)

    data = json.loads(invoke("ls", "-o", "json").stdout)["jobs"]
    (row,) = data
    assert (row["state"], row["progress"]["step"], row["progress"]["total"]) == ("SUCCEEDED", 6, 6)


@pytest.mark.slow
def test_ctrl_c_ends_logs_f_cleanly_and_watch_reports_the_cancel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    spec = load_spec(
        tiny_spec(tmp_path, "long", train={"steps": 5000}, checkpoint={"every_steps": 5000})
    )
    local = LocalCluster()
    ref = local.submit(spec)
    remember(ref)
    env = _env()
    follow = _start(["logs", "long", "-f", "--rank", "1"], env, tmp_path)
    watch = None
    try:
        # Start-up of the CLI and the run's first output: minutes on a loaded machine.
        first = _first_line(follow, 300)
        assert first, "logs -f ended before the run printed anything"
        follow.send_signal(signal.SIGINT)
        rc, _, err = _finish(follow, 120)
        assert rc == 130 and "Traceback" not in err, err
        assert "rank 1 runs on node 0" in err and "stopped following" in err
        watch = _start(["status", "long", "--watch", "--interval", "0.3"], env, tmp_path)
        deadline = time.monotonic() + 240
        while not (tmp_path / "long" / "logs" / "metrics.jsonl").is_file():
            assert time.monotonic() < deadline, "no step logged"
            time.sleep(0.3)
        res = invoke("cancel", "long")
        assert res.exit_code == 0, res.output
        rc, out, err = _finish(watch, 180)
        assert rc == 143, out + err  # cancelled (exit-codes.md), saved on the way out or not
        assert "CANCELLED" in _last_state(out)
    finally:
        if local.status(ref).state == JobState.RUNNING:
            local.cancel(ref, grace_s=5)
        for proc in (follow, watch):
            if proc is not None and proc.poll() is None:
                kill_group(proc)


def test_ls_of_local_jobs_imports_no_heavy_client(tmp_path: Path) -> None:
    remember(JobRef("local", "1", "j", str(fake_run(tmp_path / "j"))))
    code = (
        "import sys\n"
        "from shardctl.orchestrator.cli import cli\n"
        "try:\n    cli(['ls'])\nexcept SystemExit:\n    pass\n"
        "heavy = ('torch', 'kubernetes', 'submitit', 'deepspeed', 'transformers')\n"
        "print('HEAVY', sorted(m for m in sys.modules if m.split('.')[0] in heavy))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "HEAVY []" in out.stdout and "j " in out.stdout


def test_slurm_follow_logs_reads_the_per_node_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The file side of Slurm's `logs -f`, without a cluster (with one: the test above)."""
    answers = iter([JobState.RUNNING, JobState.SUCCEEDED])
    monkeypatch.setattr(
        SlurmCluster, "status", lambda self, ref: JobStatus(next(answers, JobState.SUCCEEDED), "x")
    )
    folder = tmp_path / "submitit" / "5"
    folder.mkdir(parents=True)
    (folder / "5_0_log.out").write_text("a\nb")
    (folder / "5_1_log.err").write_text("warn\n")
    ref = JobRef("slurm", "5", "s", str(tmp_path), {"folder": str(folder), "nodes": 2})
    out: list[str] = []
    SlurmCluster().follow_logs(ref, out.append, poll_s=0.01)
    assert "".join(out) == "[node 0/out] a\n[node 1/err] warn\n[node 0/out] b\n"
    out.clear()
    SlurmCluster().follow_logs(ref, out.append, node=1, poll_s=0.01)
    assert "".join(out) == "[node 1/err] warn\n"
    with pytest.raises(UsageError, match=r"--node 2: job 's' has 2 node\(s\); accepted: 0..1"):
        SlurmCluster().follow_logs(ref, out.append, node=2)


def test_slurm_logs_show_the_launchers_stop_as_one_line_naming_the_node_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """scancel reaches torchrun on every node: each node's stderr holds its traceback."""
    monkeypatch.setattr(
        SlurmCluster, "status", lambda self, ref: JobStatus(JobState.CANCELLED, "x")
    )
    cancelled = (Path(__file__).parent / "data" / "torchrun-cancelled.txt").read_text()
    folder = tmp_path / "submitit" / "6"
    folder.mkdir(parents=True)
    err = folder / "6_0_log.err"
    err.write_text("before\n" + cancelled + "after\n")
    ref = JobRef("slurm", "6", "s", str(tmp_path), {"folder": str(folder), "nodes": 1})
    line = (
        "the launcher received SIGTERM and stopped its ranks (not a crash; its full report "
        f"is in {err})"
    )
    shown = SlurmCluster().logs(ref)
    assert "Traceback" not in shown and f"before\n[shardctl] {line}\nafter\n" in shown
    out: list[str] = []
    SlurmCluster().follow_logs(ref, out.append, poll_s=0.01)
    assert (
        "".join(out) == f"[node 0/err] before\n[node 0/err] [shardctl] {line}\n[node 0/err] after\n"
    )
    assert err.read_text().count("Traceback") == 3  # the file keeps the whole report

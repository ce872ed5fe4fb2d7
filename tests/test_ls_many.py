"""`ls` with many recorded jobs: a bounded number of threads and one deadline for all of
them, and Slurm's jobs asked about in one `scontrol` and one `sacct` (the parsers fed
real output of the dev cluster). No Slurm is needed: Slurm is faked at the subprocess
boundary with that output. benchmarks/ls_many.py measures the same at 10 to 1,000 jobs.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from shardctl.orchestrator.cli import cli
from shardctl.orchestrator.cli.jobs import LS_WORKERS
from shardctl.orchestrator.clusters import slurm as slurm_backend
from shardctl.orchestrator.clusters.base import JobRef, JobState, JobStatus
from shardctl.orchestrator.clusters.local import LocalCluster
from shardctl.orchestrator.clusters.records import remember
from shardctl.orchestrator.clusters.slurm import SlurmCluster, queries
from shardctl.orchestrator.errors import ClusterError
from shardctl.orchestrator.outcome import done_marker
from shardctl.orchestrator.rundir import DONE_FILE, RunDir

# Real output of the dev cluster (Slurm 22.05.8), captured with the commands shardctl
# runs: `scontrol show job -o` while it held jobs 312 (cancelled after one requeue)
# and 314 (running on 32 nodes), and `sacct -j 1,28,128,302,308,312,314,99999 -X -n -P -o
# JobID,State,ExitCode,NodeList,Start` (99999: a job it never had).
LISTING = (
    "JobId=312 JobName=recovery-slurm-10777 UserId=root(0) GroupId=root(0) MCS_label=N/A "
    "Priority=4294901460 Nice=0 Account=root QOS=normal JobState=CANCELLED Reason=None "
    "Dependency=(null) Requeue=1 Restarts=1 BatchFlag=1 Reboot=0 ExitCode=0:15 "
    "RunTime=00:01:23 TimeLimit=01:00:00 TimeMin=N/A SubmitTime=2026-11-26T14:49:02 "
    "EligibleTime=2026-11-26T14:49:13 AccrueTime=2026-11-26T14:49:13 "
    "StartTime=2026-11-26T14:49:13 EndTime=2026-11-26T14:50:36 Deadline=N/A "
    "PreemptEligibleTime=2026-11-26T14:49:13 PreemptTime=None SuspendTime=None "
    "SecsPreSuspend=0 LastSchedEval=2026-11-26T14:49:13 Scheduler=Main Partition=debug "
    "AllocNode:Sid=localhost:21841 ReqNodeList=(null) ExcNodeList=(null) NodeList=n[1-16] "
    "BatchHost=n1 NumNodes=16 NumCPUs=16 NumTasks=16 CPUs/Task=1 ReqB:S:C:T=0:0:*:* "
    "TRES=cpu=16,node=16,billing=16 Socks/Node=* NtasksPerN:B:S:C=1:0:*:* CoreSpec=* "
    "MinCPUsNode=1 MinMemoryNode=0 MinTmpDiskNode=0 Features=(null) DelayBoot=00:00:00 "
    "OverSubscribe=OK Contiguous=0 Licenses=(null) Network=(null) "
    "Command=/tmp/shardctl-recovery-ymitp4we/recovery-slurm-10777/submitit/"
    ".submission_file_17ce0f671cde437fb1263698669f637c.sh "
    "WorkDir=/tmp/shardctl-recovery-ymitp4we "
    "StdErr=/tmp/shardctl-recovery-ymitp4we/recovery-slurm-10777/submitit/312/312_0_log.err "
    "StdIn=/dev/null "
    "StdOut=/tmp/shardctl-recovery-ymitp4we/recovery-slurm-10777/submitit/312/312_0_log.out "
    "Power= \n"
    "JobId=314 JobName=recovery-slurm-14962 UserId=root(0) GroupId=root(0) MCS_label=N/A "
    "Priority=4294901458 Nice=0 Account=root QOS=normal JobState=RUNNING Reason=None "
    "Dependency=(null) Requeue=1 Restarts=0 BatchFlag=1 Reboot=0 ExitCode=0:0 "
    "RunTime=00:12:54 TimeLimit=01:00:00 TimeMin=N/A SubmitTime=2026-11-26T14:54:19 "
    "EligibleTime=2026-11-26T14:54:19 AccrueTime=2026-11-26T14:54:19 "
    "StartTime=2026-11-26T14:54:19 EndTime=2026-11-26T15:54:19 Deadline=N/A "
    "PreemptEligibleTime=2026-11-26T14:54:19 PreemptTime=None SuspendTime=None "
    "SecsPreSuspend=0 LastSchedEval=2026-11-26T14:54:19 Scheduler=Main Partition=debug "
    "AllocNode:Sid=localhost:21841 ReqNodeList=(null) ExcNodeList=(null) NodeList=n[1-32] "
    "BatchHost=n1 NumNodes=32 NumCPUs=32 NumTasks=32 CPUs/Task=1 ReqB:S:C:T=0:0:*:* "
    "TRES=cpu=32,node=32,billing=32 Socks/Node=* NtasksPerN:B:S:C=1:0:*:* CoreSpec=* "
    "MinCPUsNode=1 MinMemoryNode=0 MinTmpDiskNode=0 Features=(null) DelayBoot=00:00:00 "
    "OverSubscribe=OK Contiguous=0 Licenses=(null) Network=(null) "
    "Command=/tmp/shardctl-recovery-1bys_ywv/recovery-slurm-14962/submitit/"
    ".submission_file_b5a334bf39e5442286b4a68033d2f5c9.sh "
    "WorkDir=/tmp/shardctl-recovery-1bys_ywv "
    "StdErr=/tmp/shardctl-recovery-1bys_ywv/recovery-slurm-14962/submitit/314/314_0_log.err "
    "StdIn=/dev/null "
    "StdOut=/tmp/shardctl-recovery-1bys_ywv/recovery-slurm-14962/submitit/314/314_0_log.out "
    "Power= \n"
)
SACCT = (
    "1|COMPLETED|0:0|n[1-2]|2026-11-26T11:03:05\n"
    "28|CANCELLED by 0|0:0|n[1-2]|2026-11-26T11:06:56\n"
    "128|CANCELLED by 0|0:0|None assigned|None\n"
    "302|FAILED|9:0|n[1-2]|2026-11-26T14:35:35\n"
    "308|CANCELLED|0:15|n[1-2]|2026-11-26T14:40:09\n"
    "312|CANCELLED|0:15|n[1-16]|2026-11-26T14:49:13\n"
    "314|RUNNING|0:0|n[1-32]|2026-11-26T14:54:19\n"
)
# What `scontrol show job -o` prints, with exit 0, when the controller holds no job.
NO_JOBS = "No jobs in the system\n"


def invoke(*args: str) -> Any:
    return CliRunner().invoke(cli, list(args))


# ------------------------------------------------------------- the parsers


def test_the_controller_listing_is_read_per_job_as_status_reads_one() -> None:
    jobs = queries.parse_controller_listing(LISTING)
    assert sorted(jobs) == ["312", "314"]
    first = LISTING.splitlines()[0]
    assert jobs["312"] == queries.scontrol_fields(first)  # what `status` parses for 312
    assert (jobs["312"]["JobState"], jobs["312"]["Restarts"]) == ("CANCELLED", "1")
    assert (jobs["314"]["NodeList"], jobs["314"]["Reason"]) == ("n[1-32]", "None")
    assert queries.parse_controller_listing(NO_JOBS) == {}
    assert queries.parse_controller_listing("") == {}


def test_the_accounting_lines_are_keyed_by_job() -> None:
    lines = queries.parse_accounting(SACCT)
    assert lines["128"] == "CANCELLED by 0|0:0|None assigned|None"
    assert lines["302"] == "FAILED|9:0|n[1-2]|2026-11-26T14:35:35"
    assert "99999" not in lines
    # The shapes sacct gives an array task and a heterogeneous job's component: they
    # answer for their job, as the first line `sacct -j 5` prints would.
    shaped = queries.parse_accounting("5_1|FAILED|1:0|n1|None\n5_2|COMPLETED|0:0|n1|None\n")
    assert shaped["5"] == "FAILED|1:0|n1|None"
    assert queries.parse_accounting("7+0|RUNNING|0:0|n1|None\n")["7"].startswith("RUNNING")


# ------------------------------------------------- Slurm faked at the subprocess


class FakeSlurm:
    """`scontrol show job -o [ID]` and `sacct -j IDS ...` answered from LISTING and
    SACCT, as the dev cluster answered; every command it ran, in `calls`."""

    def __init__(self, listing: str = LISTING, accounting: str = SACCT) -> None:
        self.held = {line.split()[0].removeprefix("JobId="): line for line in listing.splitlines()}
        self.accounting = accounting.splitlines()
        self.calls: list[list[str]] = []
        self._lock = threading.Lock()

    def __call__(self, argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        with self._lock:
            self.calls.append(list(argv))
        if argv[:4] == ["scontrol", "show", "job", "-o"]:
            if len(argv) == 4:
                out = "".join(f"{line}\n" for line in self.held.values()) or NO_JOBS
                return subprocess.CompletedProcess(argv, 0, out, "")
            if argv[4] in self.held:
                return subprocess.CompletedProcess(argv, 0, self.held[argv[4]] + "\n", "")
            error = "slurm_load_jobs error: Invalid job id specified\n"
            return subprocess.CompletedProcess(argv, 1, "", error)
        if argv[0] == "sacct":
            wanted = set(argv[argv.index("-j") + 1].split(","))
            with_id = argv[-1].startswith("JobID,")
            rows = [ln for ln in self.accounting if ln.split("|", 1)[0] in wanted]
            out = "".join((ln if with_id else ln.split("|", 1)[1]) + "\n" for ln in rows)
            return subprocess.CompletedProcess(argv, 0, out, "")
        raise AssertionError(f"unexpected command {argv}")


@pytest.fixture
def fake_slurm(monkeypatch: pytest.MonkeyPatch) -> FakeSlurm:
    fake = FakeSlurm()
    monkeypatch.setattr(subprocess, "run", fake)
    monkeypatch.setattr(slurm_backend, "_require_slurm", lambda: None)  # no sbatch in CI
    return fake


def _slurm_refs(root: Path) -> list[JobRef]:
    ids = ["1", "28", "128", "302", "312", "314", "99999", "0314", "abc"]
    refs = [JobRef("slurm", i, f"job-{i}", str(root / f"run-{i}")) for i in ids]
    # Job 302's node task recorded why it stopped (read from the run dir either way).
    (root / "run-302").mkdir()
    (root / "run-302" / "attempts.jsonl").write_text(
        json.dumps({"job": "302", "decision": "stop", "summary": "no new checkpoint"}) + "\n"
    )
    return refs


def test_status_many_is_status_of_each_job_with_two_commands(
    fake_slurm: FakeSlurm, tmp_path: Path
) -> None:
    refs = _slurm_refs(tmp_path)
    backend = SlurmCluster()
    one_by_one = [backend.status(ref) for ref in refs]
    assert len(fake_slurm.calls) == 16  # 9 × scontrol, 7 × sacct (312, 314 are held)
    fake_slurm.calls.clear()
    assert backend.status_many(refs) == one_by_one
    # One listing, one sacct for the 5 plain ids the controller does not hold; "0314"
    # and "abc" are not plain: each asked about on its own, as `status` asks.
    assert [c[:2] for c in fake_slurm.calls] == [
        ["scontrol", "show"], ["sacct", "-j"], ["scontrol", "show"], ["sacct", "-j"],
        ["scontrol", "show"], ["sacct", "-j"],
    ]  # fmt: skip
    assert fake_slurm.calls[1][2] == "1,28,128,302,99999"
    by = {ref.job_id: st for ref, st in zip(refs, one_by_one, strict=True)}
    assert by["312"] == JobStatus(
        JobState.CANCELLED, "CANCELLED", "requeued 1 time(s), nodes n[1-16]"
    )
    assert by["314"] == JobStatus(JobState.RUNNING, "RUNNING", "nodes n[1-32]")
    assert by["128"].state is JobState.CANCELLED
    assert by["128"].detail == "exit code 0:0, nodes None assigned"
    assert by["302"].detail == "exit code 9:0, nodes n[1-2], no new checkpoint"
    assert by["99999"] == JobStatus(JobState.UNKNOWN, "", "Slurm knows no job 99999")


def test_an_unanswered_controller_sends_every_job_to_the_accounting(
    fake_slurm: FakeSlurm, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    refs = _slurm_refs(tmp_path)[:7]
    fake_slurm.held.clear()  # the controller restarting: scontrol answers nothing
    monkeypatch.setattr(queries, "SACCT_IDS_PER_CALL", 3)
    statuses = SlurmCluster().status_many(refs)
    assert [c[0] for c in fake_slurm.calls] == ["scontrol", "sacct", "sacct", "sacct"]
    assert statuses[5] == JobStatus(JobState.RUNNING, "RUNNING", "exit code 0:0, nodes n[1-32]")


def test_ls_of_many_slurm_jobs_runs_two_slurm_commands(
    fake_slurm: FakeSlurm, tmp_path: Path
) -> None:
    ids = ["1", "28", "128", "302", "308", "312", "314"]
    for i in range(150):
        job_id = ids[i % len(ids)]
        remember(JobRef("slurm", job_id, f"s{i:03d}", str(tmp_path / f"s{i:03d}")))
    res = invoke("ls", "-o", "json")
    assert res.exit_code == 0, res.output
    assert [c[0] for c in fake_slurm.calls] == ["scontrol", "sacct"]
    jobs = json.loads(res.stdout)["jobs"]
    assert len(jobs) == 150 and not any(j["stale"] for j in jobs)
    assert {j["job_id"]: j["state"] for j in jobs}["314"] == "RUNNING"


def test_a_batch_that_fails_is_said_on_every_row_of_its_cluster(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_client(self: SlurmCluster, refs: list[JobRef]) -> list[JobStatus]:
        raise ClusterError("no Slurm client (sbatch) on PATH")

    monkeypatch.setattr(SlurmCluster, "status_many", no_client)
    for i in range(3):
        remember(JobRef("slurm", str(i + 1), f"s{i}", str(tmp_path / f"s{i}")))
    res = invoke("ls")
    assert res.exit_code == 0 and "Traceback" not in res.output, res.output
    notes = [ln for ln in res.stdout.splitlines() if ln.startswith("* ")]
    assert len(notes) == 3
    assert all("did not answer: no Slurm client (sbatch) on PATH" in n for n in notes)

    # A plugin's status_many that answers for the wrong number of jobs: said, not raised.
    monkeypatch.setattr(SlurmCluster, "status_many", lambda self, refs: [])
    res = invoke("ls")
    assert res.exit_code == 0 and "status_many gave 0 answer(s) for 3 job(s)" in res.stdout


# ------------------------------------------------------------- many local jobs


def _finished_runs(root: Path, n: int) -> None:
    """`n` local jobs as a finished run leaves them: job.yaml, a logged step, exit 0, DONE."""
    for i in range(n):
        run = root / f"j{i:03d}"
        (run / "logs").mkdir(parents=True)
        (run / "job.yaml").write_text(f"name: j{i:03d}\ntrain: {{steps: 5}}\n")
        (run / "logs" / "metrics.jsonl").write_text(json.dumps({"step": 5, "loss": 1.5}) + "\n")
        (run / "local.exit").write_text("0\n")
        RunDir(run).write_marker(DONE_FILE, done_marker(5))
        remember(JobRef("local", str(100_000 + i), f"j{i:03d}", str(run)))


class ThreadCount:
    """Threads started, and the most alive at once (sampled where `status` runs)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, status: Any) -> None:
        self.started = 0
        self.peak = threading.active_count()
        self._lock = threading.Lock()
        start = threading.Thread.start

        def counted_start(thread: threading.Thread) -> None:
            with self._lock:
                self.started += 1
            start(thread)

        def sampled_status(backend: LocalCluster, ref: JobRef) -> JobStatus:
            with self._lock:
                self.peak = max(self.peak, threading.active_count())
            return status(backend, ref)

        monkeypatch.setattr(threading.Thread, "start", counted_start)
        monkeypatch.setattr(LocalCluster, "status", sampled_status)


def test_ls_of_200_local_jobs_uses_a_few_threads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _finished_runs(tmp_path, 200)
    before = threading.active_count()
    count = ThreadCount(monkeypatch, LocalCluster.status)
    began = time.monotonic()
    res = invoke("ls", "-o", "json")
    took = time.monotonic() - began
    assert res.exit_code == 0, res.output
    jobs = json.loads(res.stdout)["jobs"]
    assert len(jobs) == 200
    assert all(j["state"] == "SUCCEEDED" and not j["stale"] for j in jobs), jobs[:3]
    assert all(j["progress"]["step"] == 5 for j in jobs)
    # One thread per job was 200; now at most LS_WORKERS for the one cluster.
    assert count.started <= LS_WORKERS, count.started
    assert count.peak <= before + LS_WORKERS, (count.peak, before)
    assert took < 30, took  # ~1 s on 2 loaded cores; well inside the default 10 s per ls


def test_jobs_of_a_cluster_that_never_answers_are_stale_at_the_deadline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _finished_runs(tmp_path, 100)
    release = threading.Event()
    asked: list[str] = []

    def hang(self: LocalCluster, ref: JobRef) -> JobStatus:
        asked.append(ref.name)
        release.wait(60)
        return JobStatus(JobState.RUNNING, "running")

    count = ThreadCount(monkeypatch, hang)
    try:
        began = time.monotonic()
        res = invoke("ls", "--timeout", "0.5", "-o", "json")
        took = time.monotonic() - began
    finally:
        release.set()
    assert res.exit_code == 0, res.output
    assert took < 10, took  # the deadline holds for all 100 jobs at once, not per job
    jobs = json.loads(res.stdout)["jobs"]
    assert all(j["stale"] and "gave no answer within 0.5 s" in j["why_stale"] for j in jobs)
    assert all(j["state"] == "?" for j in jobs)
    # Each worker asked once and waited; nothing more is asked once the deadline passed.
    assert count.started <= LS_WORKERS and len(asked) <= LS_WORKERS


# ----------------------------------------------------- the job.yaml of each row


def test_a_written_job_yaml_reads_the_same_with_the_fast_parser(tmp_path: Path) -> None:
    """`ls` reads each job's job.yaml (its total steps) with libyaml's parser; every
    rendered job.yaml of the golden files reads the same as with the strict one, and a
    key given twice is still refused."""
    from shardctl.orchestrator.errors import SpecError
    from shardctl.orchestrator.yamlio import read_yaml_file

    golden = sorted((Path(__file__).parent / "golden").glob("*/*/job.yaml"))
    assert len(golden) >= 5
    for path in golden:
        assert read_yaml_file(path, written=True) == read_yaml_file(path), path
    twice = tmp_path / "job.yaml"
    twice.write_text("train:\n  steps: 5\n  steps: 6\n")
    for written in (False, True):
        with pytest.raises(SpecError, match="duplicate key 'steps'"):
            read_yaml_file(twice, written=written)

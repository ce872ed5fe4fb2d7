"""The node agent in a Kubernetes pod: what the rendered launch script execs above the
node's launcher (`__main__.py`):

    python3 -m shardctl.orchestrator.clusters.k8s [--watch-hangs] -- LAUNCHER [ARGS...]

Every pod runs the one node agent (`orchestrator/agent/`) with Kubernetes' adapter
(`PodAdapter`). The agent starts the launcher, passes the kubelet's TERM on to the
ranks, applies the hang rule (`--watch-hangs`, unless `watchdog.enabled: false`: the
watchdog's `HangWatch` reads the ranks' heartbeats at every poll and ends a hung
node's ranks with HUNG and their stacks) and judges the attempt with the one
classifier; "go again" is the pod's exit code, which the operator's policy acts on
(PyTorchJob `restartPolicy: ExitCode`, shardctl's TrainJob runtime: 128-255 restart
the pod, 1-127 fail the job):

- done → 0;
- a preemption (this pod's TERM, or another pod's that made every rank save) →
  128 + 42 = 170: the operator restarts the pod and it resumes;
- a crash or a hang, while this node has restarted fewer than `k8s.backoff_limit`
  times → 128 + shardctl's code (crash 1 → 129, hang 124 → 252; a launcher killed by
  a signal keeps its 128 + N);
- anything else (exit 78, a crash past the bound, attempts without a new complete
  checkpoint) → shardctl's code within 1-127 (78 stays 78): the job stops.

Under another restart policy (`SHARDCTL_EXIT_CODES` unset) the pod exits with the
launcher's own code.

Where a pod's counts survive the pod (`SHARDCTL_POD_COUNTS`): the run dir's
`.attempts/` on the PVC, or, for a job without a volume whose checkpoints are in a
bucket, `<checkpoint dir>/.attempts/` in the bucket; none (a job with neither) means
no restart after a crash or a hang. Two counts per node: its starts (the run
contract's `SHARDCTL_ATTEMPT`) and its restarts after a crash or a hang (the bound).

The attempt token (fence.py) of a pod's start is `k8s-<job>-<start>`: the job's name
and this node's start count. Every pod of a job starts together and ends together (a
pod whose peer is gone loses its collectives and ends too, and the operator restarts
each), so the pods of one attempt count the same starts and agree on the token
without talking to each other. Node 0 claims it (`CURRENT_ATTEMPT`) before its ranks
start; the ranks' markers carry it, and the agent reads only its own attempt's
markers, never by time.

Without a PVC (an `s3://` checkpoint dir) each pod's run dir is its own emptyDir:
every pod claims its token there (global rank 0, which commits each checkpoint's
manifest, may run in any pod) and judges its own launcher from its own ranks'
markers, or, where rank 0's PREEMPTED is out of sight, from its ranks' exits as its
launcher recorded them (every one 42: saved); the operator's success policy takes the
master's end.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from ...agent import NodeAgent, say
from ...agent.core import MARKER_WAIT_S
from ...errors import ShardctlError
from ...fence import claim_attempt
from ...launch import WATCH_HANGS_FLAG
from ...launch_wrapper import read_record
from ...outcome import Decision, Evidence, Kind, Outcome, Verdict, decide, rule_for
from ...rundir import (
    CANCELLED_FILE,
    ENV_ATTEMPT,
    ENV_ATTEMPT_TOKEN,
    ENV_CHECKPOINT_DIR,
    ENV_EXIT_CODES,
    ENV_HEARTBEAT_DIR,
    ENV_JOB_NAME,
    ENV_POD_RESTARTS,
    ENV_RUN_DIR,
    EXIT_FAILED,
    EXIT_PREEMPTED,
    FAILED_FILE,
    HUNG_FILE,
    KILLED_FILE,
)
from ...storage import is_object_url

if TYPE_CHECKING:
    from shardctl.train.watchdog import HangWatch

    from ...s3 import S3Client

# `python -m` of the package (its `__main__`): this module is imported by the package.
MODULE = "shardctl.orchestrator.clusters.k8s"
USAGE = f"usage: python3 -m {MODULE} [{WATCH_HANGS_FLAG}] -- LAUNCHER [ARGS...]"

# Where the pod's counts survive it (a folder on the PVC or an s3:// URL; empty: none).
ENV_POD_COUNTS = "SHARDCTL_POD_COUNTS"
COUNTS_DIR = ".attempts"  # in the run dir (PVC) or beside the checkpoints (bucket)
STARTS_NAME = "node-{node}"  # the node's starts so far, minus one
RESTARTS_NAME = "restarts-node-{node}"  # its restarts after a crash or a hang

# The operator restarts a pod that exits 128-255 and fails the job on 1-127.
RETRYABLE_BASE = 128


def shell_code(code: int) -> int:
    """A process's code as a shell tells it: killed by signal N (-N) is 128 + N."""
    return code if code >= 0 else RETRYABLE_BASE - code


def retryable(code: int) -> int:
    code = shell_code(code)
    return code if code >= RETRYABLE_BASE else RETRYABLE_BASE + code


def permanent(code: int) -> int:
    code = shell_code(code)
    return code if 0 < code < RETRYABLE_BASE else EXIT_FAILED


# ------------------------------------------------------------------ the counts


class PodCounts(Protocol):
    """Small integers that outlive the pod (None: never written)."""

    where: str

    def read(self, name: str) -> int | None: ...

    def write(self, name: str, value: int) -> None: ...


class FolderCounts:
    """Counts in a folder of the PVC: one file per count, the number on one line."""

    def __init__(self, folder: str) -> None:
        self.folder = Path(folder)
        self.where = folder

    def read(self, name: str) -> int | None:
        try:
            return int((self.folder / name).read_text().strip())
        except (OSError, ValueError):
            return None

    def write(self, name: str, value: int) -> None:
        with contextlib.suppress(OSError):
            self.folder.mkdir(parents=True, exist_ok=True)
            (self.folder / name).write_text(f"{value}\n")


class BucketCounts:
    """Counts as small objects under an `s3://` prefix (a pod without a volume)."""

    def __init__(self, url: str) -> None:
        from ...s3 import parse_s3_url

        self.url = parse_s3_url(url)
        self.where = url
        self._client: S3Client | None = None

    def _s3(self) -> S3Client:
        # Imported on first use: boto3 is heavy, and a pod on a volume never needs it.
        if self._client is None:
            from ...s3 import S3Client

            self._client = S3Client()
        return self._client

    def read(self, name: str) -> int | None:
        target = self.url.child(name)
        s3 = self._s3()
        if not s3.exists(target):
            return None
        try:
            return int(s3.read_bytes(target).decode().strip())
        except ValueError:
            return None

    def write(self, name: str, value: int) -> None:
        self._s3().put_bytes(f"{value}\n".encode(), self.url.child(name))


def pod_counts(where: str) -> PodCounts | None:
    """The counts at `where` (`SHARDCTL_POD_COUNTS`): a bucket prefix, a folder, or
    None where nothing outlives the pod."""
    if not where:
        return None
    return BucketCounts(where) if is_object_url(where) else FolderCounts(where)


def counts_place(run_dir: str, checkpoint_dir: str, on_volume: bool) -> str:
    """Where a pod's counts survive it: the run dir on the PVC, else a bucket
    checkpoint dir, else nowhere ('')."""
    if on_volume:
        return f"{run_dir}/{COUNTS_DIR}"
    if is_object_url(checkpoint_dir):
        return f"{checkpoint_dir.rstrip('/')}/{COUNTS_DIR}"
    return ""


def own_run_dir(counts_where: str) -> bool:
    """Whether each pod's run dir is its own (an emptyDir, no PVC): the counts are kept
    in the bucket exactly when the job has no volume (`counts_place`)."""
    return is_object_url(counts_where)


class Unreadable:
    """A count the store could not give (said in one line where it was read)."""


UNREADABLE = Unreadable()


def _read(counts: PodCounts | None, name: str) -> int | Unreadable | None:
    """A count; None when never written (or kept nowhere); UNREADABLE when the store
    failed, said in one line."""
    if counts is None:
        return None
    try:
        return counts.read(name)
    except ShardctlError as err:  # the store's failure, or no boto3 in the image
        say(f"cannot read the pod's count {name} at {counts.where}: {err}")
        return UNREADABLE


def _write(counts: PodCounts | None, name: str, value: int) -> None:
    if counts is None:
        return
    try:
        counts.write(name, value)
    except ShardctlError as err:  # the store's failure, or no boto3 in the image
        say(f"cannot keep the pod's count {name} at {counts.where}: {err}")


def count_start(counts: PodCounts | None, node: int) -> int:
    """This start of the node: 0 on its first, +1 on each after (kept in `counts`)."""
    name = STARTS_NAME.format(node=node)
    previous = _read(counts, name)
    # Unreadable: 0. Without a PVC the run dir is the pod's own emptyDir, so no
    # earlier start's marker is there to be taken for this one's.
    start = previous + 1 if isinstance(previous, int) else 0
    _write(counts, name, start)
    return start


# ------------------------------------------------------------------ the adapter


def pod_token(job: str, start: int) -> str:
    """The attempt token of a pod's start (the module docstring says why every pod of
    the attempt derives the same)."""
    return f"k8s-{job}-{start}"


class PodAdapter:
    """Kubernetes' part of the node agent (`agent.Adapter`): one pod's start."""

    cluster = "k8s"
    # The kubelet's TERM reaches the pod's first process (this agent) alone.
    forwards_signals = True

    def __init__(
        self, run_dir: str, job: str, node: int, nodes: int, start: int, *,
        exit_codes: bool, bound: int, counts: PodCounts | None,
        hang: HangWatch | None = None, own_run_dir: bool = False,
    ) -> None:  # fmt: skip
        self.run_dir = run_dir
        # No PVC: the run dir is this pod's emptyDir, read by no other pod.
        self.own_run_dir = own_run_dir
        self.job_id = job
        self.node = node
        self.nodes = nodes
        self.allocation = start
        self.exit_codes = exit_codes
        self.bound = bound
        self.counts = counts
        self.hang = hang
        # The ledger's attempt: this node's start (its restarts and preemptions so far).
        self.retries = start
        self.restarts: int | None = None  # this node's restarts after this one's crash
        self.exit_code = 0

    def token(self, round_: int) -> str | None:
        again = f"-r{round_}" if round_ else ""
        return f"{pod_token(self.job_id, self.allocation)}{again}"

    def claim(self, round_: int) -> None:
        token = self.token(round_)
        if token is not None:
            claim_attempt(self.run_dir, token, cluster="k8s", restart=round_, job=self.job_id)

    def prepare_env(self, env: dict[str, str]) -> None:
        env[ENV_ATTEMPT] = str(self.allocation)
        if self.hang is not None:  # where the ranks beat
            env[ENV_HEARTBEAT_DIR] = str(self.hang.folder)

    def outside_signal(self, signal_name: str) -> bool:
        return False

    def watch(self, round_: int) -> Callable[[int], None] | None:
        return self._look if self.hang is not None else None

    def _look(self, launcher: int) -> None:
        """The hang rule, at every poll of the launcher: a hung node's ranks are ended
        (HUNG, their stacks, SIGKILL) and the launcher's end is judged a hang."""
        if self.hang is not None:
            self.hang.look(launcher)

    def pin_killed(self, round_: int, started: float) -> None:
        """A pod names a killed rank from the markers only."""

    def own_verdict(self, verdict: Verdict, evidence: Evidence) -> Verdict:
        """The pod's decision, which the ledger records (under the operator's exit-code
        policy; else the classifier's is kept). The operator restarts a pod: going
        again is a RETRY — a preemption always, a crash or a hang while this node
        restarted fewer than the bound — and anything else a STOP."""
        if not self.exit_codes:
            return verdict
        outcome = verdict.outcome
        if (
            outcome.kind is Kind.CANCELLED
            and outcome.signal == "SIGTERM"
            and CANCELLED_FILE not in evidence.markers
        ):
            # A pod's TERM is Kubernetes' preemption warning (a deletion, an
            # eviction), this pod's or another's that made every rank save: it resumes.
            outcome = replace(outcome, kind=Kind.PREEMPTED)
        if self._saved_for_another_pod(outcome, evidence):
            outcome = replace(
                outcome, kind=Kind.PREEMPTED, code=None,
                reason="every rank of this pod saved and exited 42 (another pod's preemption)",
            )  # fmt: skip
        if verdict.no_progress:  # node 0's ledger: attempts without a new checkpoint
            return replace(verdict, outcome=outcome)
        kept = _read(self.counts, RESTARTS_NAME.format(node=self.node))
        if self.counts is None or isinstance(kept, Unreadable):
            # Kept nowhere, or unreadable: nothing would bound a crash loop (the
            # operator counts no backoffLimit under ExitCode): a crash or a hang stops.
            bound, restarts = 0, 0
        else:
            bound, restarts = self.bound, kept or 0
        pod = decide(outcome, retries=self.retries, restarts=restarts, max_restarts=bound)
        if pod.decision is Decision.RESTART:
            self.restarts = restarts + 1
            return replace(pod, decision=Decision.RETRY)
        if pod.decision is Decision.RETRY and rule_for(outcome).restart:
            # A hang past the bound: the operator only restarts a pod, so the job stops.
            return replace(pod, decision=Decision.STOP)
        return pod

    def _saved_for_another_pod(self, outcome: Outcome, evidence: Evidence) -> bool:
        """A crash that is a preemption's save: in a run dir of its own the pod cannot
        see rank 0's PREEMPTED (in rank 0's pod), so its ranks' exits, as its launcher
        recorded them (`launch_wrapper`), say it: every one 42, which a rank exits only
        after its save. Not a crash, so not counted against the bound."""
        if not self.own_run_dir or outcome.kind is not Kind.FAILED:
            return False
        if any(name in evidence.markers for name in (FAILED_FILE, HUNG_FILE, KILLED_FILE)):
            return False
        token = self.token(0)
        record = read_record(self.run_dir, token, self.node) if token else None
        codes = [f.get("exitcode") for f in record["failures"]] if record else []
        return bool(codes) and all(code == EXIT_PREEMPTED for code in codes)

    def judged(self, verdict: Verdict, rc: int, round_: int) -> None:
        """Nothing kept: `carry_out` follows at once."""

    def carry_out(self, verdict: Verdict, evidence: Evidence, rc: int, round_: int) -> str:
        """The pod's exit code for the verdict (`own_verdict`'s)."""
        if not self.exit_codes:
            self.exit_code = shell_code(rc)
        elif verdict.decision is Decision.FINISH:
            self.exit_code = 0
        elif verdict.decision is Decision.RETRY:
            self.exit_code = retryable(verdict.exit_code)
            counted = ""
            if self.restarts is not None:
                _write(self.counts, RESTARTS_NAME.format(node=self.node), self.restarts)
                counted = f", restart {self.restarts} of at most {self.bound} of this node"
            say(f"node {self.node}: {verdict.summary()}; the pod exits with "
                f"{self.exit_code} (the operator restarts it{counted})")  # fmt: skip
        else:
            # A stop: the operator fails the job on 1-127.
            self.exit_code = permanent(verdict.exit_code)
            say(f"node {self.node}: {verdict.summary()}; the pod exits with "
                f"{self.exit_code} (the job stops)")  # fmt: skip
        return verdict.decision.value


# ------------------------------------------------------------------ main


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, "") or default)
    except ValueError:
        return default


def main(argv: list[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    watch_hangs = words[:1] == [WATCH_HANGS_FLAG]
    words = words[1:] if watch_hangs else words
    if words[:1] == ["--"]:
        words = words[1:]
    if not words or words[0].startswith("-"):
        print(USAGE, file=sys.stderr)
        return 2
    run_dir = os.environ.get(ENV_RUN_DIR, "")
    if not run_dir:
        print(f"{ENV_RUN_DIR} is not set: the rendered launch script sets it", file=sys.stderr)
        return 2
    folder = _heartbeat_folder() if watch_hangs else None
    try:
        return _run_pod(words, run_dir, folder)
    finally:
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)


def _heartbeat_folder() -> Path | None:
    # The hang rule is the watchdog's library (torch-free), imported where it is used:
    # orchestrator/ imports nothing of train/ at module level.
    from shardctl.train.watchdog import heartbeat_folder

    return heartbeat_folder()


def _run_pod(command: list[str], run_dir: str, folder: Path | None) -> int:
    env = os.environ
    node = _env_int("SHARDCTL_NODE_RANK", 0)
    job = env.get(ENV_JOB_NAME) or Path(run_dir).name
    counts = pod_counts(env.get(ENV_POD_COUNTS, ""))
    own = own_run_dir(env.get(ENV_POD_COUNTS, ""))
    start = count_start(counts, node)
    hang = None
    if folder is not None:
        from shardctl.train.watchdog import HangWatch, launcher_name

        # A pod's start is one attempt (no round in place): the HUNG this process
        # writes carries its token, and the report names its start.
        os.environ[ENV_ATTEMPT_TOKEN] = pod_token(job, start)
        os.environ[ENV_ATTEMPT] = str(start)
        hang = HangWatch(folder)
        say(f"node {node}: watching the ranks of {launcher_name(command)}; {hang.describe()}")
    adapter = PodAdapter(
        run_dir, job, node,
        _env_int("SHARDCTL_NNODES", 1), start,
        exit_codes=env.get(ENV_EXIT_CODES) == "kubernetes",
        bound=_env_int(ENV_POD_RESTARTS, 0), counts=counts, hang=hang, own_run_dir=own,
    )  # fmt: skip
    if own and node != 0:
        # No shared run dir: the agent (node 0) claims only its own pod's. Global rank 0,
        # which commits each checkpoint, may run in any pod (torchrun's c10d rendezvous
        # numbers nodes by arrival) and is fenced by the claim in its pod's run dir.
        adapter.claim(0)
    agent = NodeAgent(
        adapter, command, run_dir, checkpoint_dir=env.get(ENV_CHECKPOINT_DIR) or None,
        # The operator restarts the pod; the agent runs no round in place.
        max_restarts=0,
        # Rank 0, which writes the markers, may run in another pod of a shared run dir;
        # in this pod's own run dir only this pod's ranks write, before the launcher ends.
        marker_wait_s=MARKER_WAIT_S if adapter.nodes > 1 and not own else 0.0,
    )  # fmt: skip
    agent.run()
    return adapter.exit_code

"""The run-directory contract: every file a run owns, its markers and exit codes.

Torch-free and dependency-free: the CLI, every cluster backend, the node tasks and
the ranks import the names from here and nowhere else.

A run directory (`spec.run_dir`, default `runs/<name>` beside the spec file) holds:

    job.yaml, launch.sh, env.sh, ...   the rendered artifacts the nodes run
    rendered/<cluster>/                `shardctl render` output (when not --out)
    logs/                              launcher and rank output, metrics.jsonl
    checkpoints/step-NNNNNNNN/         sharded checkpoints, unless checkpoint.dir
                                       points elsewhere (a scratch file system)
    model/                             the consolidated full state dict
    DONE                               JSON {"kind": "done", "step"}: every step
                                       ran, final save exists (a user script's: its
                                       "command" too, shardctl.train.entry)
    PREEMPTED                          JSON {"kind": "preempted", "step", "signal",
                                       "reason"}: saved on a signal; submit again
                                       (or requeue) to resume. With "saved": false
                                       and "rank": that rank had no handler for the
                                       signal, nothing was saved (still requeued)
    trainer-output.json                JSON {"output_dir"}: where an HF Trainer
                                       script's checkpoint-N folders go (its callback;
                                       outcome.attempt_progress)
    HUNG                               JSON {"kind": "hung", "step", "node", "rank",
                                       "ranks", ...}: the node watchdog found no rank
                                       advancing and ended the ranks
                                       (shardctl.train.watchdog)
    FAILED                             JSON {"kind": "failed", "code", "rank"}: a user
                                       script's own non-zero exit (shardctl.train.entry)
    CANCELLED                          JSON {"kind": "cancelled"}: `shardctl cancel`
                                       (local)
    CURRENT_ATTEMPT                    JSON {"token", ...}: the attempt whose ranks may
                                       publish checkpoints (shardctl.orchestrator.fence);
                                       every marker above carries its writer's
                                       "token" (see below)
    .submit.claim                      held by one `shardctl submit` while it checks
                                       for a live job and submits (cli, clusters/owner)
    attempts.jsonl                     one line per attempt a retrying supervisor
                                       judged (Slurm; local and Slurm per restart
                                       inside the allocation): its start and end, its
                                       outcome and newest complete checkpoint
                                       (progress; goodput.py)
    RESTART                            JSON {"job", "requeue", "restart", "decision"}:
                                       Slurm node 0's verdict on the last round of
                                       the allocation; the other nodes restart their
                                       launchers when it says "restart"
    logs/hang-*.txt                    that watchdog's report and every rank's stack

The typed fields (`kind` and its own) are what supervisors decide on, through
`shardctl.orchestrator.outcome`; `reason` is for people.

Evidence belongs to the attempt that wrote it: every marker written through
`RunDir.write_marker`/`write_first_marker` by a process of a fenced attempt carries
that attempt's token (`"token"`, from `SHARDCTL_ATTEMPT_TOKEN`; fence.py), and a
reader that knows its attempt's token takes a marker as this attempt's only when the
token is the same, however close in time two attempts are and whatever a node's
clock says. Fenced (tokens): the node agent's starts and restarts (local; Slurm's node
task, under submitit and under job.sbatch), so their ranks, watchdogs, KILLED and a
local `cancel`. The time rule (`belongs_to_attempt`) is kept only for evidence with no
token to match: a marker an earlier version wrote (a run dir from before tokens), one
written outside any fenced attempt (Kubernetes pods, `launch.sh` or a script run by
hand), and a reader that has no token. An attempt's progress is judged by checkpoint
step, never by a time (`attempts.attempt_progress`).

Exit codes of a rank (and of a launcher that passes them on): `EXIT_OK`,
`EXIT_FAILED`, `EXIT_SPEC` (bad input), `EXIT_DO_NOT_RETRY` (a user script's
permanent error: never retried) and `EXIT_PREEMPTED` (saved a checkpoint
because of a preemption signal: resume me). A node's watchdog exits `EXIT_HUNG` when
it ended ranks that stopped advancing (nothing was saved: resume from the newest
complete checkpoint). torchrun and accelerate turn any
non-zero rank exit into their own 1, which is why the markers exist.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .durable import write_text_atomic

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_SPEC = 2
EXIT_PREEMPTED = 42
# A user's script says "do not retry": a permanent error (a bad config, a missing data
# set) that every retry would repeat (`shardctl.train.api.EXIT_DO_NOT_RETRY`,
# `api.permanent_failure`). sysexits' EX_CONFIG: clear of 0, 1, 2, 42, 124, of the
# shell's 126/127 and of the 128+N of a signal; inside Kubeflow's ExitCode policy's
# permanent range (1-127).
EXIT_DO_NOT_RETRY = 78
# Stopped from outside (`shardctl cancel`, Ctrl-C on `submit --wait`, Slurm's
# scancel): 128 + SIGTERM, what a shell reports for a process TERM ended. One code on
# every cluster, whether or not the ranks saved a checkpoint on the way out (42 means
# a preemption's save alone).
EXIT_CANCELLED = 143
# `timeout(1)`'s code for "ran out of time". Kubeflow's ExitCode restart policy counts
# 1-127 as permanent: restart_policy OnFailure (the default) restarts a hung pod.
EXIT_HUNG = 124

# The run contract: what every rank finds in its environment, beside the launcher's
# RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT (docs/reference/
# run-contract.md). Set by the rendered launch script on every cluster.
ENV_RUN_DIR = "SHARDCTL_RUN_DIR"  # the run directory
ENV_CHECKPOINT_DIR = "SHARDCTL_CHECKPOINT_DIR"  # where step-N folders go
ENV_JOB_NAME = "SHARDCTL_JOB_NAME"
ENV_ATTEMPT = "SHARDCTL_ATTEMPT"  # 0 on the first start, +1 on each requeue or restart
# This attempt's token, set by a supervisor that fences (shardctl.orchestrator.fence):
# a rank saves only while it equals the token in CURRENT_ATTEMPT.
ENV_ATTEMPT_TOKEN = "SHARDCTL_ATTEMPT_TOKEN"
# Restarts inside this allocation so far (`restart.max_in_allocation`): 0 on an
# allocation's first start, set by the supervisor that restarts in place (local, Slurm).
ENV_RESTART = "SHARDCTL_RESTART"
# Set by a supervisor above the node's launcher that judges every attempt from the
# markers (Slurm's node task: "slurm"); the node watchdog then leaves a lost peer's
# exit as it is instead of waiting for another node's HUNG.
ENV_NODE_SUPERVISOR = "SHARDCTL_NODE_SUPERVISOR"
ENV_SPEC = "SHARDCTL_SPEC"  # the rendered job.yaml (checkpoint.every_steps, keep ...)
ENV_ACCELERATE_CONFIG = "SHARDCTL_ACCELERATE_CONFIG"  # where one was rendered
ENV_DEEPSPEED_CONFIG = "SHARDCTL_DEEPSPEED_CONFIG"  # where one was rendered
# Hang detection (the spec's `watchdog:`): the node agent (or, in a launch.sh run by
# hand, the node watchdog) makes a folder for the ranks' heartbeats and exports it; the
# timeouts are rendered into env.sh.
ENV_HEARTBEAT_DIR = "SHARDCTL_HEARTBEAT_DIR"
# `launch.sh`'s answer to a node agent that offered to apply the hang rule (it set
# ENV_HEARTBEAT_DIR): "agent" when the spec wants hang detection, so the script runs
# no watchdog; the agent watches only a launcher whose environment says so.
ENV_HANG_WATCHER = "SHARDCTL_HANG_WATCHER"
ENV_HANG_TIMEOUT = "SHARDCTL_HANG_TIMEOUT_S"  # empty: derived (shardctl.train.watchdog)
ENV_STARTUP_TIMEOUT = "SHARDCTL_STARTUP_TIMEOUT_S"  # empty: derived (the watchdog)
ENV_COLLECTIVE_TIMEOUT = "SHARDCTL_COLLECTIVE_TIMEOUT_S"  # the process group's timeout
# Kubernetes: the pod's node agent turns its verdict into an exit code the operator acts
# on ("kubernetes"; unset: the launcher's code as it is), and restarts a crash or a hang
# of this node at most this many times (orchestrator/clusters/k8s/node_agent.py).
ENV_EXIT_CODES = "SHARDCTL_EXIT_CODES"
ENV_POD_RESTARTS = "SHARDCTL_POD_RESTARTS"
# "0": an entrypoint's HF Trainer is left as transformers made it
# (`entrypoint.hf_trainer_auto: false`; shardctl.train.hf_auto).
ENV_HF_TRAINER_AUTO = "SHARDCTL_HF_TRAINER_AUTO"
# How long a rank whose script has no SIGUSR2 handler yet holds the warning for one
# (seconds; `shardctl.train.preemption`); a cluster with a known grace period sets it.
ENV_WARNING_HOLD = "SHARDCTL_WARNING_HOLD_S"
CONTRACT_ENV = (
    ENV_RUN_DIR, ENV_CHECKPOINT_DIR, ENV_JOB_NAME, ENV_ATTEMPT, ENV_SPEC,
    ENV_ACCELERATE_CONFIG, ENV_DEEPSPEED_CONFIG,
)  # fmt: skip

DONE_FILE = "DONE"
PREEMPTED_FILE = "PREEMPTED"
FAILED_FILE = "FAILED"  # JSON {"code", "rank"}: a user script's own non-zero exit
HUNG_FILE = "HUNG"  # JSON: written by the node watchdog that declared the job hung
# JSON {"rank", "node", "host", "signal", "code"}: a rank killed by a signal, from its
# node's launcher record (`launch_wrapper`; a killed rank writes nothing itself);
# written by the node's supervisor (Slurm's node task).
KILLED_FILE = "KILLED"
CANCELLED_FILE = "CANCELLED"  # JSON {"kind": "cancelled"}: written by a local `cancel`
CURRENT_ATTEMPT_FILE = "CURRENT_ATTEMPT"  # JSON {"token", ...}: the attempt that may save
SUBMIT_CLAIM_FILE = ".submit.claim"  # held by one `shardctl submit` while it submits
# One JSON line per judged attempt of a retrying supervisor (job, attempt, outcome,
# the newest complete checkpoint step, whether it published a new one): the
# evidence of "no progress" (`shardctl.orchestrator.outcome`).
ATTEMPTS_FILE = "attempts.jsonl"
# Slurm: node 0's decision on each round inside an allocation (clusters/slurm NodeTask).
RESTART_FILE = "RESTART"
# JSON lines: the hosts a Slurm requeue left behind after a fault pinned on them.
LEFT_BEHIND_FILE = "nodes-left-behind.jsonl"
SPEC_FILE = "job.yaml"
LAUNCH_FILE = "launch.sh"
ENV_FILE = "env.sh"
LOGS_DIR = "logs"
MODEL_DIR = "model"
CHECKPOINTS_DIR = "checkpoints"
RENDERED_DIR = "rendered"


@dataclass(frozen=True)
class RunDir:
    """Paths of one run's files, below `root` (which may be relative)."""

    root: Path

    @classmethod
    def of(cls, path: str | Path) -> RunDir:
        return cls(Path(path))

    @property
    def logs(self) -> Path:
        return self.root / LOGS_DIR

    @property
    def model(self) -> Path:
        return self.root / MODEL_DIR

    @property
    def spec_file(self) -> Path:
        return self.root / SPEC_FILE

    @property
    def launch_script(self) -> Path:
        return self.root / LAUNCH_FILE

    @property
    def done_file(self) -> Path:
        return self.root / DONE_FILE

    @property
    def preempted_file(self) -> Path:
        return self.root / PREEMPTED_FILE

    def rendered(self, cluster: str) -> Path:
        return self.root / RENDERED_DIR / cluster

    # -- markers ------------------------------------------------------------------

    def write_marker(self, name: str, data: dict[str, Any]) -> None:
        """Write a marker (DONE, PREEMPTED) atomically: readers never see half of one.
        It carries this process's attempt token (`stamped`)."""
        self.root.mkdir(parents=True, exist_ok=True)
        write_text_atomic(self.root / name, json.dumps(stamped(data)) + "\n", durable=False)

    def write_first_marker(
        self, name: str, data: dict[str, Any], since: float, token: str | None = None
    ) -> bool:
        """Write marker `name` unless a writer of this attempt (its token: `token`, else
        this process's; started at `since`) was first: the first to fail names the
        cause, the others keep it (O_EXCL). An earlier attempt's marker is replaced.
        True when this call wrote it; False also when the run dir is unwritable."""
        path = self.root / name
        data = stamped(data, token)
        try:
            if path.exists() and not self._belongs(name, since, data.get(TOKEN_FIELD)):
                path.unlink()  # an earlier attempt's
            self.root.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except OSError:
            return False
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(data) + "\n")
        return True

    def _belongs(self, name: str, since: float, token: str | None) -> bool:
        """Whether marker `name`, as it is now, is the attempt's (`belongs_to_attempt`)."""
        try:
            mtime = (self.root / name).stat().st_mtime
        except OSError:
            return False
        return belongs_to_attempt(self.read_marker(name), mtime, since, token)

    def read_marker(self, name: str) -> dict[str, Any] | None:
        """A marker's JSON object, or None when it is absent or unreadable."""
        try:
            data = json.loads((self.root / name).read_text())
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def fresh_marker(
        self, name: str, since: float, token: str | None = None
    ) -> dict[str, Any] | None:
        """The marker when it is this attempt's (`belongs_to_attempt`: its token is
        `token`, else this process's; without tokens, written at or after `since`),
        else None — an earlier attempt's is stale."""
        try:
            mtime = (self.root / name).stat().st_mtime
        except OSError:
            return None
        data = self.read_marker(name)
        return data if belongs_to_attempt(data, mtime, since, token or attempt_token()) else None

    def wait_for_marker(
        self, name: str, since: float, seconds: float, token: str | None = None
    ) -> dict[str, Any] | None:
        """`fresh_marker`, polled for up to `seconds` (another node may still write it)."""
        deadline = time.monotonic() + seconds
        while True:
            found = self.fresh_marker(name, since, token)
            if found is not None or time.monotonic() >= deadline:
                return found
            time.sleep(0.5)

    def done_step(self) -> int | None:
        """The step recorded in DONE, or None when the run has none (or it is corrupt)."""
        data = self.read_marker(DONE_FILE)
        try:
            return int(data["step"]) if data is not None else None
        except (KeyError, TypeError, ValueError):
            return None

    def done_command(self) -> list[str] | None:
        """The command a user script's DONE records (`shardctl.train.entry`), or None."""
        data = self.read_marker(DONE_FILE)
        command = data.get("command") if data is not None else None
        if isinstance(command, list) and all(isinstance(w, str) for w in command):
            return command
        return None

    def is_complete(self, steps: int) -> bool:
        step = self.done_step()
        return step is not None and step >= steps


# The field of a marker that names the attempt whose process wrote it (its token).
TOKEN_FIELD = "token"
# An attempt's start and a marker's file time may differ by this much on a shared
# file system (clock skew): the time rule for markers without a token (older versions,
# unfenced writers; `belongs_to_attempt`), never used when both tokens are known.
CLOCK_SLACK_S = 1.0


def attempt_token() -> str | None:
    """This process's attempt token (`SHARDCTL_ATTEMPT_TOKEN`), None outside one."""
    return os.environ.get(ENV_ATTEMPT_TOKEN) or None


def stamped(data: dict[str, Any], token: str | None = None) -> dict[str, Any]:
    """`data` with the writer's attempt token (`token`, else this process's) in
    `TOKEN_FIELD`, unless it names one already or there is none."""
    token = token or attempt_token()
    if token is None or isinstance(data.get(TOKEN_FIELD), str):
        return data
    return {**data, TOKEN_FIELD: token}


def belongs_to_attempt(
    data: dict[str, Any] | None, mtime: float, since: float, token: str | None
) -> bool:
    """Whether a marker (`data`, file time `mtime`) is evidence of the attempt whose
    token is `token` and which started at `since`. Both tokens known: they must be
    equal, whatever the times (two attempts may start in the same second, a node's
    clock may be skewed). The time rule — written at or after `since`, within
    `CLOCK_SLACK_S` — is the fallback for what carries no token: a marker of an older
    version, or of a writer outside a fenced attempt (`launch.sh` or a script run by
    hand), and a reader that knows no token."""
    written_by = data.get(TOKEN_FIELD) if data is not None else None
    if token and isinstance(written_by, str) and written_by:
        return written_by == token
    return mtime >= since - CLOCK_SLACK_S


def default_run_dir(name: str) -> str:
    return f"runs/{name}"


def default_checkpoint_dir(run_dir: str) -> str:
    return f"{run_dir.rstrip('/') or '/'}/{CHECKPOINTS_DIR}"

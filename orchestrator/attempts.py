"""A run's attempts ledger and the progress it judges, torch-free.

The no-progress rule of `outcome.decide` needs to know, for each attempt, whether it
published a new complete checkpoint: judged by step (newer than the newest when the
attempt started), never by a file time, which two attempts in one second or a skewed
clock would confuse. Here: the newest complete checkpoint of a run
without importing `train/` (shardctl's `step-N/`, from the one lister
`checkpoint_list`; a Hugging Face Trainer's `checkpoint-N/` with its
`trainer_state.json`, read here), the attempt's `Progress`, and the run dir's
`attempts.jsonl`, one line per judged attempt (`record_attempt`), which `status` reads
for why a job stopped (`last_attempt`) and `goodput.py` for the timeline. `outcome`
imports this module; it imports only `rundir`, `checkpoint_list`, `storage` and
`errors` (all torch-free). A checkpoint dir in a bucket (`s3://`) is read there.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .checkpoint_list import complete_checkpoints
from .errors import MissingDependencyError, ObjectStoreError
from .rundir import ATTEMPTS_FILE, CHECKPOINTS_DIR, RunDir
from .storage import COMMIT_MARKER, is_object_url

if TYPE_CHECKING:
    from .outcome import Verdict


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


# The commit marker under its older name here (`outcome` re-exports it).
CHECKPOINT_COMMIT = COMMIT_MARKER


def newest_checkpoint(checkpoint_dir: str | Path) -> tuple[int, float] | None:
    """The newest complete checkpoint under `checkpoint_dir` as (step, when its
    manifest was written), from the one lister (`checkpoint_list`, torch-free); None
    when there is none or the folder cannot be read."""
    try:
        for checkpoint in complete_checkpoints(checkpoint_dir):
            with contextlib.suppress(OSError):  # deleted since it was listed
                return checkpoint.step, checkpoint.committed_at()
    except (OSError, ObjectStoreError, MissingDependencyError):
        pass  # an unreadable folder (or bucket, or no boto3 here) holds no progress
    return None


# A Hugging Face Trainer's checkpoint (`checkpoint-N/`): rank 0 writes
# `trainer_state.json` last of its files (`shardctl.train.hf`). The Trainer's
# `output_dir` is where the HF callback records it in the run dir, as JSON
# `{"output_dir"}`: a script may put its checkpoints anywhere.
_TRAINER_FOLDER = re.compile(r"^checkpoint-(\d+)$")
TRAINER_COMMIT = "trainer_state.json"
TRAINER_OUTPUT_FILE = "trainer-output.json"


def newest_trainer_checkpoint(output_dir: str | Path) -> tuple[int, float] | None:
    """The newest Trainer `checkpoint-N` of `output_dir` whose `trainer_state.json`
    reads and says step N, as (N, when that file was written); None when none does."""
    root = Path(output_dir)
    try:
        found = [(int(m.group(1)), e) for e in root.iterdir()
                 if (m := _TRAINER_FOLDER.match(e.name))]  # fmt: skip
    except OSError:
        return None
    for step, folder in sorted(found, reverse=True):
        state_file = folder / TRAINER_COMMIT
        try:
            state = json.loads(state_file.read_text())
            if isinstance(state, dict) and state.get("global_step") == step:
                return step, state_file.stat().st_mtime
        except (OSError, ValueError):
            continue  # a save that never finished
    return None


def _newest_of_run(run_dir: str | Path, checkpoint_dir: str | Path) -> tuple[int, float] | None:
    """The newest complete checkpoint a run's attempts left: shardctl's `step-N` or a
    Trainer's `checkpoint-N` in the checkpoint dir, or in the Trainer's recorded
    `output_dir`."""
    found = [newest_checkpoint(checkpoint_dir), newest_trainer_checkpoint(checkpoint_dir)]
    recorded = RunDir.of(run_dir).read_marker(TRAINER_OUTPUT_FILE) or {}
    output_dir = recorded.get("output_dir")
    if isinstance(output_dir, str) and output_dir and Path(output_dir) != Path(checkpoint_dir):
        found.append(newest_trainer_checkpoint(output_dir))
    return max((f for f in found if f is not None), default=None)


@dataclass(frozen=True)
class Progress:
    """This attempt's progress: the newest complete (durable) checkpoint step now,
    whether the run can resume from a newer step than when the attempt started (a
    durable checkpoint or a memory-tier copy), how many attempts in a row (this one
    included) of the same job got no newer one, and the newest memory copy's step."""

    step: int | None
    advanced: bool
    stalled: int
    memory_step: int | None = None


# Where the memory tier's copies of a run are: the run dir names the folder
# (`train/memory_tier.OWNER_FILE`, JSON {"dir"}, written by rank 0 when a run with
# the tier resumes; not imported: orchestrator/ never imports train/).
MEMORY_OWNER_FILE = "logs/memory-tier.json"


# On more than one node, node 0's own slice of each copy (`train/memory_partner.py`).
MEMORY_NODE0_OWN = ("node-0", "own")


def newest_memory_step(run_dir: str | Path) -> int | None:
    """The step of the newest complete memory-tier copy the run dir names (on this
    node's tmpfs: node 0's agent judges; on several nodes node 0's own slice, which
    its partner holds too), None when there is none. A restart in place resumes from
    it (`memory_tier.restore_newest`), so a newer one is progress."""
    try:
        named = json.loads((Path(run_dir) / MEMORY_OWNER_FILE).read_text()).get("dir")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(named, str) or not named:
        return None
    found = [newest_checkpoint(named), newest_checkpoint(Path(named, *MEMORY_NODE0_OWN))]
    return _newest(*(f[0] for f in found if f is not None))


def _newest(*steps: int | None) -> int | None:
    return max((s for s in steps if s is not None), default=None)


def _checkpoint_location(run_dir: str | Path, checkpoint_dir: str | Path | None) -> str | Path:
    """Where a run's checkpoints are: `checkpoint_dir`, else `<run_dir>/checkpoints`;
    an s3:// URL stays one (a Path would fold its '//')."""
    if not checkpoint_dir:
        return Path(run_dir) / CHECKPOINTS_DIR
    return str(checkpoint_dir) if is_object_url(checkpoint_dir) else Path(checkpoint_dir)


def newest_durable_step(run_dir: str | Path, checkpoint_dir: str | Path | None) -> int | None:
    """The step of the newest complete durable checkpoint a run has now (shardctl's
    or a Trainer's, `_newest_of_run`), None when it has none."""
    newest = _newest_of_run(run_dir, _checkpoint_location(run_dir, checkpoint_dir))
    return newest[0] if newest is not None else None


def newest_step(run_dir: str | Path, checkpoint_dir: str | Path | None) -> int | None:
    """The newest step the run can resume from now: its newest durable checkpoint or
    memory-tier copy, None when it has neither: what a supervisor records when an
    attempt starts, so that its end is judged by steps, not by file times."""
    return _newest(newest_durable_step(run_dir, checkpoint_dir), newest_memory_step(run_dir))


def attempt_progress(
    run_dir: str | Path, checkpoint_dir: str | Path | None, start_step: int | None, job: str
) -> Progress:
    """This attempt's `Progress`: whether the newest step the run can resume from now
    (a complete durable checkpoint or memory-tier copy: a restart in place resumes
    from memory) is newer than the newest when the attempt started, judged by step
    alone (never by a file time: two attempts may share a second, and a clock may be
    skewed). The step at the start is the previous attempt's of `job` in
    `attempts.jsonl` (the newer of its `checkpoint_step` and `memory_step`; those of
    `job` only: a new submission starts over); for the job's first attempt,
    `start_step`, which its supervisor read when the attempt started (`newest_step`,
    after claiming the attempt's token: no earlier attempt's rank can publish after
    it); None: there was none (any complete checkpoint now is progress). A Trainer's
    `checkpoint-N` counts as well (`_newest_of_run`)."""
    durable = newest_durable_step(run_dir, checkpoint_dir)
    memory = newest_memory_step(run_dir)
    newest = _newest(durable, memory)
    before = [e for e in _attempts(run_dir) if e.get("job") == job]
    if before:
        previous = _newest(_int(before[-1].get("checkpoint_step")),
                           _int(before[-1].get("memory_step")))  # fmt: skip
    else:
        previous = start_step
    advanced = newest is not None and (previous is None or newest > previous)
    stalled = 0
    if not advanced:
        stalled = 1
        for entry in reversed(before):
            if entry.get("advanced") is not False:
                break
            stalled += 1
    return Progress(durable, advanced, stalled, memory)


def _attempts(run_dir: str | Path) -> list[dict[str, Any]]:
    try:
        lines = (Path(run_dir) / ATTEMPTS_FILE).read_text().splitlines()
    except OSError:
        return []
    entries = []
    for line in lines:
        try:
            entry = json.loads(line)
        except ValueError:
            continue  # a line cut short by a crash: the others still count
        if isinstance(entry, dict):
            entries.append(entry)
    return entries


def last_attempt(run_dir: str | Path, job: str) -> dict[str, Any] | None:
    """The newest line of `attempts.jsonl` for `job` (what `status` shows), or None."""
    return next((e for e in reversed(_attempts(run_dir)) if e.get("job") == job), None)


def record_attempt(
    run_dir: str | Path,
    job: str,
    verdict: Verdict,
    progress: Progress,
    since: float | None = None,
    token: str | None = None,
) -> None:
    """Append this attempt to `attempts.jsonl` (one short line, one write): its
    timeline for `goodput.py` (`start`: `since`, the attempt's start; `end`: now, when
    it was judged; `time`, the same, read by lines written before `end` existed;
    `token`: the attempt's token, which goodput matches its restore line by;
    `memory_step`: the newest memory-tier copy, the start of the next attempt's
    progress with `checkpoint_step`)."""
    now = time.time()
    entry = {
        "job": job, "attempt": verdict.retries, "restart": verdict.restarts,
        "start": since, "end": now, "time": now, "token": token,
        "kind": verdict.outcome.kind.value, "decision": verdict.decision.value,
        "checkpoint_step": progress.step, "memory_step": progress.memory_step,
        "advanced": progress.advanced, "summary": verdict.summary(),
    }  # fmt: skip
    with open(Path(run_dir) / ATTEMPTS_FILE, "a") as f:
        f.write(json.dumps(entry) + "\n")

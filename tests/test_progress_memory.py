"""The no-progress rule reads the memory tier: a run restarted in place from memory
copies (durable checkpoints far apart) that gets further each time is making
progress; one that crashes before its next copy is not. Each attempt is judged as
node 0's agent judges it (`newest_step` when it starts, `attempt_progress` and
`record_attempt` at its end, `decide` with restarts in place allowed)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from shardctl.orchestrator.attempts import (
    MEMORY_OWNER_FILE,
    attempt_progress,
    last_attempt,
    newest_memory_step,
    newest_step,
    record_attempt,
)
from shardctl.orchestrator.outcome import Decision, Kind, Outcome, decide

JOB = "7"


def copy_in_memory(memory: Path, step: int) -> None:
    """A committed memory-tier copy of `step` (its manifest is the commit), the one
    before it gone (the tier keeps one)."""
    for old in memory.glob("step-*"):
        shutil.rmtree(old)
    folder = memory / f"step-{step:08d}"
    folder.mkdir(parents=True)
    (folder / "manifest.json").write_text("{}")


def a_run_with_the_memory_tier(tmp_path: Path) -> tuple[Path, Path, Path]:
    run, ckpt, memory = tmp_path / "run", tmp_path / "run" / "checkpoints", tmp_path / "shm"
    (run / "logs").mkdir(parents=True)
    memory.mkdir()
    (run / MEMORY_OWNER_FILE).write_text(json.dumps({"dir": str(memory)}) + "\n")
    return run, ckpt, memory


def crash(run: Path, ckpt: Path, round_: int, start_step: int | None) -> Decision:
    """Judge round `round_`, which crashed, as node 0 does; its decision."""
    progress = attempt_progress(run, ckpt, start_step, JOB)
    verdict = decide(Outcome(Kind.FAILED), progress=progress, restarts=round_, max_restarts=10)
    record_attempt(run, JOB, verdict, progress, 0.0, f"slurm-{JOB}-0-r{round_}")
    return verdict.decision


def test_restarts_from_memory_that_get_further_are_progress(tmp_path: Path) -> None:
    # No durable checkpoint yet (every_steps 100); a memory copy every 10 steps; each
    # round crashes 3 steps after its copy: five rounds, each 10 steps further.
    run, ckpt, memory = a_run_with_the_memory_tier(tmp_path)
    for round_ in range(5):
        start_step = newest_step(run, ckpt)
        assert start_step == (None if round_ == 0 else 10 * round_)
        copy_in_memory(memory, 10 * (round_ + 1))
        assert crash(run, ckpt, round_, start_step) is Decision.RESTART, round_
    last = last_attempt(run, JOB)
    assert last is not None
    assert (last["checkpoint_step"], last["memory_step"], last["advanced"]) == (None, 50, True)
    assert last["token"] == f"slurm-{JOB}-0-r4"


def test_restarts_that_never_reach_a_new_copy_are_still_no_progress(tmp_path: Path) -> None:
    # One copy at 10, then every round crashes before the next: the third round in a
    # row without a newer step stops the crash loop, as without the tier.
    run, ckpt, memory = a_run_with_the_memory_tier(tmp_path)
    copy_in_memory(memory, 10)
    decisions = [crash(run, ckpt, round_, newest_step(run, ckpt)) for round_ in range(3)]
    assert decisions == [Decision.RESTART, Decision.RESTART, Decision.STOP]


def test_a_durable_checkpoint_past_the_copy_counts_and_copies_not_named_do_not(
    tmp_path: Path,
) -> None:
    run, ckpt, memory = a_run_with_the_memory_tier(tmp_path)
    copy_in_memory(memory, 10)
    assert crash(run, ckpt, 0, None) is Decision.RESTART
    copy_in_memory(ckpt, 100)  # a durable checkpoint beyond the copy
    assert newest_step(run, ckpt) == 100
    assert attempt_progress(run, ckpt, None, JOB).advanced
    # A folder the run dir does not name (an earlier run's, another run's) holds no
    # progress of this run.
    (run / MEMORY_OWNER_FILE).unlink()
    assert newest_memory_step(run) is None
    (run / MEMORY_OWNER_FILE).write_text("not json")
    assert newest_memory_step(run) is None


def test_on_several_nodes_node_0s_own_slice_is_progress(tmp_path: Path) -> None:
    # The tier on several nodes keeps each node's slice in `<dir>/node-<n>/own/`
    # (train/memory_partner.py); node 0's agent judges from node 0's.
    run, ckpt, memory = a_run_with_the_memory_tier(tmp_path)
    own = memory / "node-0" / "own"
    copy_in_memory(own, 10)
    assert crash(run, ckpt, 0, None) is Decision.RESTART
    assert newest_step(run, ckpt) == 10
    copy_in_memory(own, 20)
    assert crash(run, ckpt, 1, 10) is Decision.RESTART
    assert last_attempt(run, JOB)["memory_step"] == 20  # type: ignore[index]

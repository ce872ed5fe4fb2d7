"""Leave bad nodes behind: a requeue after a fault pinned on one node excludes that node.

A node watchdog that declares a hang names the rank that stopped first and its node
(the HUNG marker's `rank` and `node`); a rank killed by a node's signal (the OOM
killer's KILL, a BUS, SEGV or ILL) is pinned on its node by that node's launcher
report (the KILLED marker, `killed_ranks`). When node 0 requeues the job after such
a fault (restarts inside the allocation spent), it adds that node's host to the job's
excluded nodes, so the requeued job starts on other nodes, as a person would with
`sbatch --exclude`. Bounded: a host is left behind only while the job's partitions keep at
least as many other nodes as the job needs; otherwise it is kept, and the record says
why. A hang that names no rank (every rank stopped together, say at a collective) pins
nothing: no node is left behind for it.

Every decision is one line of the run dir's `nodes-left-behind.jsonl`
(`{"host", "node", "job", "requeue", "why", "excluded", "note", "time"}`), which
`shardctl status` reads.

Slurm takes `ExcNodeList` only for a pending job, so the update follows the requeue:
node 0's task ignores the SIGTERM the requeue sends and has the cluster's KillWait
to make it. So do the Slurm commands it runs then, from the instant they start: the
requeue's SIGTERM reaches every process of the job, and a `scontrol` killed by it
(once while it ran, once while its shell started) made node 0 keep a node it could
not name ("cannot tell the host of node 1").
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...outcome import Kind, Outcome
from ...rundir import LEFT_BEHIND_FILE

# How long node 0 keeps asking Slurm to take the exclusion after the requeue: the job
# must have turned pending, and the requeue's SIGKILL comes after KillWait (30 s by
# default) at the earliest.
UPDATE_WAIT_S = 15.0

Runner = Callable[[list[str]], subprocess.CompletedProcess]


# Runs a command with SIGTERM ignored (an ignored signal stays ignored across exec).
IGNORING_TERM = ["sh", "-c", 'trap "" TERM; exec "$0" "$@"']


def _run(argv: list[str]) -> subprocess.CompletedProcess:
    """A Slurm command, deaf to the requeue's SIGTERM (see the module's doc); one that
    cannot run or hangs is a failed one (node 0 has requeued by now and must end
    cleanly whatever Slurm says)."""
    # The signal comes a moment after the requeue, as the command starts: blocked from
    # before the fork (a child inherits the mask through exec), one that lands before
    # the shell's trap waits and the trap discards it. The trap keeps the command deaf
    # should it unblock signals.
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        proc = subprocess.run(
            [*IGNORING_TERM, *argv], capture_output=True, text=True, timeout=60, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return subprocess.CompletedProcess(argv, 1, "", str(exc))
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    return subprocess.CompletedProcess(argv, proc.returncode, proc.stdout, proc.stderr)


def pinned_node(outcome: Outcome) -> int | None:
    """The node index a fault is pinned on: a hang whose watchdog named the rank that
    stopped first, or a rank killed on its node (`Outcome.pinned`, the KILLED marker of
    `killed_ranks`). None: nothing points at one node."""
    if outcome.kind is Kind.HUNG and outcome.rank is not None and outcome.node is not None:
        return outcome.node
    if outcome.pinned:
        return outcome.node
    return None


def hostnames(nodelist: str, run: Runner = _run) -> list[str]:
    """A Slurm host list (`n[1-3],gpu7`) as names, in Slurm's order (node index order)."""
    if not nodelist or nodelist == "(null)":
        return []
    proc = run(["scontrol", "show", "hostnames", nodelist])
    return proc.stdout.split() if proc.returncode == 0 else []


@dataclass(frozen=True)
class Choice:
    """Whether `host` can be left behind, and the hosts the job would then exclude."""

    excluded: bool
    exclude: tuple[str, ...]
    note: str


def choose(host: str, already: Iterable[str], partition: Iterable[str], needed: int) -> Choice:
    """Leave `host` behind only while the partition keeps `needed` usable nodes (an
    unknown partition keeps it: a job that excludes too much waits in the queue forever)."""
    already_set, pool = set(already), set(partition)
    if host in already_set:
        return Choice(False, tuple(sorted(already_set)), f"{host} is already excluded")
    if not pool:
        return Choice(
            False, tuple(sorted(already_set)), "kept: the partition's nodes could not be read"
        )
    after = already_set | {host}
    left = len(pool - after)
    if left < needed:
        return Choice(
            False,
            tuple(sorted(already_set)),
            f"kept: without {host} the partition has {left} node(s) for a job of {needed}",
        )
    return Choice(True, tuple(sorted(after)), f"excluded: {len(after)} node(s) left behind")


def leave_behind(
    *,
    job_id: str,
    run_dir: str,
    node: int,
    needed: int,
    why: str,
    job: Mapping[str, str],
    requeue: int,
    run: Runner = _run,
    wait_s: float = UPDATE_WAIT_S,
) -> str:
    """After node 0 requeued `job_id`: exclude the host of `node` from the job (within the
    bound), record the decision, and return one line for the node's log. `job`: the
    job's `scontrol show job` fields from before the requeue."""
    hosts = hostnames(job.get("NodeList", ""), run)
    if not 0 <= node < len(hosts):
        return f"cannot tell the host of node {node} (nodes {job.get('NodeList')!r}); kept"
    host = hosts[node]
    already = hostnames(job.get("ExcNodeList", ""), run)
    partition: list[str] = []
    for name in filter(None, job.get("Partition", "").split(",")):
        partition += _partition_nodes(name, run)
    choice = choose(host, already, partition, needed)
    note = choice.note
    if choice.excluded:
        refused = _update(job_id, ",".join(choice.exclude), run, wait_s)
        if refused:
            choice = Choice(False, choice.exclude, f"kept: Slurm refused the exclusion: {refused}")
            note = choice.note
    _record(run_dir, {
        "host": host, "node": node, "job": job_id, "requeue": requeue, "why": why,
        "excluded": choice.excluded, "note": note, "time": time.time(),
    })  # fmt: skip
    if choice.excluded:
        return (
            f"left node {node} ({host}) behind: {why}; the requeued job excludes "
            f"{','.join(choice.exclude)}"
        )
    return f"node {node} ({host}): {why}; {note}"


def _partition_nodes(name: str, run: Runner, tries: int = 5) -> list[str]:
    """The node names of a partition; [] when Slurm does not answer (a busy controller
    times out: asked again a few times)."""
    for attempt in range(tries):
        proc = run(["sinfo", "-h", "-N", "-p", name, "-o", "%N"])
        if proc.returncode == 0:
            return proc.stdout.split()
        time.sleep(1.0 + attempt)
    return []


def _update(job_id: str, exclude: str, run: Runner, wait_s: float) -> str | None:
    """`scontrol update ExcNodeList`, again until the requeued job is pending; None
    once Slurm took it, else what Slurm said last."""
    deadline = time.monotonic() + wait_s
    while True:
        proc = run(["scontrol", "update", f"JobId={job_id}", f"ExcNodeList={exclude}"])
        if proc.returncode == 0:
            return None
        said = (proc.stderr or proc.stdout).strip() or f"exit {proc.returncode}"
        if time.monotonic() >= deadline:
            return said
        time.sleep(0.5)


def _record(run_dir: str, entry: dict[str, Any]) -> None:
    with (Path(run_dir) / LEFT_BEHIND_FILE).open("a") as f:
        f.write(json.dumps(entry) + "\n")


def read_left_behind(run_dir: str | Path) -> list[dict[str, Any]]:
    """The run's recorded decisions, oldest first (lines that do not read are skipped)."""
    try:
        text = (Path(run_dir) / LEFT_BEHIND_FILE).read_text(errors="replace")
    except OSError:
        return []
    entries = []
    for line in text.splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict) and isinstance(entry.get("host"), str):
            entries.append(entry)
    return entries


def left_behind_detail(run_dir: str | Path, job_id: str) -> str:
    """What `status` says of the nodes this job left behind (or kept), "" for none."""
    parts = []
    for entry in read_left_behind(run_dir):
        if str(entry.get("job")) != str(job_id):
            continue
        spare = entry.get("spare")
        if isinstance(spare, dict):  # replaced inside the allocation (`spares.py`)
            what = f"replaced by spare {spare.get('host', '?')} in restart {entry.get('restart')}"
        else:
            what = "left behind" if entry.get("excluded") else "kept"
        parts.append(f"{entry['host']} {what} ({entry.get('why', '?')})")
    return "nodes: " + "; ".join(parts) if parts else ""

"""`status`, `logs -f` and `cancel` of a 128-pod PyTorchJob and a 128-node TrainJob, in
bounded time, threads and connections (kmock; see helpers/k8s_width.py).

Each command runs as its own process (`python -m shardctl.orchestrator.cli`), like a
user's; its threads and TCP connections to the emulator are sampled from /proc while it
runs and its API requests are read from the emulator's record. The pods write their
logs over a few seconds, longer than a stream's turn (LOG_TURN_S), so that the pods of
these jobs, wider than the pool of streams, take turns and resume.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.k8s_width import LogPlayer, Measured, Width, serve, wait_until
from helpers.kmock_server import KMockServer
from shardctl.orchestrator.clusters.k8s.logstreams import (
    LOG_STREAMS,
    LOG_TURN_S,
    LogStreams,
    PodLog,
    stamp_ns,
)
from shardctl.orchestrator.launcher_output import LauncherReport

PODS = 128
# The pool of streams, the main thread (status and list calls) and one spare: the
# interpreter starts no other thread, so a per-pod thread or connection shows at once.
MAX_THREADS = LOG_STREAMS + 2
MAX_CONNECTIONS = LOG_STREAMS + 2
# A command that makes O(1) requests, started as a process on a busy 2-core machine
# (the interpreter and the kubernetes client's import take most of it).
COMMAND_S = 30.0
# From the job's end to `logs -f` returning: a poll tick (2 s), one pass of the
# remaining pods through the pool, and the margin of a loaded machine.
AFTER_END_S = 20.0


@pytest.fixture
def server() -> Iterator[KMockServer]:
    srv = serve()
    try:
        yield srv
    finally:
        srv.stop()


def by_pod(stdout: str) -> dict[str, list[str]]:
    """`logs -f`'s lines, per pod, in the order shown, without their prefix."""
    shown: dict[str, list[str]] = {}
    for line in stdout.splitlines():
        found = re.match(r"\[pod/([^/\]]+)/[^\]]+\] (.*)$", line)
        assert found, f"a line without a pod prefix: {line!r}"
        shown.setdefault(found.group(1), []).append(found.group(2))
    return shown


def check_bounded(run: Measured, what: str) -> None:
    assert run.code == 0, f"{what}: exit {run.code}\n{run.stderr}"
    assert "Traceback" not in run.stderr, run.stderr
    assert run.peaks.samples > 0, f"{what}: never sampled"
    assert run.peaks.threads <= MAX_THREADS, f"{what}: {run.peaks} (pool {LOG_STREAMS})"
    assert run.peaks.connections <= MAX_CONNECTIONS, f"{what}: {run.peaks} (pool {LOG_STREAMS})"


def check_status_and_cancel(
    width: Width, status: Measured, cancel: Measured, *, alone: bool = True
) -> None:
    """Neither looks at the pods: one GET of the job; two DELETEs (job, ConfigMap).
    `alone`: nothing else of the CLI's ran meanwhile (else only the DELETEs are its)."""
    check_bounded(status, "status")
    assert "RUNNING" in status.stdout, status.stdout
    assert status.wall_s < COMMAND_S, status.wall_s
    assert sum(status.requests.values()) == 1, status.requests
    check_bounded(cancel, "cancel")
    assert cancel.wall_s < COMMAND_S, cancel.wall_s
    plural = "trainjobs" if width.api == "trainjob" else "pytorchjobs"
    deletes = {k: n for k, n in cancel.requests.items() if k.startswith("DELETE")}
    assert deletes == {"DELETE configmaps": 1, f"DELETE {plural}": 1}, cancel.requests
    if alone:
        assert cancel.requests == deletes, cancel.requests
    assert not width.job_exists()


def check_follow(run: Measured, player: LogPlayer, ended_at: float) -> None:
    """Every pod's lines, each once and in order; one status and one list per tick."""
    check_bounded(run, "logs -f")
    assert by_pod(run.stdout) == player.expected()
    after_end = time.monotonic() - ended_at
    assert after_end < AFTER_END_S, f"logs -f ran {after_end:.1f} s after the job ended"
    kinds = run.requests
    lists = kinds.get("LIST pods", 0)
    gets = sum(n for k, n in kinds.items() if k.startswith("FETCH"))
    assert lists == gets and lists <= run.wall_s / 2.0 + 2, kinds
    # Every pod once, and a resume per turn given up: at most one per stream and turn,
    # whatever the width (far fewer than one per pod and tick).
    turns = kinds["log"] - PODS
    assert 0 <= turns <= LOG_STREAMS * run.wall_s / LOG_TURN_S, kinds


def start(server: KMockServer, tmp_path: Path, api: str) -> Width:
    width = Width(server, tmp_path, api, PODS, name="wide")
    width.submit()
    width.add_pods()
    width.set_state("Running")
    return width


@pytest.mark.timeout(240)
def test_a_128_pod_pytorchjob_followed_to_its_end(server: KMockServer, tmp_path: Path) -> None:
    width = start(server, tmp_path, "pytorchjob")
    status = width.run("status", "wide", timeout=120)
    # Each pod writes 24 lines over 6 s: three turns of the pool while they write.
    player = LogPlayer(width.pods, lines=24, period_s=0.25)
    player.install(server)
    with width.started("logs", "wide", "-f", timeout=180) as follow:
        wait_until(lambda: time.time() > player.ends_at, 60, "the containers' last lines")
        width.set_state("Succeeded")
        ended_at = time.monotonic()
        run = follow.result()
    check_follow(run, player, ended_at)
    cancel = width.run("cancel", "wide", timeout=120)
    check_status_and_cancel(width, status, cancel)


@pytest.mark.timeout(240)
def test_a_128_node_trainjob_cancelled_while_followed(server: KMockServer, tmp_path: Path) -> None:
    width = start(server, tmp_path, "trainjob")
    status = width.run("status", "wide", timeout=120)
    # The containers would write for a minute; the job is cancelled long before.
    player = LogPlayer(width.pods, lines=240, period_s=0.25)
    player.install(server)
    with width.started("logs", "wide", "-f", timeout=180) as follow:
        # The first streams have given their turns up; most pods still wait for theirs.
        wait_until(lambda: player.served > 2 * LOG_STREAMS, 90, "the first turns")
        cancel = width.run("cancel", "wide", timeout=120)
        # What the cluster does next (kmock has no garbage collector and no kubelet):
        # the pods' containers are killed; their logs stay readable.
        player.kill()
        ended_at = time.monotonic()
        run = follow.result()
    check_follow(run, player, ended_at)
    assert run.requests["log"] > PODS, "no stream ever gave its turn up and resumed"
    check_status_and_cancel(width, status, cancel, alone=False)


# ------------------------------------------------------- resuming by timestamps


def test_kubelet_timestamps_of_any_precision_and_zone() -> None:
    base = 1_767_225_600 * 10**9  # 2026-01-01T00:00:00Z
    assert stamp_ns("2026-01-01T00:00:00Z") == base
    assert stamp_ns("2026-01-01T00:00:00.5Z") == base + 500_000_000
    assert stamp_ns("2026-01-01T00:00:00.000000007Z") == base + 7
    assert stamp_ns("2026-01-01T01:00:00.25+01:00") == base + 250_000_000
    assert stamp_ns("step 1 loss 5.5") is None
    assert stamp_ns("2026-01-01 00:00:00Z") is None


def test_a_resumed_stream_shows_only_what_was_not_shown() -> None:
    """Lines of the newest shown timestamp come again with the next stream (its
    `sinceSeconds` starts before them): as many as were shown are skipped, in order."""
    out: list[str] = []
    pool = LogStreams(lambda *a: None, out.append)
    log = PodLog("p", "[pod/p/c] ", LauncherReport(), resumable=True, tail=None)
    t = "2026-01-01T00:00:0{}.5Z "
    first = [f"{t.format(1)}a", f"{t.format(2)}b", f"{t.format(2)}c"]
    skip = pool._show(log, [line.encode() for line in first], log.at_last)
    assert (skip, log.at_last) == (0, 2)
    again = [f"{t.format(1)}a", f"{t.format(2)}b", f"{t.format(2)}c", f"{t.format(2)}d",
             f"{t.format(3)}e", "no stamp"]  # fmt: skip
    pool._show(log, [line.encode() for line in again], log.at_last)
    assert "".join(out) == "".join(f"[pod/p/c] {x}\n" for x in "abcde") + "[pod/p/c] no stamp\n"

"""`logs -f` at width: every pod's log followed through a bounded pool of streams.

The Kubernetes log API has one stream per container (`GET pods/NAME/log?follow=true`),
and over HTTP/1.1 (the `kubernetes` client's urllib3) each open stream holds its own
TCP connection to the API server, which holds one to the pod's kubelet. One stream per
pod, each read by its own thread, held a 128-pod job's 128 threads and 128
connections for as long as it ran. Here at most `LOG_STREAMS` streams are open at
a time, each read by one thread of a pool of that size:

- a job of at most LOG_STREAMS pods: one stream per pod, held until its container
  ends, exactly what `logs -f` always did;
- a wider job: the pods take turns. A stream held for LOG_TURN_S while another pod
  waits is closed and its pod goes to the back of the queue. Its next stream asks
  for the lines since a little before the last one shown (`sinceSeconds`, the only
  "since" the client's call takes) with their kubelet timestamps (`timestamps=true`);
  the lines already shown are skipped by those timestamps, so each line is shown
  once and in order, every pod's at most about (pods / LOG_STREAMS) × LOG_TURN_S
  after it was written.

The one thread that lists the pods (one `list` per tick, `K8sCluster.follow_logs`)
hands new pods to `LogStreams.add`; nothing here calls the API itself: the cluster
gives the function that opens a stream (`Opener`).
"""

from __future__ import annotations

import calendar
import collections
import math
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from ...errors import ClusterError
from ...launcher_output import LauncherReport

# Streams open at once (threads and API connections): kubectl refuses to follow more
# than 5 at once by default (--max-log-requests); 16 shows every node of a 16-node job
# live, as before, and bounds a wider job's.
LOG_STREAMS = 16
# How long a stream is held while other pods wait for one: short enough that each of
# 128 pods is shown within ~(128 / 16) × 2 s = 16 s, long enough that reopening
# (a request, a connection, the lines of the margin below read again) stays cheap.
LOG_TURN_S = 2.0
# A resumed stream starts this much before the last line shown, measured on this
# machine's clock (the kubelet's may differ; `sinceSeconds` is relative to its own):
# it covers the time from the container writing a line to it arriving here.
RESUME_MARGIN_S = 5

# A kubelet's timestamp (RFC 3339, up to nanoseconds) at the start of a line.
_STAMP = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d{1,9}))?(Z|[+-]\d\d:\d\d) ")

Outcome = Literal["ended", "turn", "again", "later"]


class LogNotReady(Exception):
    """The container has no log yet (it is being created): try again later."""


@dataclass
class PodLog:
    """One container's log being followed, and where its next stream starts."""

    pod: str
    prefix: str  # `[pod/NAME/CONTAINER] `
    report: LauncherReport  # kept across streams: a launcher's report may span two
    resumable: bool  # timestamped: may give its stream up and resume later
    tail: int | None  # the first stream's --tail
    last_ns: int | None = None  # the kubelet timestamp of the newest line shown
    at_last: int = 0  # lines shown with exactly that timestamp
    seen_at: float | None = None  # monotonic time that line arrived (or the first open)
    ready_at: float = 0.0  # monotonic time it may be opened again


class Opener(Protocol):
    def __call__(self, log: PodLog, since_s: int | None, read_timeout: float | None) -> Any:
        """An open `follow=true` stream (urllib3 response) of `log.pod`'s container:
        timestamped if `log.resumable`; lines since `since_s` seconds ago if given,
        else the last `log.tail`. Raises LogNotReady or ClusterError."""
        ...


def stamp_ns(text: str) -> int | None:
    """A kubelet timestamp in nanoseconds since the epoch; None if `text` is not one."""
    found = _STAMP.match(text + " ")
    if not found:
        return None
    whole, frac, zone = found.groups()
    seconds = calendar.timegm(time.strptime(whole, "%Y-%m-%dT%H:%M:%S"))
    if zone != "Z":
        sign = 1 if zone[0] == "+" else -1
        seconds -= sign * (int(zone[1:3]) * 3600 + int(zone[4:6]) * 60)
    return seconds * 1_000_000_000 + int((frac or "0").ljust(9, "0"))


class LogStreams:
    """At most `streams` pods' logs streamed at once, by as many threads; see the module."""

    def __init__(
        self,
        open_stream: Opener,
        emit: Callable[[str], None],
        *,
        streams: int = LOG_STREAMS,
        turn_s: float = LOG_TURN_S,
        retry_s: float = 2.0,
    ) -> None:
        self._open = open_stream
        self._emit = emit
        self.streams = streams
        self.turn_s = turn_s
        self.retry_s = retry_s
        self._queue: collections.deque[PodLog] = collections.deque()
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._workers = 0
        self._active = 0
        self.started = 0  # threads started in all (for tests and benchmarks)

    def add(self, log: PodLog) -> None:
        """Follow one more container's log; a thread starts if fewer than `streams` run."""
        with self._cond:
            self._queue.append(log)
            if self._workers < self.streams:
                self._workers += 1
                self.started += 1
                threading.Thread(
                    target=self._work,
                    name=f"logs-{self.started}",
                    daemon=True,  # a stream that never ends must not keep shardctl alive
                ).start()
            self._cond.notify_all()

    def drain(self, timeout_s: float) -> None:
        """Wait until every log was read to its end (at most `timeout_s`), then stop."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._queue or self._active:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
        self._stop.set()
        with self._cond:
            self._cond.notify_all()

    # ------------------------------------------------------------------ threads

    def _work(self) -> None:
        while True:
            with self._cond:
                log = self._next()
                if log is None:
                    self._workers -= 1
                    self._cond.notify_all()
                    return
                self._active += 1
            try:
                outcome = self._follow(log)
            except Exception as exc:  # shown as a line of that pod, never a thread traceback
                self._emit(f"{log.prefix}(log stream failed: {type(exc).__name__}: {exc})\n")
                outcome = "ended"
            with self._cond:
                self._active -= 1
                if outcome != "ended" and not self._stop.is_set():
                    log.ready_at = time.monotonic() + (self.retry_s if outcome == "later" else 0)
                    self._queue.append(log)
                self._cond.notify_all()

    def _next(self) -> PodLog | None:
        """The first pod ready to be opened (waiting for one if need be); None when there
        is nothing left to follow (the thread ends; `add` starts another)."""
        while not self._stop.is_set() and self._queue:
            now = time.monotonic()
            for log in self._queue:
                if log.ready_at <= now:
                    self._queue.remove(log)
                    return log
            self._cond.wait(min(log.ready_at for log in self._queue) - now)
        return None

    def _waiting(self) -> bool:
        """Whether a pod waits for a stream now."""
        now = time.monotonic()
        with self._cond:
            return any(log.ready_at <= now for log in self._queue)

    def _follow(self, log: PodLog) -> Outcome:
        """One stream of `log`'s container, until it ends or gives its place up."""
        if log.seen_at is None:
            since = None
            log.seen_at = time.monotonic()
        else:
            since = math.ceil(time.monotonic() - log.seen_at) + RESUME_MARGIN_S
        try:
            # A resumable stream gives its place up after LOG_TURN_S of silence too; a
            # stream of a small job has no read timeout: a quiet step is not a dead stream.
            resp = self._open(log, since, self.turn_s if log.resumable else None)
        except LogNotReady:
            return "later"
        except ClusterError as exc:  # the pod is gone, or reading logs is forbidden
            self._emit(f"{log.prefix}(no log: {exc})\n")
            return "ended"
        return self._read(log, resp, time.monotonic())

    def _read(self, log: PodLog, resp: Any, opened: float) -> Outcome:
        import urllib3.exceptions

        skip = log.at_last  # lines of the newest shown timestamp a resumed stream repeats
        partial = b""
        complete = False
        try:
            for chunk in resp.stream(64 * 1024, decode_content=True):
                *lines, partial = (partial + chunk).split(b"\n")
                if lines:
                    skip = self._show(log, lines, skip)
                if self._stop.is_set():
                    return "ended"
                if log.resumable and time.monotonic() - opened >= self.turn_s and self._waiting():
                    # The unfinished line comes again with this pod's next stream.
                    return "turn"
            complete = True
        except urllib3.exceptions.ReadTimeoutError:  # quiet for LOG_TURN_S (resumable only)
            return "turn" if self._waiting() else "again"
        except (OSError, urllib3.exceptions.HTTPError) as exc:
            self._emit(f"{log.prefix}(log stream broke: {exc})\n")
        finally:
            if not complete:
                # An unfinished response cannot go back to the pool for another request.
                resp.close()
            resp.release_conn()
        if complete and partial:  # the container's last line, without a newline
            self._show(log, [partial], skip)
        rest = log.report.close()
        if rest:
            self._emit("".join(f"{log.prefix}{line}\n" for line in rest.splitlines()))
        return "ended"

    def _show(self, log: PodLog, lines: list[bytes], skip: int) -> int:
        """Show the lines not shown before; returns how many repeats are still to skip."""
        shown: list[str] = []
        for raw in lines:
            line = raw.decode("utf-8", errors="replace").rstrip("\r")
            if log.resumable:
                ns = stamp_ns(line)
                if ns is not None:
                    line = line.split(" ", 1)[1] if " " in line else ""
                    if log.last_ns is not None and ns < log.last_ns:
                        continue  # before the newest line shown: shown already
                    if ns == log.last_ns:
                        if skip:
                            skip -= 1
                            continue
                        log.at_last += 1
                    else:
                        log.last_ns, log.at_last, skip = ns, 1, 0
            log.seen_at = time.monotonic()
            shown.append(line + "\n")
        text = log.report.feed("".join(shown)) if shown else ""
        if text:
            self._emit("".join(f"{log.prefix}{line}\n" for line in text.splitlines()))
        return skip

"""What a launcher prints when its ranks stopped for a preemption, made readable.

A rank that saved a checkpoint on a preemption signal exits with EXIT_PREEMPTED
(42). torchrun (and `accelerate launch`, which runs torchrun's agent) treats any
non-zero exit as a crash: it logs `failed (exitcode: 42)`, raises
ChildFailedError with a Python traceback and prints a "FAILED / Root Cause"
report of every rank. A normal preemption then looks like a crash in the user's
terminal. `PreemptionReport` recognises that block in a stream of lines and, when
its root cause (the first rank to stop) exited 42 and every other rank did the same
or was stopped by torchrun itself (SIGTERM/SIGKILL), replaces it with one line
saying what happened; any other exit code lets it through untouched (a real
failure keeps its whole report). The launcher's own log file is never changed.
"""

from __future__ import annotations

import re

from .rundir import EXIT_PREEMPTED

_START = re.compile(r"torch/distributed/elastic/.*\] failed \(exitcode: (-?\d+)\)")
_EXITCODE = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)")
_RULE = re.compile(r"^={20,}\s*$")
# Exit codes torchrun gives ranks it stops itself once another rank has ended.
_TEARDOWN = frozenset({-15, -9})
# A block that never closes (torchrun killed mid-report) is let through after this.
_MAX_BLOCK_LINES = 400


class PreemptionReport:
    """A line filter: feed it text in any chunks, read back what the user should see."""

    def __init__(self, summary: str | None = None) -> None:
        self.summary = summary or (
            "[shardctl] the launcher reports exit 42 from its ranks: they saved a checkpoint "
            "and stopped for a preemption (this is not a crash; submit again to resume)\n"
        )
        self._partial = ""
        self._block: list[str] | None = None
        self._rules_after_root = 0
        self._root_seen = False
        self.replaced = 0  # blocks replaced by the summary

    def feed(self, text: str) -> str:
        lines = (self._partial + text).split("\n")
        self._partial = lines.pop()  # an unfinished line waits for the rest
        return "".join(self._line(line + "\n") for line in lines)

    def close(self) -> str:
        """Everything still held (an unfinished line, an unfinished block)."""
        out = self._line(self._partial) if self._partial else ""
        self._partial = ""
        if self._block is not None:
            out += "".join(self._block)
            self._block = None
        return out

    def _line(self, line: str) -> str:
        if self._block is None:
            m = _START.search(line)
            if m is None:
                return line
            self._block, self._root_seen, self._rules_after_root = [line], False, 0
            return ""
        self._block.append(line)
        if "Root Cause" in line:
            self._root_seen = True
        elif self._root_seen and _RULE.match(line):
            return self._finish()
        if len(self._block) > _MAX_BLOCK_LINES:
            held, self._block = self._block, None
            return "".join(held)
        return ""

    def _finish(self) -> str:
        block, self._block = self._block or [], None
        root: int | None = None
        others: set[int] = set()
        in_root = False
        for line in block:
            if "Root Cause" in line:
                in_root = True
            m = _EXITCODE.match(line)
            if m is None:
                continue
            if in_root and root is None:
                root = int(m.group(1))
            else:
                others.add(int(m.group(1)))
        # The first rank to stop saved for a preemption; the rest either did the same
        # or were torn down by torchrun itself (SIGTERM, then SIGKILL after its grace).
        if root == EXIT_PREEMPTED and others <= {EXIT_PREEMPTED, *_TEARDOWN}:
            self.replaced += 1
            return self.summary
        return "".join(block)


def readable(text: str) -> str:
    """`text` with every all-preempted launcher report replaced by one line."""
    report = PreemptionReport()
    return report.feed(text) + report.close()

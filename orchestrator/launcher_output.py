"""What a launcher prints about its own stop, made readable.

torchrun (and `accelerate launch`, which runs torchrun's agent) reports every end of
its ranks but exit 0 as a crash of its own, in two shapes:

- a rank stopped (a crash, a clear error and exit, a save for a preemption: 42):
  `failed (exitcode: N)`, a ChildFailedError traceback and a "FAILED / Root Cause"
  report of every rank, about 40 lines;
- torchrun itself got SIGTERM or SIGINT (`shardctl cancel`, Ctrl-C under
  `submit --wait`, `scancel`): "Received 15 death signal", "Sending process N closing
  signal", then three chained tracebacks ending in SignalException, about 60 lines
  (and Python's "--- Logging error ---" report when the signal interrupts one of its
  log calls; a signal that comes again while torchrun handles the first adds a
  traceback to the chain, and one landing inside logging's own code chains in the
  exception logging was handling, such as its level cache's KeyError).

Neither tells the user anything the run has not said already: a rank prints its own
error line or traceback before it exits, and the markers it writes tell `status` and
`submit --wait` why the run ended. `LauncherReport` is the one filter every display
of a launcher's log goes through (`submit --wait`, `logs`, `logs -f`, on every
cluster): it replaces each of those blocks with one line saying what the launcher
saw and which file keeps its full report (the log file itself is never changed), and
shows a traceback that another rank already printed word for word (every rank of a
crashing script raises the same) as one line. A user's own traceback is never
hidden. A ChildFailedError report that carries a rank's traceback (the rank used
torch's `@record`, so an error file exists) is let through whole, and so is anything
the filter does not recognise in full (a block cut short, a traceback interleaved
with a line of unknown origin; a rank's own `[rank N]` line is shown where it comes,
and the block read on). Python writes a traceback's last line in pieces (module, ".",
name, message), so another process's whole line can land inside it; within a block
such a line of shardctl's own is taken out and the launcher's line mended.

This is a display filter only: nothing decides from this text. Which rank ended how
(a rank killed on its node) comes from the launcher's own exception, recorded by
`launch_wrapper`.
"""

from __future__ import annotations

import re
import signal

from .rundir import EXIT_PREEMPTED

_ELASTIC = r"torch/distributed/elastic/\S*\] "
_START = re.compile(_ELASTIC + r"failed \(exitcode: (-?\d+)\)")
# torchrun's chatter while it tears its ranks down.
_CHATTER = re.compile(_ELASTIC + r"(Received \d+ death signal|Sending process \d+ closing signal)")
_EXITCODE = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)")
_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)")
_ERROR_FILE = re.compile(r"^\s*error_file\s*:\s*(\S+)")
_RULE = re.compile(r"^={20,}\s*$")
_TRACEBACK = "Traceback (most recent call last):"
_CHAINED = (
    "During handling of the above exception, another exception occurred:",
    "The above exception was the direct cause of the following exception:",
)
# What Python's logging prints when a signal interrupts a log call of torchrun's: this
# line, the traceback, then (unless the signal came again meanwhile) "Call stack:",
# frames, "Message: ..." and "Arguments: ..." (the last line).
_LOGGING_ERROR = "--- Logging error ---"
_CALL_STACK_TAIL = ("Call stack:", "Message: ", " ", "\t")
# A line of a rank or of shardctl's own (another process writing to the same file):
# shown where it comes, never part of a launcher's block.
_OWN_LINE = re.compile(r"^\[(rank \d+|shardctl)[\] ]")
# The same, landed inside a line of a launcher's block: as shardctl writes it, a rank's
# log line (`[rank N] LEVEL logger: ...`) or its own `[shardctl] ...`.
_SPLICED = re.compile(r"\[rank \d+\] (DEBUG|INFO|WARNING|ERROR|CRITICAL) \S+: |\[shardctl\] ")
# What of an exception's line Python may have written when another line landed in it
# (it writes the module, ".", the name, ": ", the message): never a frame's indented
# lines, nor a message, which may quote anything.
_EXCEPTION_START = re.compile(r"[A-Za-z_][\w.]*(: )?")
# The exception torchrun's agent raises on its own SIGTERM/SIGINT/SIGHUP.
_SIGNAL_EXC = re.compile(r"^torch\.distributed\.elastic\.\S*SignalException: .*signal: (\d+)")
# A frame's first line, naming its file.
_FRAME_FILE = re.compile(r'^  File "([^"]+)", line \d+')
# Python's logging raises and catches an exception of its own in its normal course (a
# level cache miss is a KeyError): a signal landing in its handler chains it into
# torchrun's report. Such an exception, raised in logging's own code and followed by
# the signal's, is part of the signal's chain, not an error of torchrun's.
_LOGGING_MODULE = "/logging/__init__.py"
# Exit codes torchrun gives ranks it stops itself once another rank has ended.
_TEARDOWN = frozenset({-15, -9})
# A block that never closes (torchrun killed mid-report) is let through after this.
_MAX_BLOCK_LINES = 400


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _ended(code: int) -> str:
    return f"killed by {_signal_name(-code)}" if code < 0 else f"exit {code}"


class LauncherReport:
    """A line filter: feed it text in any chunks, read back what the user should see.
    `where`: the file that keeps the launcher's full report (named in the one line)."""

    def __init__(self, where: str | None = None) -> None:
        self.where = f"its full report is in {where}" if where else "its full report is in its log"
        self._partial = ""
        self._fragment = ""  # a launcher's line another process's line landed in
        self._block: list[str] | None = None  # a ChildFailedError report
        self._root_seen = False
        self._chain: list[str] | None = None  # a traceback (and those chained to it)
        self._logging_error: str | None = None  # its first line, held until we know
        self._chain_prefix = ""  # that line, when the traceback being read follows it
        self._drop_call_stack = False  # after a dropped logging error: its call stack
        self._signal_said = False  # the one line for torchrun's signal was shown
        # The chain's exception lines so far, each with the file of its innermost frame.
        self._exceptions: list[tuple[str, str]] = []
        self._last_file = ""  # the file of the traceback's last frame read so far
        self._in_frames = False
        self._seen: set[tuple[str, ...]] = set()  # tracebacks shown, without their last line
        self.replaced = 0  # launcher blocks replaced by one line

    def feed(self, text: str) -> str:
        lines = (self._partial + text).split("\n")
        self._partial = lines.pop()  # an unfinished line waits for the rest
        return "".join(self._mended(line + "\n") for line in lines)

    def close(self) -> str:
        """Everything still held (an unfinished line, block or traceback)."""
        rest, self._partial = self._fragment + self._partial, ""
        self._fragment = ""
        out = self._line(rest) if rest else ""
        if self._block is not None:
            out += "".join(self._block)
            self._block = None
        if self._chain is not None:
            out += self._end_chain()
        if self._logging_error is not None:
            out += self._logging_error
            self._logging_error = None
        return out

    def _mended(self, line: str) -> str:
        """One line of the file to the state machine; inside a traceback or a report,
        a line of shardctl's own that landed inside an exception's line is read as its
        own line, and the exception's line waits for its rest (the next line)."""
        line, self._fragment = self._fragment + line, ""
        if self._block is not None or self._chain is not None:
            spliced = _SPLICED.search(line, 1)
            if spliced and _EXCEPTION_START.fullmatch(line[: spliced.start()]):
                self._fragment = line[: spliced.start()]
                return self._line(line[spliced.start() :])
        return self._line(line)

    # -- the state machine ------------------------------------------------------------

    def _line(self, line: str) -> str:
        if self._block is not None:
            return self._report_line(line)
        out = ""
        if self._chain is not None:
            if _OWN_LINE.match(line):  # a rank's line amid a traceback: shown, read on
                return line
            held = self._chain_line(line)
            if held:
                return ""
            out = self._end_chain()
        if self._drop_call_stack:
            if line.startswith(_CALL_STACK_TAIL):
                return out
            self._drop_call_stack = False
            if line.startswith("Arguments: "):
                return out
        if self._logging_error is not None:
            if _OWN_LINE.match(line) or _CHATTER.search(line):
                return out + ("" if _CHATTER.search(line) else line)
            held, self._logging_error = self._logging_error, None
            if line.rstrip("\n") == _TRACEBACK:
                self._start_chain(line, prefix=held)
                return out
            out += held
        if _START.search(line):
            self._block, self._root_seen = [line], False
            return out
        if _CHATTER.search(line):
            return out
        if line.rstrip("\n") == _LOGGING_ERROR:
            self._logging_error = line
            return out
        if line.rstrip("\n") == _TRACEBACK:
            self._start_chain(line, prefix="")
            return out
        return out + line

    def _start_chain(self, line: str, prefix: str) -> None:
        """Begin reading a traceback at its first line; `prefix`: text held before it."""
        self._chain, self._exceptions, self._in_frames = [line], [], True
        self._last_file = ""
        self._chain_prefix = prefix

    def _chain_line(self, line: str) -> bool:
        """Hold `line` as part of the traceback being read; False when it is not."""
        chain = self._chain
        assert chain is not None
        text = line.rstrip("\n")
        if len(chain) > _MAX_BLOCK_LINES:
            return False
        if self._in_frames:
            chain.append(line)
            if m := _FRAME_FILE.match(text):
                self._last_file = m.group(1)
            elif text and not text[0].isspace():  # the exception line ends a traceback
                self._exceptions.append((text, self._last_file))
                self._last_file = ""
                self._in_frames = False
            return True
        # After an exception: only "", a "During handling ..." line, "" and the next
        # traceback continue the chain.
        if text == "" or text in _CHAINED:
            chain.append(line)
            return True
        if text == _TRACEBACK and chain[-1].strip() == "" and chain[-2].strip() in _CHAINED:
            chain.append(line)
            self._in_frames = True
            return True
        return False

    def _end_chain(self) -> str:
        chain, self._chain = self._chain or [], None
        prefix, self._chain_prefix = self._chain_prefix, ""
        # Blank lines read while waiting for a chained traceback are not part of it.
        tail: list[str] = []
        while chain and chain[-1].strip() in ("", *_CHAINED):
            tail.insert(0, chain.pop())
        if self._in_frames or not self._exceptions:  # cut short: let it through
            return prefix + "".join(chain + tail)
        signals = [(_SIGNAL_EXC.match(exc), where) for exc, where in self._exceptions]
        last_signal = signals[-1][0]
        if last_signal and all(
            found or where.endswith(_LOGGING_MODULE) for found, where in signals
        ):
            self._drop_call_stack = bool(prefix)
            return self._signal_line(last_signal) + "".join(tail)
        key = tuple(chain[:-1])
        if key in self._seen:
            last = chain[-1].rstrip("\n")
            return (
                f"{prefix}[shardctl] another rank printed the same traceback, ending: {last}\n"
                + "".join(tail)
            )
        self._seen.add(key)
        return prefix + "".join(chain + tail)

    def _signal_line(self, match: re.Match[str]) -> str:
        """The one line for torchrun's own signal; said once however often it prints."""
        self.replaced += 1
        if self._signal_said:
            return ""
        self._signal_said = True
        got = _signal_name(int(match.group(1)))
        return (
            f"[shardctl] the launcher received {got} and stopped its ranks (not a crash; "
            f"{self.where})\n"
        )

    def _report_line(self, line: str) -> str:
        block = self._block
        assert block is not None
        block.append(line)
        if "Root Cause" in line:
            self._root_seen = True
        elif self._root_seen and _RULE.match(line):
            return self._finish_report()
        if len(block) > _MAX_BLOCK_LINES:
            self._block = None
            return "".join(block)
        return ""

    def _finish_report(self) -> str:
        block, self._block = self._block or [], None
        root: tuple[int | None, int] | None = None  # (rank, exit code)
        others: list[tuple[int | None, int]] = []
        in_root = False
        rank: int | None = None
        for line in block:
            if "Root Cause" in line:
                in_root = True
            if (m := _ERROR_FILE.match(line)) and m.group(1) != "<N/A>":
                return "".join(block)  # the report holds a rank's own traceback
            if m := _RANK.match(line):
                rank = int(m.group(1))
            if (m := _EXITCODE.match(line)) is None:
                continue
            if in_root and root is None:
                root = (rank, int(m.group(1)))
            else:
                others.append((rank, int(m.group(1))))
        if root is None:
            return "".join(block)
        self.replaced += 1
        codes = {code for _, code in others}
        # The first rank to stop saved for a preemption; the rest either did the same
        # or were torn down by torchrun itself (SIGTERM, then SIGKILL after its grace).
        if root[1] == EXIT_PREEMPTED and codes <= {EXIT_PREEMPTED, *_TEARDOWN}:
            return (
                "[shardctl] the launcher reports exit 42 from its ranks: they saved a "
                "checkpoint and stopped for a preemption (this is not a crash; submit again "
                f"to resume; {self.where})\n"
            )
        who = f"rank {root[0]}" if root[0] is not None else "a rank"
        rest = ""
        if others and codes <= _TEARDOWN:
            rest = ", then stopped the other ranks"
        elif others:
            rest = ", then " + ", ".join(
                f"rank {r if r is not None else '?'} ({_ended(code)})" for r, code in others
            )
        first = f"{who} ended first ({_ended(root[1])})"
        return f"[shardctl] the launcher reports {first}{rest}; {self.where}\n"


def readable(text: str, where: str | None = None) -> str:
    """`text` with every launcher report replaced by one line (see `LauncherReport`)."""
    report = LauncherReport(where)
    return report.feed(text) + report.close()

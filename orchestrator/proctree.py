"""Process trees, read from /proc: who descends from whom, who catches what.

The one place shardctl walks /proc. A process is named by `Proc(pid, ticks)`:
the pid together with its start time (clock ticks since boot, field 22 of
/proc/PID/stat), so a pid number reused by an unrelated process is never
signalled. Linux only; where /proc is missing the walks find nothing.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple


class Proc(NamedTuple):
    pid: int
    ticks: str | None  # start time; None when it could not be read


def _stat_fields(pid: int | str) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name (which may hold spaces)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_bytes().decode(errors="replace")
    except OSError:
        return None
    return text[text.rfind(")") + 2 :].split()


def start_ticks(pid: int) -> str | None:
    fields = _stat_fields(pid)
    return fields[19] if fields is not None and len(fields) > 19 else None


def proc(pid: int) -> Proc:
    return Proc(pid, start_ticks(pid))


def alive(pid: int, ticks: str | None = None) -> bool:
    """Whether the process runs (not a zombie) and, when `ticks` is given, is the same one."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    fields = _stat_fields(pid)
    if fields is None:
        return ticks is None
    if fields[0] == "Z":
        return False
    return ticks is None or len(fields) <= 19 or fields[19] == ticks


def descendants(root: int) -> list[Proc]:
    """Every process below `root`, children before grandchildren."""
    children: dict[int, list[int]] = {}
    with contextlib.suppress(OSError):
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            fields = _stat_fields(entry)
            if fields is not None and len(fields) > 1:
                children.setdefault(int(fields[1]), []).append(int(entry))
    out: list[Proc] = []
    todo = list(children.get(root, []))
    while todo:
        pid = todo.pop(0)
        out.append(proc(pid))
        todo.extend(children.get(pid, []))
    return out


def catches(pid: int, signum: int) -> bool:
    """Whether process `pid` has a handler installed for `signum` (SigCgt)."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except (OSError, ValueError):
        pass
    return False


def signal_all(procs: Iterable[Proc], signum: int) -> None:
    """Send `signum` to each process that is still the one named."""
    for p in procs:
        if alive(p.pid, p.ticks):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(p.pid, signum)


def forward_to_catchers(root: int, signum: int, done: set[tuple[int, int]]) -> set[tuple[int, int]]:
    """Send `signum` once to `root` and each process below it that catches it (the
    ranks of a launcher: one that does not catch it would die of it); returns the
    (pid, signal) pairs sent, to pass back as `done` next time."""
    sent: set[tuple[int, int]] = set()
    for pid in [root, *(p.pid for p in descendants(root))]:
        if (pid, signum) in done or not catches(pid, signum):
            continue
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signum)
            sent.add((pid, signum))
    return sent

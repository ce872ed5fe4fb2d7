"""One writer per output: a claim file beside the folder `consolidate` or `convert` writes.

Both commands stage their output in `<out>.tmp/` and publish it with one rename
(`orchestrator/storage.py`). Two of them writing the same `--out` at once would remove each
other's staging folder; the second one is refused instead, naming the first (its
pid, host and command). The claim is `<out>.claim`, created with O_EXCL and holding
the writer's pid, its start time (so a reused pid is not taken for it) and host; it
is removed when the writer ends, however it ends. A claim whose writer is dead on
this host is taken over; one from another host is only named (its liveness cannot be
seen from here). Torch-free: the CLI and the training loop's rank 0 both take it.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .durable import storage_error
from .errors import ShardctlError, UsageError
from .proctree import alive, start_ticks

CLAIM_SUFFIX = ".claim"
_TAKEOVER_TRIES = 3


def claim_path(out: Path) -> Path:
    return out.parent / f"{out.name}{CLAIM_SUFFIX}"


@contextlib.contextmanager
def output_claim(out: str | Path, command: str) -> Iterator[None]:
    """Hold `<out>.claim` while the body writes `out`; `command` names the writer
    ("shardctl consolidate") in the refusal another writer gets."""
    out = Path(out)
    claim = claim_path(out)
    me = {
        "pid": os.getpid(),
        "ticks": start_ticks(os.getpid()),
        "host": socket.gethostname(),
        "command": command,
        "since": round(time.time(), 3),
    }
    _take(claim, out, me)
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            if _read(claim) == me:  # never remove a claim that is no longer ours
                claim.unlink()


def _take(claim: Path, out: Path, me: dict[str, Any]) -> None:
    for _ in range(_TAKEOVER_TRIES):
        try:
            _create(claim, me)
            return
        except FileExistsError:
            holder = _read(claim)
            if holder is None or not _dead(holder):
                raise UsageError(_refusal(out, claim, holder)) from None
            _take_over(claim, holder)
        except OSError as exc:
            what = f"{out} (its claim {claim.name})"
            problem = storage_error(exc, out.parent, what=what, aftermath="nothing was written")
            raise problem or ShardctlError(
                f"cannot create {claim} (the claim on {out}): {exc.strerror or exc}"
            ) from None
    raise UsageError(_refusal(out, claim, _read(claim)))


def _create(claim: Path, me: dict[str, Any]) -> None:
    claim.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(me) + "\n")


def _read(claim: Path) -> dict[str, Any] | None:
    """The claim's holder; None when it cannot be read or is still being written."""
    try:
        holder = json.loads(claim.read_text())
    except (OSError, ValueError):
        return None
    return holder if isinstance(holder, dict) and isinstance(holder.get("pid"), int) else None


def _dead(holder: dict[str, Any]) -> bool:
    if holder.get("host") != socket.gethostname():
        return False  # another host's process cannot be seen from here
    ticks = holder.get("ticks")
    return not alive(holder["pid"], ticks if isinstance(ticks, str) else None)


def _take_over(claim: Path, holder: dict[str, Any]) -> None:
    """Move a dead writer's claim aside; if another taker replaced it meanwhile with
    a live claim, put that one back (the next O_EXCL create then refuses)."""
    aside = claim.with_name(f"{claim.name}.stale-{os.getpid()}-{time.monotonic_ns()}")
    try:
        os.rename(claim, aside)
    except FileNotFoundError:
        return  # another taker moved it first
    moved = _read(aside)
    if moved != holder:
        with contextlib.suppress(OSError):
            os.link(aside, claim)  # fails only if a third writer claimed it: theirs stands
    aside.unlink(missing_ok=True)


def _refusal(out: Path, claim: Path, holder: dict[str, Any] | None) -> str:
    if holder is None:
        return (
            f"{claim} exists: another shardctl is writing {out}, or one was stopped "
            f"while claiming it; wait for it to end, or delete {claim} if none runs"
        )
    since = time.strftime("%H:%M:%S", time.localtime(float(holder.get("since") or 0)))
    where = f"pid {holder['pid']} on {holder.get('host')}, since {since}"
    return (
        f"{out} is being written by another `{holder.get('command', 'shardctl')}` "
        f"({where}); wait for it to end or give another --out. If that process is gone, "
        f"delete {claim}"
    )

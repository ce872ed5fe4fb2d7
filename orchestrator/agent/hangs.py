"""The hang rule, applied by the node agent itself to the launchers below it.

The agent offers: it makes one heartbeat folder for its life and sets it in the
launcher's environment (`ENV_HEARTBEAT_DIR`). The rendered `launch.sh` accepts when
the spec wants hang detection (`watchdog.enabled`): it then runs no watchdog and
exports `ENV_HANG_WATCHER=agent` before it execs the launcher (`launch.hang_watch_lines`).
A script that did not accept (`watchdog.enabled: false`, or rendered by an older
version: its own watchdog) is left alone.

What the rule needs to know of the run (the node, the attempt, its token, the run dir,
the timeouts) is the rendered environment, which the agent does not have: it reads it
from the launcher's own process (`/proc/<pid>/environ`, complete once `launch.sh`
exec'd it). One agent may run several launch scripts (this machine's: one per node
rank, each with a folder of its own below the agent's); each launcher that accepted
gets its own `HangWatch` (the watchdog's library, torch-free, imported when the agent
starts watching: orchestrator/ imports nothing of train/ at module level).

A hung node's launcher is ended (HUNG, every rank's stack, SIGKILL to its tree) and
`look` says so: the agent then takes the round's code for `EXIT_HUNG`, as the
watchdog's exit said it.
"""

from __future__ import annotations

import contextlib
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ..launch import AGENT_WATCHES
from ..proctree import descendants
from ..rundir import ENV_HANG_WATCHER, ENV_HEARTBEAT_DIR

if TYPE_CHECKING:
    from shardctl.train.watchdog import HangWatch


def environ_of(pid: int) -> dict[str, str]:
    """A process's environment as it was exec'd ({} when it cannot be read)."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}


class AgentHangs:
    """The hang rule over every launcher below one node agent (see the module
    docstring). `offer` once; `new_round` before each round's launcher starts; `look`
    at every poll; `close` at the end."""

    def __init__(self) -> None:
        from shardctl.train.watchdog import heartbeat_folder

        # None (said in one line): the scripts fall back to their watchdog.
        self.folder = heartbeat_folder()
        self.watches: dict[str, HangWatch] = {}  # by heartbeat folder: one per launcher
        self.launchers: dict[str, int] = {}

    def offer(self, env: dict[str, str]) -> None:
        """The launcher's environment: where the ranks beat, which tells `launch.sh`
        that this agent applies the rule."""
        if self.folder is not None:
            env[ENV_HEARTBEAT_DIR] = str(self.folder)

    def new_round(self) -> None:
        """Forget the last round's ranks: an empty folder, no launcher watched (a new
        `HangWatch` per launcher: its report is named by the round's restart)."""
        self.watches.clear()
        self.launchers.clear()
        if self.folder is None:
            return
        for entry in list(self.folder.iterdir()) if self.folder.is_dir() else ():
            with contextlib.suppress(OSError):
                if entry.is_dir():
                    shutil.rmtree(entry)
                else:
                    entry.unlink()

    def look(self, launcher: int) -> bool:
        """One look at every launcher below the agent's child `launcher` (itself
        included) that accepted: True once one of them was ended as hung."""
        if self.folder is None:
            return False
        self._find_launchers(launcher)
        # Every launcher, even once one was ended: the node whose rank stopped first
        # may declare in the same poll, and its HUNG, which names that rank, is kept.
        ended = [self.watches[folder].look(pid) for folder, pid in list(self.launchers.items())]
        return any(ended)

    def _find_launchers(self, root: int) -> None:
        """New launchers that accepted: the top-most process with an accepting
        environment per heartbeat folder (its ranks below share it)."""
        from shardctl.train.watchdog import HangWatch

        for pid in [root, *(p.pid for p in descendants(root))]:
            env = environ_of(pid)
            folder = env.get(ENV_HEARTBEAT_DIR, "")
            if env.get(ENV_HANG_WATCHER) != AGENT_WATCHES or not folder:
                continue
            if folder in self.launchers:
                continue
            self.launchers[folder] = pid
            self.watches[folder] = watch = HangWatch(Path(folder), env)
            # Where the watchdog said it: the node's error log (the hang report goes there).
            print(f"[shardctl] node {watch.node}: the node agent watches the ranks of pid "
                  f"{pid}; {watch.describe()}", file=sys.stderr, flush=True)  # fmt: skip

    def close(self) -> None:
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)

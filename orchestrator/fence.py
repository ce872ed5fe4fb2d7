"""Fencing by attempt: only the current attempt of a run may publish a checkpoint.

A rank of an earlier attempt can outlive it (a node that kept running through a
requeue, a job submitted twice). Such a rank must never publish: its `step-N`
would race the new attempt's, or rename the new attempt's half-written
`step-N.tmp` into place.

The supervisor of each attempt (local: `LocalCluster.schedule`; Slurm: node 0's
`NodeTask`, at every start and requeue) writes a new token into the run dir's
`CURRENT_ATTEMPT` file before it starts the launcher, and gives the same token to
every rank in `SHARDCTL_ATTEMPT_TOKEN`. The checkpoint storage calls
`AttemptFence.check` just before it starts a save and just before the atomic
rename: a rank whose token is no longer the file's refuses (`StaleAttemptError`),
and its staging folder is left alone (it may be the new attempt's).

Limits: the check and the rename are two steps (an attempt that starts between
them, within microseconds, is not seen; what is published then is still a
complete checkpoint); the file is read through the run dir's file system, so
NFS attribute caching may delay a new token by its cache time (close-to-open
consistency makes a fresh open see it on most mounts). Ranks without a token
(Kubernetes pods, `launch.sh` or a script run by hand) are not fenced; the
standalone `job.sbatch` runs Slurm's node task, which is.

Torch-free: imports only `rundir`, `durable` and `errors`. A supervisor written in
bash (the local one, at a restart inside the allocation) claims through `python -m
shardctl.orchestrator.fence RUN_DIR TOKEN`.
"""

from __future__ import annotations

import json
import os
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

from .durable import write_text_atomic
from .errors import CheckpointError
from .rundir import CURRENT_ATTEMPT_FILE, ENV_ATTEMPT_TOKEN, ENV_RUN_DIR


class StaleAttemptError(CheckpointError):
    """A rank of an attempt that is no longer the run's current one tried to save."""


def new_token(cluster: str, job: str, attempt: int, *, unique: bool = True) -> str:
    """An attempt's token: readable, and (`unique`) never equal to an earlier one's.
    Slurm's nodes derive the same token on their own (`unique=False`)."""
    token = f"{cluster}-{job}-{attempt}"
    return f"{token}-{uuid.uuid4().hex[:8]}" if unique else token


def claim_attempt(run_dir: str | Path, token: str, **about: object) -> None:
    """Make `token` the run's current attempt (written atomically; the last wins)."""
    root = Path(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    write_text_atomic(
        root / CURRENT_ATTEMPT_FILE, json.dumps({"token": token, **about}) + "\n", durable=True
    )


def current_attempt(run_dir: str | Path) -> dict[str, object] | None:
    """The run's current attempt ({"token", ...}), or None when none is recorded."""
    try:
        data = json.loads((Path(run_dir) / CURRENT_ATTEMPT_FILE).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("token"), str) else None


@dataclass(frozen=True)
class AttemptFence:
    """This rank's attempt token and the run dir that says which attempt is current."""

    run_dir: Path
    token: str

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> AttemptFence | None:
        """The fence of a rank started by a supervisor that hands out tokens; None
        where none did (nothing to check against)."""
        env = dict(os.environ) if env is None else env
        token, run_dir = env.get(ENV_ATTEMPT_TOKEN, ""), env.get(ENV_RUN_DIR, "")
        return cls(Path(run_dir), token) if token and run_dir else None

    def check(self, name: str) -> None:
        """Raise `StaleAttemptError` unless this rank's attempt is still current."""
        current = current_attempt(self.run_dir)
        if current is not None and current["token"] == self.token:
            return
        now = "no attempt is recorded" if current is None else f"the current one is {current}"
        raise StaleAttemptError(
            f"not publishing {name}: this rank belongs to attempt {self.token!r}, which is no "
            f"longer the current attempt of {self.run_dir} ({now} in {CURRENT_ATTEMPT_FILE}); "
            "a newer attempt of this run owns its checkpoints. This rank stops; nothing was "
            "published"
        )


def main(argv: list[str] | None = None) -> int:
    """`python -m shardctl.orchestrator.fence RUN_DIR TOKEN [KEY=VALUE ...]`: claim."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 2 or not all("=" in a for a in args[2:]):
        print("usage: python -m shardctl.orchestrator.fence RUN_DIR TOKEN [KEY=VALUE ...]")
        return 2
    about = dict(a.split("=", 1) for a in args[2:])
    claim_attempt(args[0], args[1], **about)
    return 0


if __name__ == "__main__":
    sys.exit(main())

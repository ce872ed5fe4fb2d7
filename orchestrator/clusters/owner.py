"""One writer per run: a run directory belongs to one live job at a time.

`shardctl submit` asks, under the run dir's submit claim, whether any job record
(`records.py`) of the same run directory still names a live job, on any cluster
whose run dir is on a file system this machine reads (local, Slurm: compared by
resolved path). Live means its own cluster's `status` says it has not ended
(`Cluster.has_ended`: queued, running, requeued). A status that cannot be read
counts as live: it is never silently ignored. `--replace` cancels such jobs and
waits for them to end before submitting.

Kubernetes jobs (`run_dir_here` false: the run dir is on a volume) are not
compared here; Kubernetes refuses a second job of the same name itself and
`--replace` deletes it (`clusters/k8s`).

The claim closes the race of two submits at the same instant: a file created
with O_CREAT|O_EXCL in the run dir (atomic on local file systems and on NFSv3 and
later; flock is not reliable across NFS clients), held from the check until the
job is recorded, then removed. Its limits: a submit killed while holding it leaves
it behind (a holder on this host that is gone is taken over; one on another host
must be removed by hand, and the message names the file); two submits that use
different state directories (`SHARDCTL_STATE_DIR`) see only their own records —
the claim still keeps their checks from interleaving, and the attempt fence
(`orchestrator/fence.py`) still keeps a stale rank from publishing.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ..durable import free_bytes
from ..errors import ClusterError, ShardctlError, StorageError
from ..proctree import alive
from ..rundir import SUBMIT_CLAIM_FILE
from .base import Cluster, JobRef, JobState
from .records import jobs_dir, load_records

# Below this many free bytes the run dir is called full: the rendered files, the logs
# and the first checkpoint would not fit.
RUN_DIR_MIN_FREE = 1 << 20
# How long `--replace` waits for a cancelled job to end (ranks save on the way out).
REPLACE_WAIT_S = 600.0


@dataclass(frozen=True)
class LiveJob:
    """A job of the same run dir that has not ended, or whose state is unknown."""

    ref: JobRef
    state: str  # its JobState, or "unreadable"
    why: str = ""  # why its status could not be read

    def describe(self) -> str:
        where = f"{self.ref.name!r} on {self.ref.cluster}, job id {self.ref.job_id or '?'}"
        if self.why:
            return f"{where}: its status cannot be read ({self.why})"
        return f"{where}, {self.state}"


def _same_dir(a: str | Path, b: str | Path) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def _backend(ref: JobRef) -> Cluster:
    from . import cluster_class

    return cluster_class(ref.cluster)()


def live_jobs(run_dir: str | Path) -> list[LiveJob]:
    """Every recorded job of `run_dir` that is queued, running, or of unknown state."""
    from . import cluster_class

    out: list[LiveJob] = []
    for ref in load_records():
        try:
            # The path first: only a record of this run dir loads its cluster's backend.
            if not _same_dir(ref.run_dir, run_dir) or not cluster_class(ref.cluster).run_dir_here:
                continue
            backend = _backend(ref)
            st = backend.status(ref)
            if not backend.has_ended(ref, st):
                out.append(LiveJob(ref, st.state.value))
        except (ShardctlError, OSError, ValueError) as exc:
            out.append(LiveJob(ref, "unreadable", str(exc) or type(exc).__name__))
    return out


def refusal(run_dir: str | Path, live: list[LiveJob]) -> str:
    """What `submit` says when the run dir already has a live job."""
    jobs = "; ".join(job.describe() for job in live)
    unreadable = [job for job in live if job.why]
    text = (
        f"run dir {run_dir} belongs to a live job ({jobs}); two jobs must never write one run "
        f"dir. Wait for it (`shardctl status {live[0].ref.name}`), stop it (`shardctl cancel "
        f"{live[0].ref.name}`), or submit with --replace to cancel it and submit once it ended"
    )
    if unreadable:
        text += (
            f". If a job whose status cannot be read is gone for good, delete its record in "
            f"{jobs_dir()} ({', '.join(j.ref.name + '.json' for j in unreadable)})"
        )
    return text


def replace_live(live: list[LiveJob], wait_s: float = REPLACE_WAIT_S) -> None:
    """`submit --replace`: cancel every live job of the run dir and wait until each
    has ended (its ranks may save on the way out)."""
    for job in live:
        backend = _backend(job.ref)
        with contextlib.suppress(ClusterError):  # ended meanwhile: "nothing to cancel"
            backend.cancel(job.ref)
        deadline = time.monotonic() + wait_s
        while True:
            st = backend.status(job.ref)
            if backend.has_ended(job.ref, st) or st.state is JobState.CANCELLED:
                break
            if time.monotonic() > deadline:
                raise ClusterError(
                    f"cancelled {job.describe()}, but it has not ended after {wait_s:.0f} s "
                    f"(state {st.state.value}); nothing was submitted. Try again once "
                    f"`shardctl status {job.ref.name}` shows it ended"
                )
            time.sleep(backend.poll_s)


@contextlib.contextmanager
def submit_claim(run_dir: str | Path) -> Iterator[None]:
    """Hold the run dir's submit claim (see the module docstring) while the body runs."""
    root = Path(run_dir)
    made = _missing_dirs(root)
    path = root / SUBMIT_CLAIM_FILE
    taken = False
    try:
        root.mkdir(parents=True, exist_ok=True)
        _take_claim(root, path)
        taken = True
        free = free_bytes(root)
        if free is not None and free < RUN_DIR_MIN_FREE:
            raise OSError(errno.ENOSPC, f"No space left on device: {free} bytes free")
    except OSError as exc:
        if taken:
            path.unlink(missing_ok=True)
        _remove_made(made)
        raise StorageError(_run_dir_unwritable(root, exc)) from None
    try:
        yield
    finally:
        path.unlink(missing_ok=True)
        # A refused submit leaves no trace: the directories the claim itself made
        # go again while nothing else was written into them.
        _remove_made(made)


def _take_claim(root: Path, path: Path) -> None:
    """Create the claim file (O_EXCL), taking over one left by a dead submit here."""
    me = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = _holder(path)
            if holder is not None and _gone(holder):
                path.unlink(missing_ok=True)  # a submit on this host that died holding it
                continue
            raise ClusterError(
                f"another `shardctl submit` of run dir {root} is under way ({_who(holder)}); "
                f"try again when it finished. If none is, delete {path}"
            ) from None
        try:
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(me) + "\n")
                f.flush()
                os.fsync(f.fileno())  # a full disk says so here, not at the job's first write
        except OSError:
            path.unlink(missing_ok=True)
            raise
        return


def _remove_made(made: list[Path]) -> None:
    for made_dir in made:
        with contextlib.suppress(OSError):
            made_dir.rmdir()


def _run_dir_unwritable(root: Path, exc: OSError) -> str:
    """Why the run dir cannot take the job's files (one line), before anything starts."""
    code = errno.errorcode.get(exc.errno or 0, "")
    why = f"{exc.strerror or type(exc).__name__}" + (f" ({code})" if code else "")
    for here in (root, *root.parents):
        if here.exists() and not here.is_dir():
            why = f"{here} is a file, not a directory"
            break
    return (
        f"cannot write the run dir {root}: {why}; nothing was submitted. Free space there, "
        "make it writable, or set run_dir in the spec (or --set run_dir=PATH) to a writable "
        "directory"
    )


def _missing_dirs(root: Path) -> list[Path]:
    """The directories `mkdir -p root` would create, deepest first."""
    missing: list[Path] = []
    here = root.absolute()
    while not here.exists() and here != here.parent:
        missing.append(here)
        here = here.parent
    return missing


def _holder(path: Path) -> dict[str, object] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _gone(holder: dict[str, object]) -> bool:
    pid = holder.get("pid")
    return holder.get("host") == socket.gethostname() and isinstance(pid, int) and not alive(pid)


def _who(holder: dict[str, object] | None) -> str:
    if holder is None:
        return "holder unknown"
    since = holder.get("since")
    when = time.strftime("%H:%M:%S", time.localtime(since)) if isinstance(since, float) else "?"
    return f"pid {holder.get('pid', '?')} on {holder.get('host', '?')} since {when}"

"""Job records: which cluster and id a submitted job name refers to.

One small JSON file per job name under the state directory
(`$SHARDCTL_STATE_DIR`, default `$XDG_STATE_HOME/shardctl` or
`~/.local/state/shardctl`), written atomically, so `shardctl status|logs|cancel
NAME` find the cluster and id without asking. A record that cannot be read (cut
short, edited by hand, from another version) is reported by name and skipped:
it never breaks the commands for the other jobs.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import subprocess
import sys
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from ..durable import write_text_atomic
from ..errors import JobNotFoundError, SpecError, StorageError
from .base import JobRef

_REQUIRED = {f.name for f in fields(JobRef) if f.name != "extra"}
STATE_DIR_VAR = "SHARDCTL_STATE_DIR"
# `submit`'s probe of the state dir: larger than any record, so that a disk too full
# for the record refuses the probe, before the job starts, and not the record after.
PROBE_BYTES = 16 * 1024


def state_dir() -> Path:
    base = os.environ.get(STATE_DIR_VAR)
    if base:
        return Path(base)
    return Path(os.environ.get("XDG_STATE_HOME", Path.home() / ".local" / "state")) / "shardctl"


def jobs_dir() -> Path:
    return state_dir() / "jobs"


def check_writable() -> None:
    """Refuse (StorageError, one line) a state dir where a record cannot be written: a
    file in its place, a read-only or full file system. `submit` asks before the job
    starts; a record that fails after it would leave the job running unseen by `ls`,
    `status` and `cancel`."""
    folder = jobs_dir()
    probe = folder / f".probe-{os.getpid()}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with probe.open("wb") as f:
            f.write(b"\0" * PROBE_BYTES)
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        raise StorageError(unwritable(exc)) from None
    finally:
        with contextlib.suppress(OSError):  # never made: its folder is not there
            probe.unlink(missing_ok=True)


def unwritable(exc: OSError, aftermath: str = "nothing was submitted") -> str:
    """Why job records cannot be written to the state dir, what became of the job
    (`aftermath`), and how to move the state dir."""
    code = errno.errorcode.get(exc.errno or 0, "")
    why = f"{exc.strerror or type(exc).__name__}" + (f" ({code})" if code else "")
    if exc.errno in (errno.ENOTDIR, errno.EEXIST):
        blocker = _file_in_the_way(jobs_dir())
        if blocker is not None:
            why = f"{blocker} is a file, not a directory"
    return (
        f"cannot record jobs in the state dir {state_dir()}: {why}; {aftermath}. "
        f"Free space or make it writable, or set {STATE_DIR_VAR} to a writable directory "
        "(`ls`, `status` and `cancel` then see only the jobs recorded there)"
    )


def _file_in_the_way(path: Path) -> Path | None:
    """The nearest existing ancestor of `path` (or itself) that is not a directory."""
    for here in (path, *path.parents):
        if here.exists() or here.is_symlink():
            return None if here.is_dir() else here
    return None


# `code_version` asks git at submit; a repository on a hung file system must not hold it.
GIT_TIMEOUT_S = 10.0


def code_version(folder: str | Path) -> dict[str, Any]:
    """The code a job runs, recorded at submit (`extra["code"]` of its record, shown by
    `status`): the git repository holding `folder`, its checked-out commit, and whether
    its tracked files differ from that commit (`dirty`; untracked files, such as the
    run dirs beside a spec, do not count). Outside a repository, without git, or
    when git does not answer within GIT_TIMEOUT_S: `repo`, `commit` and `dirty` are
    None. Never an error: a submit does not depend on it."""

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(
                ["git", "-C", str(folder), *args], capture_output=True, text=True,
                timeout=GIT_TIMEOUT_S, stdin=subprocess.DEVNULL,
            )  # fmt: skip
        except (OSError, subprocess.SubprocessError, UnicodeDecodeError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    repo = git("rev-parse", "--show-toplevel")
    commit = git("rev-parse", "--verify", "--quiet", "HEAD") if repo else None
    changes = git("status", "--porcelain", "--untracked-files=no") if commit else None
    return {
        "folder": str(folder),
        "repo": repo,
        "commit": commit,
        "dirty": None if changes is None else bool(changes),
    }


def describe_code(code: Any) -> str | None:
    """`status`'s line for a record's `code` (None: a record from before it was kept)."""
    if not isinstance(code, dict):
        return None
    if not code.get("commit"):
        where = code.get("repo") or code.get("folder") or "?"
        why = "a git repository without a commit" if code.get("repo") else "no git repository"
        return f"code: {where} is {why} (no commit recorded)"
    state = {True: "dirty: tracked files differ from it", False: "clean"}.get(
        code.get("dirty"), "dirty or clean unknown"
    )
    return f"code: git {str(code['commit'])[:12]} ({state}) in {code.get('repo')}"


def remember(ref: JobRef) -> None:
    """Record a submitted job (written atomically; the newest per name wins)."""
    folder = jobs_dir()
    folder.mkdir(parents=True, exist_ok=True)
    write_text_atomic(
        folder / f"{ref.name}.json", json.dumps(ref.to_json(), indent=2, sort_keys=True)
    )


def parse_record(text: str) -> JobRef:
    """A record's text as a JobRef; ValueError saying what is wrong with it."""
    data: Any = json.loads(text)
    if not isinstance(data, dict):
        raise ValueError(f"a JSON object was expected, found {type(data).__name__}")
    missing = sorted(_REQUIRED - data.keys())
    if missing:
        raise ValueError(f"missing {', '.join(missing)}")
    unknown = sorted(data.keys() - _REQUIRED - {"extra"})
    if unknown:
        raise ValueError(f"unknown keys {', '.join(unknown)}")
    for key in _REQUIRED:
        if not isinstance(data[key], str):
            raise ValueError(f"{key} is not a string")
    # shardctl writes names, cluster names and job ids without blanks or control
    # characters (a local job's id is empty); one with them was edited by hand or torn,
    # and would break `ls`'s columns or reach a cluster's command line.
    for key in ("name", "cluster", "job_id"):
        if any(c.isspace() or not c.isprintable() for c in data[key]):
            raise ValueError(f"{key} {data[key]!r} has a blank or a control character")
    for key in ("name", "cluster"):
        if not data[key]:
            raise ValueError(f"{key} is empty")
    if not data["run_dir"].isprintable():
        raise ValueError(f"run_dir {data['run_dir']!r} has a control character")
    if not isinstance(data.get("extra", {}), dict):
        raise ValueError("extra is not an object")
    return JobRef(**data)


def _readable_jobs_dir() -> Path:
    """The folder of records; a file in its place is said (it would read as "no
    submitted jobs"), a folder not made yet is simply empty."""
    folder = jobs_dir()
    blocker = _file_in_the_way(folder)
    if blocker is not None:
        raise StorageError(
            f"cannot read job records in the state dir {state_dir()}: {blocker} is a file, "
            f"not a directory; set {STATE_DIR_VAR} to a directory"
        )
    return folder


def load_records(warn: bool = True) -> list[JobRef]:
    """Every readable record; each unreadable one is named on stderr and skipped."""
    folder = _readable_jobs_dir()
    refs: list[JobRef] = []
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            refs.append(parse_record(path.read_text()))
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            if warn:
                print(
                    f"warning: skipping the unreadable job record {path} ({exc}); "
                    "delete it if the job is gone",
                    file=sys.stderr,
                )
    return refs


@dataclass(frozen=True)
class Record:
    """One record file as `shardctl ls` sees it: the job, or why it cannot be read."""

    path: Path
    ref: JobRef | None
    error: str  # "" when `ref` was read
    submitted: float | None  # the record's mtime: when the job was (last) submitted


def scan_records() -> list[Record]:
    """Every record file, readable or not, sorted by name (`ls` shows the bad ones)."""
    folder = _readable_jobs_dir()
    out: list[Record] = []
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            mtime: float | None = path.stat().st_mtime
        except OSError:
            mtime = None
        try:
            out.append(Record(path, parse_record(path.read_text()), "", mtime))
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            out.append(Record(path, None, str(exc) or type(exc).__name__, mtime))
    return out


def recall(name_or_id: str) -> JobRef:
    """Find a submitted job by name, or by cluster job id."""
    refs = load_records()
    for ref in refs:
        if ref.name == name_or_id:
            return ref
    for ref in refs:
        if ref.job_id == name_or_id:
            return ref
    names = [r.name for r in refs]
    known = ", ".join(names[:20]) + (f" and {len(names) - 20} more" if len(names) > 20 else "")
    raise JobNotFoundError(
        f"no submitted job named or with id {SpecError.show_value(name_or_id)} (known jobs: "
        f"{known or 'none'}); {_spec_hint(name_or_id)}"
        "submit one with `shardctl submit SPEC`"
    )


def _spec_hint(given: str) -> str:
    """What to give instead of a job spec's path: the job's name it holds."""
    path = Path(given)
    if path.suffix not in (".yaml", ".yml") or not path.is_file():
        return ""
    from ..yamlio import read_yaml_file

    try:
        name = read_yaml_file(path).get("name")
    except (SpecError, AttributeError):  # not a spec: the file is not named for its job
        name = None
    named = f" (this one names job {name!r})" if isinstance(name, str) else ""
    return f"JOB is a job's name or id, not its spec file{named}; "

"""What Slurm says of many jobs at once, for `shardctl ls` (`SlurmCluster.status_many`),
and of one (`scontrol_job`, for `status` and the node task).

`status` asks about one job: `scontrol show job -o ID` (the controller, which keeps a
job for MinJobAge after it ends), else `sacct -j ID` (the accounting database). With
one such pair per job, `ls` of 1,000 Slurm jobs ran 2,000 commands (benchmarks/README.md,
"Many jobs: ls and status"). Here the same two questions are asked once for all of
them: `scontrol show job -o` lists every job the controller holds (one RPC, the one
`squeue` makes too), and the ids it does not hold go to one `sacct -j ID,ID,...` (per
SACCT_IDS_PER_CALL ids: one argument of a command line is at most 128 KiB on Linux).
Both answers are parsed as `status` parses its own, so a job's row is the same either
way. The parsers are pure (tests/test_ls_many.py feeds them real output).
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterable

from ...errors import ClusterError

SACCT_IDS_PER_CALL = 1000
# The fields `status` reads from the accounting database, in this order (after JobID).
SACCT_FIELDS = "State,ExitCode,NodeList,Start"
# A plain job id, the only kind shardctl records (submitit submits no arrays); any other
# text is asked about on its own (`status`), so that it cannot spoil the others' query.
PLAIN_JOB_ID = re.compile(r"[1-9][0-9]*")
QUERY_TIMEOUT_S = 60


def scontrol_fields(text: str) -> dict[str, str]:
    """`Key=Value` words of `scontrol show job -o` output, the first of each key kept."""
    fields: dict[str, str] = {}
    for word in text.split():
        key, sep, value = word.partition("=")
        if sep and key not in fields:
            fields[key] = value
    return fields


def parse_controller_listing(text: str) -> dict[str, dict[str, str]]:
    """`scontrol show job -o` (every job, one line each) as {job id: its fields}; a
    line without a JobId ("No jobs in the system") is skipped."""
    jobs: dict[str, dict[str, str]] = {}
    for line in text.splitlines():
        fields = scontrol_fields(line)
        job_id = fields.get("JobId")
        if job_id and job_id not in jobs:
            jobs[job_id] = fields
    return jobs


def parse_accounting(text: str) -> dict[str, str]:
    """`sacct -X -n -P -o JobID,<SACCT_FIELDS>` as {job id: the line's other fields, as
    `status` reads them}. The first line of a job wins, as in `status`; an array task's
    or a heterogeneous job's component (`5_1`, `5+0`) also answers for its job (`5`)."""
    lines: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        job_id, _, rest = line.partition("|")
        job_id = job_id.strip()
        lines.setdefault(job_id, rest)
        lines.setdefault(re.split(r"[_+.]", job_id, maxsplit=1)[0], rest)
    return lines


def controller_jobs() -> dict[str, dict[str, str]]:
    """Every job the controller holds, by id; {} when it does not answer (`status` then
    asks the accounting database too)."""
    try:
        proc = subprocess.run(
            ["scontrol", "show", "job", "-o"],
            capture_output=True, text=True, timeout=QUERY_TIMEOUT_S,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ClusterError(f"status of the Slurm jobs: scontrol: {exc}") from None
    if proc.returncode != 0:
        return {}
    return parse_controller_listing(proc.stdout)


def accounting_lines(job_ids: Iterable[str]) -> dict[str, str]:
    """What the accounting database says of `job_ids` (see `parse_accounting`); a job
    it does not know is absent. A query that fails answers nothing, as in `status`."""
    ids = sorted(set(job_ids), key=lambda j: (len(j), j))
    found: dict[str, str] = {}
    for i in range(0, len(ids), SACCT_IDS_PER_CALL):
        chunk = ids[i : i + SACCT_IDS_PER_CALL]
        argv = ["sacct", "-j", ",".join(chunk), "-X", "-n", "-P", "-o", f"JobID,{SACCT_FIELDS}"]
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=QUERY_TIMEOUT_S)
        except subprocess.TimeoutExpired:  # its message would list every id
            raise ClusterError(
                f"status of {len(chunk)} Slurm job(s): sacct gave no answer within "
                f"{QUERY_TIMEOUT_S} s"
            ) from None
        except OSError as exc:
            raise ClusterError(f"status of {len(chunk)} Slurm job(s): sacct: {exc}") from None
        for job_id, rest in parse_accounting(proc.stdout).items():
            found.setdefault(job_id, rest)
    return found


def scontrol_job(job_id: str) -> dict[str, str] | None:
    """`status`'s question about one job: its fields as the controller holds them
    (`scontrol show job -o ID`), or None when the controller no longer holds it."""
    try:
        proc = subprocess.run(
            ["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ClusterError(f"status of job {job_id}: {exc}") from None
    if proc.returncode != 0 or not proc.stdout.strip():
        return None
    return scontrol_fields(proc.stdout)

"""The Kubernetes job APIs shardctl speaks, and the one place that picks one.

Everything that differs between them is asked of the `JobKind` this returns; no
other code compares `k8s.api` (or a job record's "api") with a name.
"""

from __future__ import annotations

from .jobkind import JobKind
from .pytorchjob import PYTORCHJOB
from .trainjob import TRAINJOB

KINDS: dict[str, JobKind] = {kind.api: kind for kind in (PYTORCHJOB, TRAINJOB)}


def job_kind(api: str | None) -> JobKind:
    """The kind for `k8s.api` (or a job record's "api"). Records from before TrainJobs
    existed hold no "api": they are PyTorchJobs, as is anything unknown."""
    return KINDS.get(str(api or PYTORCHJOB.api), PYTORCHJOB)

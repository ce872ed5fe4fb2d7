"""`batchq`: a made-up batch queue, as a cluster plugin of shardctl.

What a cluster outside shardctl's repository brings: a `Cluster` subclass named by
an entry point of the group `shardctl.clusters`, and its spec section (`batchq:`
in a job spec) as `spec_section`. The dry run writes `batchq.sh`, the script the
queue's `bq submit` would take; nothing is ever sent.
"""

from __future__ import annotations

import re
import shlex
from typing import Annotated, Any

from pydantic import Field, field_validator
from shardctl.orchestrator.clusters.base import Cluster, DryRun, JobRef, JobStatus
from shardctl.orchestrator.doctor import Check, Preflight
from shardctl.orchestrator.errors import UsageError
from shardctl.orchestrator.launch import EnvLine, export, export_from
from shardctl.orchestrator.spec import ClusterSection, JobSpec

SCRIPT = "batchq.sh"


class BatchqSection(ClusterSection):
    """`batchq:` in a job spec."""

    queue: str | None = None
    """The queue to submit to; required to render for batchq."""
    priority: Annotated[int, Field(ge=0, le=9, strict=True)] = 5
    max_nodes: Annotated[int, Field(gt=0, strict=True)] = 4
    """The most nodes the queue gives one job."""

    @field_validator("queue")
    @classmethod
    def _queue(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"[a-z][a-z0-9-]*", v):
            raise ValueError(f"{v!r} is not a queue name; accepted: lower-case words, e.g. 'gpu'")
        return v

    def spec_problems(self, spec: Any) -> list[str]:
        nodes = spec.resources.nodes
        if nodes > self.max_nodes:
            return [f"resources.nodes ({nodes}) is more than batchq.max_nodes ({self.max_nodes})"]
        return []

    def run_problems(self, spec: Any) -> list[str]:
        if self.queue is None:
            return ["batchq.queue is required for --cluster batchq; e.g. batchq.queue: gpu"]
        return []


class BatchqCluster(Cluster):
    name = "batchq"
    spec_section = BatchqSection
    next_step = "submit it by hand: bq submit {out}/" + SCRIPT
    no_preemption_budget = "batchq never preempts"

    def runtime_env(self, spec: JobSpec) -> list[EnvLine]:
        why = "run this script under bq"
        return [
            export("SHARDCTL_NNODES", str(spec.resources.nodes)),
            export_from("SHARDCTL_NODE_RANK", "BQ_NODE_INDEX", why),
            export("SHARDCTL_NPROC_PER_NODE", str(spec.resources.procs_per_node)),
            export_from("MASTER_ADDR", "BQ_FIRST_HOST", why),
            export("MASTER_PORT", "29400"),
        ]

    def own_artifacts(self, node: Any, common: dict[str, str]) -> dict[str, str]:
        q = node.spec.batchq
        return {
            SCRIPT: "#!/bin/bash\n"
            f"#BQ queue={q.queue} priority={q.priority} nodes={node.spec.resources.nodes}\n"
            'exec bash "$(dirname "$0")/launch.sh"\n'
        }

    def dryrun(self, spec: JobSpec) -> DryRun:
        files = self.artifacts(spec)  # checks the spec first (the section's run_problems)
        argv = ["bq", "submit", SCRIPT]
        return DryRun(self.name, spec, files, argv, f"# {shlex.join(argv)}\n{files[SCRIPT]}")

    def preflight(self, spec: JobSpec) -> Preflight:
        return Preflight([Check("queue", "ok", f"{spec.batchq.queue} (not asked: an example)")])

    def schedule(self, dryrun: DryRun) -> JobRef:
        raise UsageError("batchq is an example: it submits nothing")

    def status(self, ref: JobRef) -> JobStatus:
        raise UsageError("batchq is an example: it has no jobs")

    def logs(self, ref: JobRef, tail: int | None = None) -> str:
        raise UsageError("batchq is an example: it has no jobs")

    def cancel(self, ref: JobRef) -> None:
        raise UsageError("batchq is an example: it has no jobs")

"""The one exception hierarchy of shardctl.

Library code raises these; only `cli.py` turns them into messages and exit codes.
Every message names the field (or thing), the bad value and what would be accepted.
"""

from __future__ import annotations


class ShardctlError(Exception):
    """Base of every error shardctl raises on purpose."""

    exit_code = 1


class SpecError(ShardctlError):
    """The job spec (or another user-supplied config) is invalid."""

    exit_code = 2

    def __init__(self, problems: list[str], source: str | None = None) -> None:
        self.problems = problems
        self.source = source
        where = f"{source}: " if source else ""
        if len(problems) == 1:
            text = f"{where}invalid job spec: {problems[0]}"
        else:
            lines = "\n".join(f"  - {p}" for p in problems)
            text = f"{where}invalid job spec ({len(problems)} problems):\n{lines}"
        super().__init__(text)


class UsageError(ShardctlError):
    """A command was called with arguments that cannot work together."""

    exit_code = 2


class RenderError(ShardctlError):
    """A template could not be rendered (a bug in shardctl, never in the spec)."""


class ClusterError(ShardctlError):
    """The cluster refused or failed an operation (submit, status, cancel ...)."""


class JobNotFoundError(ClusterError):
    """No job with that name or id is known."""


class CheckpointError(ShardctlError):
    """A checkpoint is missing, incomplete or corrupt."""


class MissingDependencyError(ShardctlError):
    """An optional dependency (torch, submitit, kubernetes ...) is not installed."""

    def __init__(self, package: str, extra: str, purpose: str) -> None:
        super().__init__(
            f"{purpose} needs the Python package {package!r}, which is not installed; "
            f"install it with: pip install 'shardctl[{extra}]'"
        )

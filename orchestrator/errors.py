"""The one exception hierarchy of shardctl.

Library code raises these; only `cli.py` turns them into messages and exit codes.
Every message names the field (or thing), the bad value and what would be accepted.
"""

from __future__ import annotations


class ShardctlError(Exception):
    """Base of every error shardctl raises on purpose."""

    exit_code = 1


class SpecError(ShardctlError):
    """The job spec (or another user-supplied config) is invalid.

    Each problem is one line that names the field, shows the bad value once (through
    `show_value`, cut to a readable length) and says what is accepted. A spec with
    thousands of problems prints the first `MAX_PROBLEMS` and a count of the rest.
    """

    exit_code = 2
    MAX_PROBLEMS = 20
    # A value longer than this is cut: one bad 10 MB string must not print 10 MB.
    MAX_VALUE_CHARS = 80
    # The last guard for text shardctl did not quote itself (a YAML parser's message,
    # an OS error naming a path): no single line of the report grows past this.
    MAX_LINE_CHARS = 1000

    def __init__(
        self, problems: list[str], source: str | None = None, kind: str = "job spec"
    ) -> None:
        self.problems = problems
        self.source = source
        self.kind = kind
        where = f"{self.show_text(source, self.MAX_LINE_CHARS)}: " if source else ""
        shown = [self.show_text(p, self.MAX_LINE_CHARS) for p in problems[: self.MAX_PROBLEMS]]
        if len(problems) > self.MAX_PROBLEMS:
            shown.append(f"... and {len(problems) - self.MAX_PROBLEMS} more")
        if len(problems) == 1:
            text = f"{where}invalid {kind}: {shown[0]}"
        else:
            lines = "\n".join(f"  - {p}" for p in shown)
            text = f"{where}invalid {kind} ({len(problems)} problems):\n{lines}"
        ShardctlError.__init__(self, text)

    @classmethod
    def show_value(cls, value: object) -> str:
        """A bad value as an error message shows it: its repr, cut to a readable length."""
        if isinstance(value, str | bytes) and len(value) > cls.MAX_VALUE_CHARS:
            # Cut the value, not its repr, so the quotes stay and the count is the user's.
            return f"{value[: cls.MAX_VALUE_CHARS]!r}… ({len(value)} characters)"
        try:
            return cls.show_text(repr(value))
        except ValueError:
            # An int past sys.get_int_max_str_digits() has no repr (e.g. one written in hex).
            digits = int(value.bit_length() * 0.30103) + 1 if isinstance(value, int) else 0
            return f"an integer of about {digits} digits"

    @classmethod
    def show_text(cls, text: str, limit: int | None = None) -> str:
        """Text cut at `limit` characters (default `MAX_VALUE_CHARS`), saying how long it was."""
        limit = limit or cls.MAX_VALUE_CHARS
        if len(text) <= limit:
            return text
        return f"{text[:limit]}… ({len(text)} characters)"


class PermanentError(ShardctlError):
    """An input every retry would repeat (a corpus shorter than one sequence, a wrap
    class the model does not have, no GPU for `device: cuda`): the built-in loop ends
    with exit 78 (`rundir.EXIT_DO_NOT_RETRY`), which no supervisor retries."""

    exit_code = 78  # rundir.EXIT_DO_NOT_RETRY (errors.py imports nothing; a test checks)


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


class CorruptCheckpointError(CheckpointError):
    """A checkpoint's files do not match its manifest (a size or a sha256); `problems`
    names each file with what the manifest expects and what was found."""

    def __init__(self, message: str, problems: list[str]) -> None:
        super().__init__(message)
        self.problems = problems


class StorageError(ShardctlError):
    """A write failed because its file system is full, over quota, read-only or refuses
    the file's size; the message names the path (and the free and needed bytes)."""


class ObjectStoreError(ShardctlError):
    """An object store (S3) refused or failed an operation: one line naming the `s3://`
    URL and what failed (an endpoint not reached, credentials refused, a missing bucket,
    no permission, a transfer cut off after its retries), never a secret."""


class ObjectUrlError(ObjectStoreError):
    """An `s3://BUCKET/PREFIX` URL that cannot name an object: the message shows the URL,
    what is wrong with it and the form accepted."""

    exit_code = 2


class MissingDependencyError(ShardctlError):
    """An optional dependency (torch, submitit, kubernetes ...) is not installed."""

    def __init__(self, package: str, extra: str, purpose: str) -> None:
        super().__init__(
            f"{purpose} needs the Python package {package!r}, which is not installed; "
            f"install it with: pip install 'shardctl[{extra}]'"
        )


class ConfigError(SpecError):
    """A launcher config given to shardctl (an accelerate config, a DeepSpeed JSON) is invalid.

    The twin of `SpecError` for files that are not job specs, with the same layout
    and cuts: the message says what the input is ("invalid accelerate config"), so a
    user does not hunt for a job spec.
    """

    def __init__(
        self, problems: list[str], source: str | None = None, kind: str = "config"
    ) -> None:
        super().__init__(problems, source, kind)

"""shardctl.orchestrator: the job spec, rendering, cluster backends and the CLI.

Nothing here imports torch, deepspeed, kubernetes or submitit at import time:
`shardctl render`, `validate` and `--help` must start in well under a second.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("shardctl")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"

"""`python -m shardctl.orchestrator.cli`: the same as the `shardctl` command."""

from . import main

main()

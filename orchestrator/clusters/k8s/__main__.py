"""`python -m shardctl.orchestrator.clusters.k8s -- LAUNCHER [ARGS...]`: the node agent
of a Kubernetes pod (`node_agent.py`), what the rendered launch script execs."""

from __future__ import annotations

import sys

from .node_agent import main

if __name__ == "__main__":
    sys.exit(main())

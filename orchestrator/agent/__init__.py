"""The node agent: one module on every node of every cluster between the cluster and
the launcher (`core.NodeAgent`), and what each cluster tells it (`adapter.Adapter`).

Torch-free; imports no cluster module (each cluster package imports the agent).
"""

from __future__ import annotations

from .adapter import Adapter
from .core import RESTARTED, NodeAgent, say

__all__ = ["RESTARTED", "Adapter", "NodeAgent", "say"]

"""The job spec of a test that drives a `CheckpointManager` by hand: only its strategy
and checkpoint sections are read (the model factory is a placeholder nothing imports).

Importable as `helpers.ckpt_spec` from a test and as `ckpt_spec` from a helper run as
a script (its folder is then first on `sys.path`).
"""

from __future__ import annotations

from typing import Any

from shardctl.orchestrator.spec import JobSpec, parse_spec

FSDP_FP32: dict[str, Any] = {"backend": "fsdp", "precision": "fp32"}


def checkpoint_spec(
    checkpoint: dict[str, Any],
    *,
    name: str = "unit",
    strategy: dict[str, Any] | None = None,
    steps: int = 100,
    **top: Any,
) -> JobSpec:
    """A spec with this `checkpoint` section and `strategy` (default: FSDP in fp32);
    `top` adds other top-level keys (a run_dir)."""
    return parse_spec(
        {
            "name": name,
            **top,
            "strategy": strategy or FSDP_FP32,
            "train": {
                "model": {"factory": "pkg.mod:fn"},
                "data": {"builtin": "python-stdlib"},
                "steps": steps,
            },
            "checkpoint": checkpoint,
        }
    )

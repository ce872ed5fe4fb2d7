"""The bytes `shardctl convert` writes: the accelerate YAML, the DeepSpeed JSON, the report."""

from __future__ import annotations

import json
from typing import Any

import yaml

from .plan import Conversion


def render_yaml(config: dict[str, Any]) -> str:
    # Sorted keys: the same input always gives the same bytes, whatever order it had.
    return yaml.safe_dump(config, sort_keys=True, default_flow_style=False)


def render_ds_json(ds: dict[str, Any]) -> str:
    return json.dumps(ds, indent=2, sort_keys=True) + "\n"


def report_lines(result: Conversion) -> list[str]:
    """The human report (stderr in text mode): every note, then the spec's new strategy."""
    lines = [f"note: {note}" for note in result.notes]
    if result.spec_strategy is not None:
        # Insertion order on purpose: backend first, as a user would write the section.
        strategy = json.dumps(result.spec_strategy, sort_keys=False)
        lines.append(f"in the job spec, this backend is: strategy: {strategy}")
    return lines


def json_document(result: Conversion, written: list[str]) -> str:
    """The whole result as one JSON document (`--output json`)."""
    return json.dumps({**result.to_json(), "written": written}, indent=2, sort_keys=True)

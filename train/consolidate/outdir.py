"""What a consolidation writes into its output folder — and so what it did not.

A model folder holding only these names is one `consolidate` wrote (the run's own
`consolidate_on_finish`, or the command); anything else in it is a user's, which a
run never deletes. Torch-free: the loop's rank 0 and the CLI ask before any reading.
"""

from __future__ import annotations

import re
from pathlib import Path

from .safetensors_out import INDEX_FILE, SINGLE_FILE

CONFIG_FILES = ("config.json", "generation_config.json")
_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
_SHOWN = 5  # names listed in a message; the rest are counted


def written_by_consolidate(name: str) -> bool:
    """Whether `name` is a file a consolidation writes (weights, index or config)."""
    return name in (SINGLE_FILE, INDEX_FILE, *CONFIG_FILES) or bool(_SHARD.fullmatch(name))


def foreign_entries(folder: Path) -> list[str]:
    """The entries of `folder` that no consolidation wrote, sorted; [] when it is
    missing, empty or holds only a consolidated model. `folder` itself when it is not a
    plain folder (a file, or a link: replacing it could reach what it points to)."""
    if not (folder.exists() or folder.is_symlink()):
        return []
    if folder.is_symlink() or not folder.is_dir():
        return [folder.name]
    return sorted(
        entry.name
        for entry in folder.iterdir()
        if entry.is_symlink() or not entry.is_file() or not written_by_consolidate(entry.name)
    )


def shown(names: list[str]) -> str:
    """`a, b, c` — at most a few names, then how many more."""
    more = len(names) - _SHOWN
    return ", ".join(names[:_SHOWN]) + (f" and {more} more" if more > 0 else "")

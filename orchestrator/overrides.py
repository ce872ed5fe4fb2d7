"""`--set KEY.PATH=VALUE`: change fields of a job spec from the command line.

Each assignment is applied to the file's data before validation, so an override is
checked exactly like the file (unknown keys with a did-you-mean, ranges, types) and
the rendered `job.yaml` records the result. The value is YAML, as it would be in the
file: `--set train.lr=0.0003`, `--set k8s.labels={team: nlp}`, `--set k8s.pvc=` (null).

Paths: dotted keys (`train.model.llama.hidden_size`), list items by index
(`k8s.tolerations[0].key`; the index just past the end appends), and keys that hold
dots or slashes in quotes (`k8s.labels["kueue.x-k8s.io/queue-name"]=team-a`).
A sweep is a shell loop: `for lr in 1e-4 3e-4; do shardctl submit job.yaml --set
name=lr-$lr --set train.lr=$lr; done`.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Sequence
from typing import Any

from .errors import SpecError
from .yamlio import parse_yaml_text

_show = SpecError.show_value
_KEY = re.compile(r"[A-Za-z0-9_-]+")
_INDEX = re.compile(r"\[(\d+)\]")
_QUOTED = re.compile(r"""\[(["'])(.+?)\1\]""")
MAX_ASSIGNMENTS = 1000


def parse_path(text: str) -> list[str | int]:
    """`a.b[0]["c.d"]` → ["a", "b", 0, "c.d"]; SpecError naming what is wrong."""
    steps: list[str | int] = []
    pos = 0
    while pos < len(text):
        m: re.Match[str] | None
        if text[pos] == "[":
            m = _INDEX.match(text, pos) or _QUOTED.match(text, pos)
            if m is not None:
                steps.append(int(m.group(1)) if m.re is _INDEX else m.group(2))
        else:
            start = pos + 1 if (text[pos] == "." and pos > 0) else pos
            m = _KEY.match(text, start) if (pos == 0) != (text[pos] == ".") else None
            if m is not None:
                steps.append(m.group(0))
        if m is None:
            raise SpecError(
                [
                    f"--set {_show(text)}: cannot read the key path at character {pos + 1}; "
                    "accepted: dotted keys (train.lr), list indices (k8s.tolerations[0]) and "
                    'quoted keys (k8s.labels["kueue.x-k8s.io/queue-name"])'
                ]
            )
        pos = m.end()
    if not steps:
        raise SpecError(
            ["--set: the key path is empty; accepted: KEY.PATH=VALUE, e.g. train.lr=0.0003"]
        )
    return steps


def _where(steps: Sequence[str | int]) -> str:
    out = ""
    for step in steps:
        if isinstance(step, int):
            out += f"[{step}]"
        elif re.fullmatch(r"[A-Za-z0-9_-]+", step):
            out += f".{step}" if out else step
        else:
            out += f'["{step}"]'
    return out


def apply_overrides(data: Any, assignments: Sequence[str]) -> Any:
    """The spec's data with every `KEY.PATH=VALUE` applied, in order (a copy)."""
    if not assignments:
        return data
    if len(assignments) > MAX_ASSIGNMENTS:
        raise SpecError(
            [f"--set given {len(assignments)} times; accepted: at most {MAX_ASSIGNMENTS}"]
        )
    if data is None:  # an empty file: the overrides may be the whole spec
        data = {}
    if not isinstance(data, dict):
        return data  # parse_spec says what the top level must be
    data = copy.deepcopy(data)
    for text in assignments:
        key, sep, raw = text.partition("=")
        if not sep or not key.strip():
            raise SpecError(
                [f"--set {_show(text)}: expected KEY.PATH=VALUE, e.g. --set train.lr=0.0003"]
            )
        steps = parse_path(key.strip())
        value = parse_yaml_text(raw, source=f"--set {key.strip()}") if raw.strip() else None
        _assign(data, steps, value, text)
    return data


def _assign(data: dict[str, Any], steps: list[str | int], value: Any, text: str) -> None:
    node: Any = data
    for i, step in enumerate(steps):
        last = i == len(steps) - 1
        here = _where(steps[: i + 1])
        if isinstance(step, int):
            if not isinstance(node, list):
                raise SpecError(
                    [f"--set {_show(text)}: {_where(steps[:i]) or 'the spec'} is "
                     f"{_kind(node)}, not a list; [{step}] indexes lists only"]
                )  # fmt: skip
            if step > len(node):
                raise SpecError(
                    [f"--set {_show(text)}: {here} is past the end of a list of {len(node)} "
                     f"item(s); accepted: an index up to {len(node)} (that one appends)"]
                )  # fmt: skip
            if step == len(node):
                node.append({} if not last else None)
        else:
            if not isinstance(node, dict):
                raise SpecError(
                    [f"--set {_show(text)}: {_where(steps[:i])} is {_kind(node)}, not a "
                     f"mapping, so it has no key {step!r}"]
                )  # fmt: skip
            if not last and node.get(step) is None:
                # A section the file leaves out (or sets to null) is created.
                node[step] = [] if isinstance(steps[i + 1], int) else {}
        if last:
            node[step] = value
        else:
            node = node[step]


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    return f"{_show(value)} ({type(value).__name__})"

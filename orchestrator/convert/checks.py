"""Value checks for what `convert` reads: each failure names the key, the value and what
is accepted.

An `Origin` says where the values come from (the file, or `<stdin>`) and what kind of
file that is, so an error about an accelerate config says "invalid accelerate config"
and one about a DeepSpeed JSON says so, never "invalid job spec".
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, NoReturn

from ..errors import ConfigError

ACCELERATE = "accelerate config"
DEEPSPEED_JSON = "DeepSpeed JSON config"
# Before detection the input may still be either kind.
UNKNOWN = "accelerate config or job spec"


@dataclass(frozen=True)
class Origin:
    """The file (or `<stdin>`) the values come from, and what kind of config it is."""

    source: str | None = None
    kind: str = ACCELERATE

    def fail(self, problem: str) -> NoReturn:
        raise ConfigError([problem], self.source, self.kind)


def check_keys(cfg: dict[str, Any], allowed: Iterable[str], where: str, origin: Origin) -> None:
    allowed = frozenset(allowed)
    for key in cfg:
        if key not in allowed:
            hint = difflib.get_close_matches(str(key), allowed, n=1, cutoff=0.6)
            did_you_mean = f"; did you mean {hint[0]!r}?" if hint else ""
            origin.fail(
                f"unknown key {key!r} in {where}{did_you_mean} "
                f"(accepted: {', '.join(sorted(allowed))})"
            )


def as_bool(value: Any, where: str, origin: Origin) -> bool:
    if isinstance(value, bool):
        return value
    # accelerate's own questionnaire writes yes/no strings in places.
    text = str(value).strip().lower()
    if text in ("y", "yes", "t", "true", "on", "1"):
        return True
    if text in ("n", "no", "f", "false", "off", "0"):
        return False
    origin.fail(f"{where} {value!r} is not a boolean; accepted: true, false")


def optional_bool(
    mapping: dict[str, Any], key: str, section: str, origin: Origin, absent: bool | None
) -> bool | None:
    """`mapping[key]` as a boolean (named `section.key` in an error), or `absent` (what
    the plan holds already) when the key is not there: an absent key changes nothing."""
    if key not in mapping:
        return absent
    return as_bool(mapping[key], f"{section}.{key}", origin)


def as_int(value: Any, where: str, origin: Origin, accepted: tuple[int, ...] | None = None) -> int:
    ok = isinstance(value, int) and not isinstance(value, bool)
    if not ok and isinstance(value, str) and value.strip().isdigit():
        value, ok = int(value), True
    if (
        not ok
        or (accepted is not None and value not in accepted)
        or (accepted is None and value < 0)
    ):
        want = ", ".join(map(str, accepted)) if accepted else "a non-negative integer"
        origin.fail(f"{where} {value!r} is not valid; accepted: {want}")
    return int(value)


def as_choice(
    value: Any, where: str, origin: Origin, accepted: tuple[str, ...], upper: bool = True
) -> str:
    text = str(value)
    norm = text.upper() if upper else text.lower()
    if norm not in accepted:
        origin.fail(f"{where} {value!r} is not valid; accepted: {', '.join(accepted)}")
    return norm


def auto_or(value: Any, where: str, origin: Origin, kind: type) -> Any:
    """`value` unchanged when None or 'auto', else as a positive `kind` number."""
    if value is None or value == "auto":
        return value
    try:
        number = kind(value)
    except (TypeError, ValueError):
        number = None
    if number is None or isinstance(value, bool) or number < 0 or (kind is int and number < 1):
        origin.fail(f"{where} {value!r} is not valid; accepted: 'auto' or a positive number")
    return number

"""Value checks for what `convert` reads: each failure names the key, the value and what
is accepted.

An `Origin` says where the values come from (the file, or `<stdin>`) and what kind of
file that is, so an error about an accelerate config says "invalid accelerate config"
and one about a DeepSpeed JSON says so, never "invalid job spec".
"""

from __future__ import annotations

import difflib
import re
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


# The job spec's bounds (spec/common.py), repeated here because convert reads an
# accelerate config without pydantic; tests/test_convert_config_bounds.py keeps them equal.
MAX_NODES = 100_000
MAX_PROCS_PER_NODE = 1024
MAX_BATCH = 65_536  # gradient_accumulation_steps
MAX_CLIP = 1e6  # gradient_clipping
MAX_PROCESSES = MAX_NODES * MAX_PROCS_PER_NODE
MAX_INT = 2**63 - 1  # what any count or size can be: a 64-bit integer
MAX_PORT = 65_535

# The most `auto_or` accepts, by the key's own name (the section it sits in aside).
_DECIMAL = re.compile(r"[0-9]+(\.[0-9]*)?([eE][+-]?[0-9]+)?")
_AUTO_OR_MOST = {"gradient_accumulation_steps": MAX_BATCH, "gradient_clipping": MAX_CLIP}


def _whole(value: Any) -> int | None:
    """`value` as an int when it is one (or ASCII digits, which accelerate's
    questionnaire may quote), else None: no bool, no float, no '2.5' or '\\t'."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        text = value.strip(" ")
        if text.isascii() and text.isdigit():
            return int(text)
    return None


def bounded_int(value: Any, where: str, origin: Origin, low: int, high: int) -> int:
    """`value` as an integer in low..high, or one line naming `where`, the value and
    the range."""
    number = _whole(value)
    if number is None or not low <= number <= high:
        origin.fail(f"{where} {value!r} is not valid; accepted: an integer {low}..{high}")
    return number


def as_int(value: Any, where: str, origin: Origin, accepted: tuple[int, ...] | None = None) -> int:
    number = _whole(value)
    if accepted is None:
        return bounded_int(value, where, origin, 0, MAX_INT)
    if number is None or number not in accepted:
        want = ", ".join(map(str, accepted))
        origin.fail(f"{where} {value!r} is not valid; accepted: {want}")
    return number


def as_choice(
    value: Any, where: str, origin: Origin, accepted: tuple[str, ...], upper: bool = True
) -> str:
    text = str(value)
    norm = text.upper() if upper else text.lower()
    if norm not in accepted:
        origin.fail(f"{where} {value!r} is not valid; accepted: {', '.join(accepted)}")
    return norm


def auto_or(value: Any, where: str, origin: Origin, kind: type) -> Any:
    """`value` unchanged when None or 'auto', else as a positive `kind` number (a whole
    one for int), finite and at most the key's bound in `_AUTO_OR_MOST`."""
    if value is None or value == "auto":
        return value
    most = _AUTO_OR_MOST.get(where.rsplit(".", 1)[-1], MAX_INT)
    number: Any = None
    # float() would also read ' 8\t', '1_000' and 'nan': a string must be the number alone.
    plain = not isinstance(value, str) or _DECIMAL.fullmatch(value) is not None
    if not isinstance(value, bool) and plain:
        try:
            number = float(value)
        except (TypeError, ValueError):
            number = None
    if number is not None and kind is int:
        number = int(number) if number.is_integer() and number >= 1 else None
    if number is None or not 0 <= number <= most:  # also refuses nan
        origin.fail(
            f"{where} {value!r} is not valid; accepted: 'auto' or a positive "
            f"{'whole ' if kind is int else ''}number up to {int(most)}"
        )
    return number

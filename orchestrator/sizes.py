"""Memory sizes, parsed once where the spec is read and rendered per cluster.

A spec says `memory: 64G` (Slurm's units) or `memory: 64Gi` (a Kubernetes quantity);
both mean the same amount here. `MemorySize` holds the exact number of bytes and the
text the user wrote, and renders each cluster's own notation:

    written     bytes          .slurm()   .k8s()
    64G         64 GiB         64G        64Gi
    64Gi        64 GiB         64G        64Gi
    4096        4096 MiB       4096       4096Mi     (a bare number is megabytes, as in Slurm)
    1.5Gi       1536 MiB       1536M      1.5Gi

Accepted units, all powers of 1024 (Slurm's K/M/G/T are binary, so `64G` cannot mean
Kubernetes' decimal 64·10⁹ here):

    K M G T          Slurm; a bare number is megabytes
    Ki Mi Gi Ti Pi   Kubernetes

Refused, each with a message that says why: decimal Kubernetes suffixes (`k`, `P`,
`E`) and exponents (`1e9`), whose meaning would clash with the Slurm reading of the
same letters and of bare numbers; millis (`500m`, a thousandth of a byte); anything
that is not a whole number of bytes; less than `MIN_BYTES` or more than `MAX_BYTES`.

`MemorySize` is a `str` subclass whose text is exactly what the user wrote, so the
spec dumps back to the same YAML (job.yaml stays byte-identical) and code that still
treats the field as text keeps working; the parsed amount is `.bytes`.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

import yaml

from .errors import SpecError

KIB = 1024
MIB = 1024**2
GIB = 1024**3
TIB = 1024**4
PIB = 1024**5

# Below one MiB no process runs, and Slurm's --mem counts whole megabytes: a smaller
# value is a slip of the unit (`512K` for `512M`), not a plan.
MIN_BYTES = MIB
# No machine has a petabyte of memory per node (the largest hold tens of TiB); a
# bigger value is a typo, and would overflow some schedulers' 64-bit KiB counters.
MAX_BYTES = PIB

_UNITS: dict[str, int] = {
    "": MIB,  # Slurm: a bare number is megabytes
    "K": KIB,
    "M": MIB,
    "G": GIB,
    "T": TIB,
    "Ki": KIB,
    "Mi": MIB,
    "Gi": GIB,
    "Ti": TIB,
    "Pi": PIB,
}
_SIZE_RE = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(Ki|Mi|Gi|Ti|Pi|K|M|G|T)?$")
# Recognised only to say why they are refused.
_DECIMAL_RE = re.compile(r"^[0-9]+(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+|k|P|E|Ei|m)$")

ACCEPTED = (
    "a number with K, M, G, T (Slurm, powers of 1024; a bare number is megabytes) "
    "or Ki, Mi, Gi, Ti, Pi (Kubernetes), e.g. '64G', '512M', '64Gi', '1.5Gi'"
)


class MemorySizeError(ValueError):
    """The text is not a memory size shardctl accepts; the message says why."""


class MemorySize(str):
    """An amount of memory: the user's text (the `str` value) and its exact `bytes`."""

    bytes: int  # set once in __new__; the instance is immutable like any str

    def __new__(cls, text: str) -> MemorySize:
        amount = _parse_bytes(text)
        self = super().__new__(cls, text)
        object.__setattr__(self, "bytes", amount)
        return self

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable")

    def __repr__(self) -> str:
        return f"MemorySize({str(self)!r})"

    @classmethod
    def parse(cls, value: Any) -> MemorySize:
        """Spec input → `MemorySize`. A YAML integer is megabytes, like a bare number."""
        if isinstance(value, MemorySize):
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            return cls(str(value))
        return cls(value)

    # -- rendering ------------------------------------------------------------------

    def slurm(self) -> str:
        """Slurm's --mem text. Slurm takes whole numbers with K/M/G/T (or bare megabytes):
        the user's text when it already is one, `Gi` → `G` and so on, and otherwise the
        largest unit that holds the amount exactly, rounded up to a whole KiB only when
        it is not a multiple of one (never less memory than asked for)."""
        number, unit = _split(self)
        if "." not in number and unit in ("", "K", "M", "G", "T"):
            return str(self)
        if "." not in number and unit in ("Ki", "Mi", "Gi", "Ti"):
            return number + unit[0]
        kib = -(-self.bytes // KIB)
        for suffix, size in (("T", TIB), ("G", GIB), ("M", MIB)):
            if kib * KIB % size == 0:
                return f"{kib * KIB // size}{suffix}"
        return f"{kib}K"

    def k8s(self) -> str:
        """A Kubernetes quantity of the same bytes: the user's text when it is one
        (`64Gi`, `1.5Gi`), Slurm's `64G` as `64Gi`, a bare number as `Mi`."""
        number, unit = _split(self)
        if unit.endswith("i"):
            return str(self)
        if "." not in number:
            return f"{number}{unit or 'M'}i"
        for suffix, size in (("Pi", PIB), ("Ti", TIB), ("Gi", GIB), ("Mi", MIB), ("Ki", KIB)):
            if self.bytes % size == 0:
                return f"{self.bytes // size}{suffix}"
        return str(self.bytes)

    # -- pydantic -------------------------------------------------------------------

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: Any) -> Any:
        # Imported here so that the type itself does not need pydantic.
        from pydantic_core import core_schema

        return core_schema.no_info_plain_validator_function(
            cls.parse,
            # Dump the user's own text: job.yaml reads back to an equal spec.
            serialization=core_schema.plain_serializer_function_ser_schema(
                str.__str__, info_arg=False, return_schema=core_schema.str_schema()
            ),
        )

    @classmethod
    def __get_pydantic_json_schema__(cls, schema: Any, handler: Any) -> dict[str, Any]:
        return {"type": ["string", "integer"], "description": f"Memory size: {ACCEPTED}"}


def _split(text: str) -> tuple[str, str]:
    m = _SIZE_RE.match(text)
    assert m is not None  # only called on text that parsed
    return m.group(1), m.group(2) or ""


def _parse_bytes(text: Any) -> int:
    shown = SpecError.show_value(text)
    if not isinstance(text, str):
        raise MemorySizeError(f"{shown} is not a memory size; accepted: {ACCEPTED}")
    m = _SIZE_RE.match(text)
    if m is None:
        if _DECIMAL_RE.match(text) and text.endswith("m"):
            raise MemorySizeError(
                f"{shown} is not a memory size: 'm' means thousandths of a byte in "
                "Kubernetes; megabytes are 'M' or 'Mi'"
            )
        if _DECIMAL_RE.match(text):
            raise MemorySizeError(
                f"{shown} is not a memory size: decimal suffixes (k, P, E) and exponents are "
                "refused because 'G' and a bare number already mean Slurm's GiB and "
                f"megabytes here; accepted: {ACCEPTED}"
            )
        raise MemorySizeError(f"{shown} is not a memory size; accepted: {ACCEPTED}")
    number, unit = m.group(1), m.group(2) or ""
    exact = Fraction(number) * _UNITS[unit]
    if exact == 0:
        raise MemorySizeError(f"{shown} is zero; accepted: at least 1Mi")
    if exact.denominator != 1:
        raise MemorySizeError(
            f"{shown} is not a whole number of bytes; accepted: whole bytes, e.g. '1.5Gi'"
        )
    amount = int(exact)
    if amount < MIN_BYTES:
        raise MemorySizeError(f"{shown} is less than 1Mi, the least shardctl accepts")
    if amount > MAX_BYTES:
        raise MemorySizeError(f"{shown} is more than 1Pi (one PiB), the most shardctl accepts")
    return amount


def _represent(dumper: yaml.SafeDumper, value: MemorySize) -> yaml.ScalarNode:
    return dumper.represent_str(str.__str__(value))


# PyYAML's safe dumper looks representers up by exact type and refuses str subclasses;
# registered here, before any dumper subclass copies the table, so that a MemorySize
# placed in rendered YAML comes out as the plain text the user wrote.
yaml.SafeDumper.add_representer(MemorySize, _represent)

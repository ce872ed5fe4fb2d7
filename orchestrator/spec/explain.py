"""Pydantic's errors as shardctl says them: one line each, naming the field, the value
and what is accepted; an unknown key with its did-you-mean."""

from __future__ import annotations

import difflib
import re
from types import SimpleNamespace
from typing import Any

from pydantic import BaseModel, ValidationError

from ..errors import SpecError
from ..yamlio import Base60Int
from .common import show, type_name

NAMED_FIELDS = ("strategy.", "checkpoint.", "launcher", "train.", "resources.", "unknown key ")


def explain(exc: ValidationError, data: Any, model: type[BaseModel]) -> list[str]:
    """Turn pydantic's errors into one line each: field, value (shown once), what is
    accepted. `model`: the spec model `data` was validated against (for the keys an
    unknown key could have meant)."""
    problems: list[str] = []
    # Messages that name their fields already (cross-field checks, a cluster's own).
    clusters = getattr(model, "cluster_sections", ())
    own_fields = (*NAMED_FIELDS, *(f"{name}." for name in clusters))
    for err, loc in _user_errors(exc, data):
        field = _dotted(loc)
        kind = err["type"]
        if kind == "extra_forbidden":
            parent, key = loc[:-1], loc[-1]
            allowed = _allowed_keys(model, parent)
            hint = difflib.get_close_matches(str(key), allowed, n=1, cutoff=0.6)
            where = _dotted(parent) or "the top level"
            did_you_mean = f"; did you mean {hint[0]!r}?" if hint else ""
            # A plain path is quoted; one holding a cut or odd key is quoted inside already.
            named = repr(field) if field.isprintable() and "'" not in field else field
            problems.append(
                f"unknown key {named} in {where}{did_you_mean} "
                f"(accepted: {', '.join(sorted(allowed))})"
            )
            continue
        if kind == "invalid_key":
            # YAML made the key a number, null or boolean (`5:`, `~:`, `yes:`).
            parent, key = loc[:-1], err.get("input", loc[-1] if loc else None)
            where = _dotted(parent) or "the top level"
            problems.append(
                f"key {show(key)} in {where} is {type_name(key)}; accepted: keys that are "
                "names (quote it if it is one)"
            )
            continue
        if kind == "missing":
            problems.append(f"{field}: required but missing")
            continue
        value = err.get("input")
        shown = show(value)
        ctx = err.get("ctx") or {}
        if kind in ("less_than_equal", "less_than") and not isinstance(value, bool):
            most = ctx.get("le", ctx.get("lt"))
            limit = "the most" if kind == "less_than_equal" else "more than the most"
            problems.append(f"{field}: {shown} is more than {most}, {limit} shardctl accepts")
            continue
        msg = err["msg"]
        ours = msg.startswith(("Value error, ", "Assertion failed, "))
        if ours:
            msg = msg.split(", ", 1)[1]
            # Cross-field checks already name their fields; one line each.
            if not loc or msg.startswith(own_fields):
                problems.extend(msg.split("\n"))
                continue
        # The value once: our own validators show it (or the bad item of a list) in
        # their sentence; pydantic's messages never do; a whole section is not printed.
        yaml_did = _yaml_did(value, loc) if _wanted_text(err) else ""
        got = "" if ours or isinstance(value, dict) else f" (got {shown}{yaml_did})"
        accepted = _int_range(model, loc) if kind in _INT_ERRORS else ""
        problems.append(f"{field or 'spec'}: {msg}{got}{accepted}")
    return problems


# How pydantic names the member of a union (or a validator around a type) inside an
# error's location: `literal['auto']`, `list[str]`, `function-after[...]`, `int`, a
# model's class name. None of them is a key the user wrote.
_PYDANTIC_TAG_RE = re.compile(
    r"[\[\]]|^(?:str|int|float|bool|bytes|list|dict|set|tuple|none|any|[a-z]+(?:-[a-z]+)+|"
    r"[A-Z]\w*)$"
)


def _user_errors(exc: ValidationError, data: Any) -> list[tuple[dict[str, Any], list[Any]]]:
    """Pydantic's errors with locations made of what the user wrote: the tags of union
    members and validators dropped (a key of the data is kept whatever it looks like),
    and a union's errors at the same place joined into one ("... or ...")."""
    out: list[tuple[dict[str, Any], list[Any]]] = []
    joined: dict[tuple[Any, ...], int] = {}  # a union's place -> its error in `out`
    for err in exc.errors(include_url=False):
        loc, tagged = _written_loc(err["loc"], data)
        if err["type"] in ("model_type", "model_attributes_type"):
            # "... or instance of Resources": a class name the user never wrote.
            err = {**err, "msg": "Input should be a valid dictionary"}
        key = tuple(loc)
        if tagged and key in joined:
            first = out[joined[key]][0]
            if err["msg"] not in first["msg"]:
                first["msg"] = f"{first['msg']}, or {_lower_first(err['msg'])}"
            continue
        if tagged:
            joined[key] = len(out)
        out.append((err, loc))
    return out


def _written_loc(loc: tuple[Any, ...], data: Any) -> tuple[list[Any], bool]:
    """`loc` without pydantic's own tags, walked along `data`; and whether one was dropped."""
    kept: list[Any] = []
    tagged = False
    node = data
    for part in loc:
        written = _written_under(node, part)
        if written is _ABSENT and isinstance(part, str) and _PYDANTIC_TAG_RE.search(part):
            tagged = True
            continue
        # A key the data lacks (a missing field) is kept as it is named.
        node = None if written is _ABSENT else written
        kept.append(part)
    return kept, tagged


_ABSENT = object()


def _written_under(node: Any, part: Any) -> Any:
    """What the user wrote at `part` of `node` (a mapping's key, a list's index)."""
    if isinstance(node, dict) and part in node:
        return node[part]
    if isinstance(node, list) and isinstance(part, int) and -len(node) <= part < len(node):
        return node[part]
    return _ABSENT


def _lower_first(msg: str) -> str:
    return msg[:1].lower() + msg[1:]


def _wanted_text(err: Any) -> bool:
    """Whether the field wanted a text or one of some words (where quoting is the fix)."""
    if err["type"] == "string_type":
        return True
    expected = (err.get("ctx") or {}).get("expected", "")
    return err["type"] == "literal_error" and "'" in str(expected)


def _yaml_did(value: Any, loc: list[Any]) -> str:
    """What YAML 1.1 made of a plain scalar the field did not want, and how to quote
    it: `wandb_mode: off` is the boolean false, `time: 10:00:00` the number 36000."""
    key = next((p for p in reversed(loc) if isinstance(p, str)), "key")
    if isinstance(value, bool):
        words, example = ("on, yes or y", "on") if value else ("off, no or n", "off")
        return (
            f"; YAML reads an unquoted {words} as the boolean {str(value).lower()}: to "
            f'mean the word, quote it, e.g. {key}: "{example}"'
        )
    if isinstance(value, Base60Int):
        return (
            f"; YAML reads an unquoted {value.text} as the base-60 number {int(value)}: to "
            f'mean the text, quote it: {key}: "{value.text}"'
        )
    return ""


def _dotted(loc: list[Any] | tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            text = key_text(part)
            out += f".{text}" if out else text
    return out


def key_text(key: Any) -> str:
    """A mapping key as part of a dotted path: as written when it is a short printable
    word, else its repr, cut to a readable length."""
    text = str(key)
    if isinstance(key, str) and text.isprintable() and len(text) <= SpecError.MAX_VALUE_CHARS:
        return text
    return show(key)


def _allowed_keys(spec_model: type[BaseModel], loc: list[Any]) -> list[str]:
    """The keys accepted at a location of the spec, by alias."""
    model = _model_in(_field_at(spec_model, loc).annotation) if loc else spec_model
    if model is None:
        return []
    return [f.alias or name for name, f in model.model_fields.items()]


def _field_at(spec_model: type[BaseModel], loc: list[Any]) -> Any:
    """The pydantic field at a location of the spec (by name or alias), or `_NO_FIELD`."""
    model: Any = spec_model
    field: Any = None
    for part in loc:
        if isinstance(part, int):
            continue
        if model is None or not hasattr(model, "model_fields"):
            return _NO_FIELD
        field = model.model_fields.get(part)
        if field is None:  # an alias
            field = next((f for f in model.model_fields.values() if f.alias == part), None)
        if field is None:
            return _NO_FIELD
        model = _model_in(field.annotation)
    return field or _NO_FIELD


_NO_FIELD = SimpleNamespace(annotation=None, metadata=())  # no field there: no bounds

# pydantic's errors for a value that is no whole number (a float, a text such as YAML
# 1.1's `1e30`): they name no bounds, so the field's own are added.
_INT_ERRORS = ("int_type", "int_parsing", "int_from_float")


def _int_range(spec_model: type[BaseModel], loc: list[Any]) -> str:
    """'; accepted: a whole number from 1 to 1024' from the field's bounds, or ''."""
    field = _field_at(spec_model, loc)
    found = list(field.metadata)
    for arg in getattr(field.annotation, "__args__", ()):  # `Steps | None`
        for meta in getattr(arg, "__metadata__", ()):
            found.extend(getattr(meta, "metadata", [meta]))
    low = next((m.gt + 1 for m in found if isinstance(getattr(m, "gt", None), int)), None)
    low = next((m.ge for m in found if isinstance(getattr(m, "ge", None), int)), low)
    high = next((m.le for m in found if isinstance(getattr(m, "le", None), int)), None)
    if low is None:
        return ""
    if high is None:
        return f"; accepted: a whole number, at least {low}"
    return f"; accepted: a whole number from {low} to {high}"


def _model_in(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = _model_in(arg)
        if found is not None:
            return found
    return None

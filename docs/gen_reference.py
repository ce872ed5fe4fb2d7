"""The job spec reference, written from the pydantic models themselves.

`spec_reference()` walks `JobSpec` (with every built-in cluster's section, as
`spec.job.spec_model` builds it) and returns one Markdown page: a section per model,
one row per field with its YAML key, type, default, bounds and the field's docstring.
Nothing here is a copy of a field: a field added to a model shows up on the next docs
build. Torch-free: it imports only the spec and the clusters' section files.

mkdocs-gen-files runs this file at build time (`mkdocs.yml`: plugins → gen-files);
`tests/test_docs.py` imports it to check the page against the models.
"""

from __future__ import annotations

import ast
import inspect
import json
import textwrap
import types
import typing
from typing import Any, Literal

import annotated_types as at
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

SPEC_PAGE = "reference/spec.md"

INTRO = """\
# Job spec reference

Every field of a job spec, generated from the models that validate it (the pydantic
models of `orchestrator/spec/` and each cluster's `section.py`) each time the
documentation is built. **type** is what YAML must give (`strict` integers: `yes` is
not 1); **default** is used when the key is left out (*required* keys have none; `—`
is unset, which some fields' meaning says is derived from others); **bounds** are
checked at validation.
A wrong value exits with code 2 and a message naming the field, the value and what is
accepted. How the fields work together: [The job spec](../guides/job-spec.md).
"""


def field_docs(model: type[BaseModel]) -> dict[str, str]:
    """The attribute docstrings (a string right after `name: type = ...`) of `model`
    and its bases, read from the source with `ast`."""
    docs: dict[str, str] = {}
    for cls in reversed(model.__mro__):
        if not (isinstance(cls, type) and issubclass(cls, BaseModel)) or cls is BaseModel:
            continue
        try:
            source = textwrap.dedent(inspect.getsource(cls))
        except (OSError, TypeError):  # a class made by create_model has no source
            continue
        body = ast.parse(source).body[0]
        assert isinstance(body, ast.ClassDef)
        for stmt, after in zip(body.body, body.body[1:], strict=False):
            if (
                isinstance(stmt, ast.AnnAssign)
                and isinstance(stmt.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[stmt.target.id] = inspect.cleandoc(after.value.value)
    return docs


def _bounds_of(metadata: list[Any]) -> list[str]:
    words = []
    for m in metadata:
        for attr, sign in (("gt", ">"), ("ge", "≥"), ("lt", "<"), ("le", "≤")):
            value = getattr(m, attr, None)
            if value is not None and isinstance(m, at.Gt | at.Ge | at.Lt | at.Le | FieldInfo):
                words.append(f"{sign} {value:,}" if isinstance(value, int) else f"{sign} {value}")
        if isinstance(m, at.MinLen):
            words.append(f"length ≥ {m.min_length}")
        if isinstance(m, at.MaxLen):
            words.append(f"length ≤ {m.max_length}")
        if getattr(m, "strict", None) is True:
            words.append("strict")
    return words


def _type_name(tp: Any, nested: dict[str, type[BaseModel]], bounds: list[str]) -> str:
    """`tp` as a reader of YAML sees it; nested models are collected into `nested`,
    bounds found inside `Annotated[...]` into `bounds`."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Annotated:
        bounds.extend(_bounds_of(list(args[1:])))
        return _type_name(args[0], nested, bounds)
    if origin is Literal:
        return " \\| ".join(f"`{json.dumps(a)}`" for a in args)
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type_name(a, nested, bounds) for a in args)
    if origin in (list, tuple, set, frozenset):
        inner = ", ".join(_type_name(a, nested, bounds) for a in args if a is not Ellipsis)
        return f"list of {inner}" if inner else "list"
    if origin is dict:
        key, value = (_type_name(a, nested, bounds) for a in args)
        return f"mapping {key} → {value}"
    if tp is type(None):
        return "null"
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        nested.setdefault(tp.__name__, tp)
        return f"[{tp.__name__}](#{tp.__name__.lower()})"
    names = {str: "string", int: "integer", float: "number", bool: "boolean", Any: "any"}
    if tp in names:
        return names[tp]
    if getattr(tp, "__name__", "") == "MemorySize":
        return "memory size (`64G`, `64Gi`)"
    return f"`{getattr(tp, '__name__', str(tp))}`"


def _default(info: FieldInfo) -> str:
    if info.is_required():
        return "*required*"
    if info.default_factory is not None:
        value = info.default_factory()  # type: ignore[call-arg]
        if isinstance(value, BaseModel):
            return "its fields' defaults"
    else:
        value = info.default
    if value is None:
        return "—"
    if value is PydanticUndefined:
        return "*required*"
    return f"`{json.dumps(value, default=str)}`"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def model_rows(model: type[BaseModel], nested: dict[str, type[BaseModel]]) -> list[str]:
    docs = field_docs(model)
    rows = ["| key | type | default | bounds | meaning |", "|---|---|---|---|---|"]
    for name, info in model.model_fields.items():
        bounds = _bounds_of(info.metadata)
        own: dict[str, type[BaseModel]] = {}
        type_text = _type_name(info.annotation, own, bounds)
        for sub_name, sub in own.items():
            nested.setdefault(sub_name, sub)
        key = info.alias or name
        # A section without a docstring of its own (a cluster's, added by create_model)
        # is described by its model's first paragraph.
        first = [inspect.cleandoc(s.__doc__ or "").split("\n\n")[0] for s in own.values()]
        doc = docs.get(name) or info.description or (first[0] if len(first) == 1 else "")
        bound_text = ", ".join(dict.fromkeys(bounds)) or ""
        rows.append(f"| `{key}` | {type_text} | {_default(info)} | {bound_text} | {_cell(doc)} |")
    return rows


def spec_reference() -> str:
    """The whole page: `JobSpec`, then every model it reaches, in the order met."""
    from shardctl.orchestrator.spec.job import spec_model

    job = spec_model()
    out = [INTRO]
    nested: dict[str, type[BaseModel]] = {}
    done: set[str] = set()
    queue: list[tuple[str, type[BaseModel]]] = [("JobSpec", job)]
    while queue:
        title, model = queue.pop(0)
        if title in done:
            continue
        done.add(title)
        found: dict[str, type[BaseModel]] = {}
        rows = model_rows(model, found)
        key = "the top level of the file" if title == "JobSpec" else _where(title, job)
        doc = inspect.cleandoc(model.__doc__ or "")
        out += [f"## {title}", "", f"*{key}*", "", doc, "", *rows, ""]
        for name, sub in found.items():
            if name not in done and name not in nested:
                nested[name] = sub
                queue.append((name, sub))
    return "\n".join(out).rstrip() + "\n"


def _where(title: str, job: type[BaseModel]) -> str:
    """The YAML keys a model is found under (`strategy`, `train.model`, ...)."""
    paths: list[str] = []

    def walk(model: type[BaseModel], prefix: str, seen: tuple[type, ...]) -> None:
        for name, info in model.model_fields.items():
            found: dict[str, type[BaseModel]] = {}
            _type_name(info.annotation, found, [])
            key = f"{prefix}{info.alias or name}"
            for sub in found.values():
                if sub.__name__ == title:
                    paths.append(key)
                if sub not in seen:
                    walk(sub, key + ".", (*seen, sub))

    walk(job, "", (job,))
    shown = ", ".join(f"`{p}`" for p in dict.fromkeys(paths))
    return f"under {shown}" if shown else ""


def write_pages() -> None:
    """What mkdocs-gen-files runs: the generated pages into the site being built."""
    import mkdocs_gen_files

    with mkdocs_gen_files.open(SPEC_PAGE, "w") as page:
        page.write(spec_reference())


if __name__ in ("__main__", "<run_path>"):  # `<run_path>`: mkdocs-gen-files' runpy
    if __name__ == "__main__":
        print(spec_reference())
    else:
        write_pages()

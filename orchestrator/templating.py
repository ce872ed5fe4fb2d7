"""The one Jinja environment of shardctl: strict, deterministic, no escaping.

Templates (package `shardctl.templates`) only lay out values that Python has
already decided and quoted; a variable a template uses but the caller did not
pass is a bug in shardctl, so it raises `RenderError` naming the template.
"""

from __future__ import annotations

import functools
from typing import Any

import jinja2

from .errors import RenderError


@functools.cache
def environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.PackageLoader("shardctl.templates", "."),
        undefined=jinja2.StrictUndefined,
        # Shell, YAML and hostfiles are not HTML: escaping would corrupt them.
        autoescape=False,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
    )


def render_template(name: str, **values: Any) -> str:
    """Render template `name` with exactly `values`; missing ones raise RenderError."""
    try:
        template = environment().get_template(name)
        return template.render(**values)
    except jinja2.TemplateNotFound as exc:
        raise RenderError(f"template {name!r} is missing from shardctl.templates") from exc
    except jinja2.UndefinedError as exc:
        raise RenderError(f"template {name!r}: {exc.message}") from exc
    except jinja2.TemplateError as exc:
        raise RenderError(f"template {name!r}: {exc}") from exc

"""Pydantic's validation errors as one line per field, `field: problem. Fix: ...`, in the config's own dotted names."""

from __future__ import annotations

import difflib
import typing
from typing import Any

from pydantic import BaseModel, ValidationError

from influence_core.errors import ConfigError

BOUNDS = {"greater_than_equal": ("ge", "{} or more"), "greater_than": ("gt", "above {}"), "less_than_equal": ("le", "{} or less"), "less_than": ("lt", "below {}")}


def validation_lines(exc: ValidationError, model: type[BaseModel]) -> list[str]:
    """One line per error; values are never echoed (an endpoint URL may hold a credential)."""
    return [_line(err, model) for err in exc.errors()]


def _line(err: Any, model: type[BaseModel]) -> str:
    cause = (err.get("ctx") or {}).get("error")
    if isinstance(cause, ConfigError):  # a validator that already knows the field and the fix
        return str(cause)
    path, section = _walk(model, [str(part) for part in err["loc"]])
    field = ".".join(path) or "(top level)"
    return f"{field}: {err['msg']}. Fix: {_fix(err, field, path, section)}"


def _walk(model: type[BaseModel], loc: list[str]) -> tuple[list[str], type[BaseModel] | None]:
    """The dotted path as written in a config (a method's tag dropped), and the model that holds its last part."""
    path: list[str] = []
    current: type[BaseModel] | None = model
    parts = iter(loc)
    for part in parts:
        path.append(part)
        holder = current
        field = current.model_fields.get(part) if current else None
        current = None
        if field is not None:
            members = [a for a in typing.get_args(field.annotation) or (field.annotation,) if isinstance(a, type) and issubclass(a, BaseModel)]
            if len(members) == 1:
                current = members[0]
            elif members:  # a union tagged by `name`: pydantic puts the tag in the location
                tag = next(parts, None)
                current = next((m for m in members if m.model_fields["name"].default == tag), None)
        if current is None:
            return path + list(parts), holder
    return path, current


def _fix(err: Any, field: str, path: list[str], section: type[BaseModel] | None) -> str:
    kind, ctx = err["type"], err.get("ctx") or {}
    if kind == "extra_forbidden" and section is not None:
        allowed = list(section.model_fields)
        close = difflib.get_close_matches(path[-1], allowed, n=1)
        where = ".".join(path[:-1]) or "the top level"
        if "name" in section.model_fields and len(path) > 1:  # one member of a tagged union: say which
            where += f" (name={section.model_fields['name'].default})"
        return (f"did you mean {close[0]!r}? " if close else f"remove {path[-1]!r}; ") + f"{where} takes {', '.join(allowed)}"
    if kind in BOUNDS and BOUNDS[kind][0] in ctx:
        key, phrase = BOUNDS[kind]
        return f"set {field} to " + phrase.format(ctx[key])
    if kind in ("union_tag_invalid", "enum", "literal_error"):
        return f"set {field} to one of the values listed"
    if kind == "missing":
        return f"set {field}"
    return f"give {field} a valid value (see README, Parameters)"

"""Pydantic's validation errors as one line per field, `field: problem. Fix: ...`, in the config's own dotted names."""

from __future__ import annotations

import difflib
import typing
from typing import Any

from pydantic import BaseModel, ValidationError

from influence_core.errors import ConfigError

BOUNDS = {"greater_than_equal": ("ge", "{} or more"), "greater_than": ("gt", "above {}"), "less_than_equal": ("le", "{} or less"), "less_than": ("lt", "below {}")}


WRONG_TYPE = ("_type", "_parsing")  # error kinds that only say the value is not of one union member's type


def validation_lines(exc: ValidationError, model: type[BaseModel], names: dict[str, str] | None = None) -> list[str]:
    """One line per error; values are never echoed (an endpoint URL may hold a credential). `names` renames fields
    as the user wrote them (a CLI's flags: `search.nprobe` is `--nprobe`)."""
    return [_line(err, model, names or {}) for err in _one_per_field([{**err, "loc": _without_union_members(err["loc"])} for err in exc.errors()])]


def _without_union_members(loc: tuple[Any, ...]) -> tuple[Any, ...]:
    """Pydantic names the member of a plain union it tried (`constrained-float`, `dict[str,constrained-float]`):
    internal type names, never part of what a user writes."""
    return tuple(part for part in loc if not (isinstance(part, str) and ("[" in part or part.startswith("constrained-") or part in ("float", "int", "str", "bool"))))


def _one_per_field(errors: list[Any]) -> list[Any]:
    """A value tried against each member of a union fails each: keep the failure of the member it was meant for (the
    one that is not a mere type mismatch), or, when every member failed on type, the first."""
    kept: list[Any] = []
    for err in errors:
        rivals = [other for other in errors if other is not err and _same_field(other["loc"], err["loc"])]
        if not rivals:
            kept.append(err)
        elif err["type"].endswith(WRONG_TYPE):
            if all(other["type"].endswith(WRONG_TYPE) for other in rivals) and not any(_same_field(k["loc"], err["loc"]) for k in kept):
                kept.append(err)
        else:
            kept.append(err)
    return kept


def _same_field(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    """One location lies within the other (a dict member's key is within its field)."""
    return a[: len(b)] == b or b[: len(a)] == a


def _line(err: Any, model: type[BaseModel], names: dict[str, str]) -> str:
    cause = (err.get("ctx") or {}).get("error")
    if isinstance(cause, ConfigError):  # a validator that already knows the field and the fix
        return f"{names.get(cause.field, cause.field)}: {cause.problem}. Fix: {cause.fix}"
    path, section, members = _walk(model, [str(part) for part in err["loc"]])
    field = names.get(".".join(path), ".".join(path) or "(top level)")
    return f"{field}: {err['msg']}. Fix: {_fix(err, field, path, section, members)}"


def _walk(model: type[BaseModel], loc: list[str]) -> tuple[list[str], type[BaseModel] | None, list[type[BaseModel]]]:
    """The dotted path as written in a config (a method's or dataset's tag dropped), the model that holds its last
    part, and that model's rivals when it is one member of a tagged union."""
    path: list[str] = []
    members: list[type[BaseModel]] = []
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
            elif members:  # a tagged union (method by `name`, dataset by `source`): pydantic puts the tag in the location
                tag = next(parts, None)
                current = next((m for m in members if (_tag(m) or ("", None))[1] == tag), None)
        if current is None:
            return path + list(parts), holder, members if holder in members else []
    return path, current, members if current in members else []


def _tag(member: type[BaseModel]) -> tuple[str, Any] | None:
    """The field and value that tell a member of a tagged union apart (`name`, `source`): its one-value Literal."""
    for name, field in member.model_fields.items():
        values = typing.get_args(field.annotation)
        if typing.get_origin(field.annotation) is typing.Literal and len(values) == 1:
            return name, values[0]
    return None


def _section_holding(section: type[BaseModel], name: str) -> str | None:
    """The section of `section` that has a field `name` (a top-level `task` belongs in `model`), if one does."""
    for section_name, field in section.model_fields.items():
        members = [a for a in typing.get_args(field.annotation) or (field.annotation,) if isinstance(a, type) and issubclass(a, BaseModel)]
        if any(name in member.model_fields for member in members):
            return section_name
    return None


def _fix(err: Any, field: str, path: list[str], section: type[BaseModel] | None, members: list[type[BaseModel]]) -> str:
    kind, ctx = err["type"], err.get("ctx") or {}
    if kind == "extra_forbidden" and section is not None:
        allowed = list(section.model_fields)
        close = difflib.get_close_matches(path[-1], allowed, n=1)
        where = ".".join(path[:-1]) or "the top level"
        tag = _tag(section)
        owners = [str(t[1]) for m in members if path[-1] in m.model_fields and (t := _tag(m))]
        if owners and tag:  # a setting of another source or method: say which, rather than a near name of this one
            start = f"{path[-1]!r} belongs to {tag[0]}={' or '.join(owners)}: set {where}.{tag[0]} to one of those, or remove it; "
        else:
            home = _section_holding(section, path[-1])
            start = f"did you mean {'.'.join([*path[:-1], home, path[-1]])}? " if home else f"did you mean {close[0]!r}? " if close else f"remove {path[-1]!r}; "
        if tag and len(path) > 1:  # one member of a tagged union: say which
            where += f" ({tag[0]}={tag[1]})"
        return start + f"{where} takes {', '.join(allowed)}"
    if kind in BOUNDS and BOUNDS[kind][0] in ctx:
        key, phrase = BOUNDS[kind]
        return f"set {field} to " + phrase.format(ctx[key])
    if kind == "number_wanted":  # a bool, a fractional float or a NaN/infinity where a number is wanted (`Spec`)
        return f"set {field} to {ctx['wanted']}"
    if kind in ("union_tag_invalid", "enum", "literal_error"):
        return f"set {field} to one of the values listed"
    if kind == "missing":
        return f"set {field}"
    return f"give {field} a valid value (see README, Parameters)"

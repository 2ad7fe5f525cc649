"""Strict types for the config dataclasses (ModelConfig, TrainConfig): one coercion, one check.

Values come from YAML files, `key=value` overrides and JSON, so `coerce` turns what those formats
produce into the field's annotated type, and refuses anything else:

| annotation  | accepted                                                | refused                 |
|-------------|---------------------------------------------------------|-------------------------|
| bool        | true/false (also the strings "true"/"false"/"yes"/"no") | 1, 0, "on", any number  |
| int         | integers; integral floats and numeric strings ("1e4")   | 1.5, true, "ten"        |
| float       | numbers, numeric strings ("1e-3": YAML 1.1 reads a str) | true, "fast", nan, inf  |
| str         | strings; integers (spec 24)                             | true, 1.5, lists, maps  |
| X | None    | null, or what X accepts                                 |                         |
| list[float] | a list of numbers                                       | a scalar, a list of str |
| dict[...]   | a mapping                                               | anything else           |

`check` is the strict form for values already in a dataclass: the value must be of the type as it
is.
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
import math
from typing import Any

from meshlm.errors import ConfigError

_TRUE, _FALSE = ("true", "yes"), ("false", "no")


class FieldError(ValueError):
    """One field's value does not fit its type; the message names the field, the value and what
    fits."""


def _what(kind: str) -> str:
    base = kind.replace(" | None", "")
    words = {"bool": "true or false", "int": "an integer", "float": "a finite number",
             "str": "a string",
             "list[float]": "a list of numbers"}
    text = words.get(base, "a mapping" if base.startswith("dict") else base)
    return text + (" (or null)" if kind.endswith("| None") else "")


def coerce(name: str, kind: str, value: Any) -> Any:
    """`value` (from YAML/JSON/an override) as the annotated type `kind`; FieldError if it does not
    fit."""
    bad = FieldError(f"{name}={value!r} must be {_what(kind)}")
    if kind.endswith(" | None"):
        return None if value is None else coerce(name, kind[:-len(" | None")], value)
    if kind == "bool":
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
            return value.strip().lower() in _TRUE
        raise bad
    if kind in ("int", "float"):
        number = _number(value)
        if number is None:
            raise bad
        if kind == "float":
            return float(number)
        if isinstance(number, float) and not number.is_integer():
            raise bad
        return int(number)
    if kind == "str":
        if isinstance(value, str):
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            return str(value)
        raise bad
    if kind.startswith("list"):
        if not isinstance(value, (list, tuple)):
            raise bad
        numbers = [_number(v) for v in value]
        if any(n is None for n in numbers):
            raise bad
        return [float(n) for n in numbers]
    if kind.startswith("dict"):
        if not isinstance(value, dict):
            raise bad
        return dict(value)
    return value


def _number(value: Any) -> int | float | None:
    """A finite int/float from a number or a numeric string; None otherwise (bools are not
    numbers)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, str):
        text = value.strip()
        try:
            value = int(text)
        except ValueError:
            try:
                value = float(text)
            except ValueError:
                return None
    if isinstance(value, (int, float)) and math.isfinite(value):
        return value
    return None


def check(name: str, kind: str, value: Any) -> str | None:
    """The strict test for a value already in a dataclass: the problem, or None if it is of the
    type."""
    try:
        ok = coerce(name, kind, value)
    except FieldError as err:
        return str(err)
    same_type = type(ok) is type(value) or (isinstance(value, int) and not isinstance(value, bool)
                                            and isinstance(ok, float))
    if ok != value or not same_type:
        return f"{name}={value!r} must be {_what(kind)}"
    return None


def kinds(cls) -> dict[str, str]:
    """Field name -> annotation string of a dataclass (annotations are strings under `from
    __future__`)."""
    return {f.name: str(f.type) for f in dataclasses.fields(cls)}


def did_you_mean(wrong: list, valid) -> str:
    """" (did you mean 'lr'?)" for the valid names nearest to misspelt ones, or "" when none is
    near."""
    near = [m for w in wrong for m in difflib.get_close_matches(str(w), [str(v) for v in valid],
                                                                n=2)]
    return f" (did you mean {', '.join(repr(m) for m in dict.fromkeys(near))}?)" if near else ""


def coerce_all(cls, data: dict[str, Any], what: str) -> tuple[dict[str, Any], list[str]]:
    """Coerce every known field of `data`; (values that fit, problems incl. unknown fields)."""
    types = kinds(cls)
    problems: list[str] = []
    unknown = sorted(set(data) - set(types), key=str)
    if unknown:
        problems.append(f"unknown {what} field(s) {unknown}{did_you_mean(unknown, types)}; valid "
                        f"fields: {sorted(types)}")
    values = {}
    for key, value in data.items():
        if key in types:
            try:
                values[key] = coerce(key, types[key], value)
            except FieldError as err:
                problems.append(str(err))
    return values, problems


def type_problems(obj) -> tuple[list[str], list[str]]:
    """(problems, names of the fields with a wrong type) of a dataclass instance, checked
    strictly."""
    problems, names = [], []
    for name, kind in kinds(type(obj)).items():
        problem = check(name, kind, getattr(obj, name))
        if problem:
            problems.append(problem)
            names.append(name)
    return problems, names


def with_defaults(obj, names: list[str]):
    """A shallow copy of `obj` (no __post_init__) whose `names` fields hold their defaults: lets the
    range checks run on the other fields when some have the wrong type."""
    shadow = copy.copy(obj)
    for f in dataclasses.fields(obj):
        if f.name in names:
            default = (f.default_factory() if f.default_factory is not dataclasses.MISSING
                       else f.default)
            object.__setattr__(shadow, f.name, default)
    return shadow


def build(cls, values: dict[str, Any], problems: list[str], prefix: str):
    """cls(**values), with the problems its own validation finds joined to `problems` (from
    coerce_all): every problem in one ConfigError starting with `prefix`."""
    config = None
    try:
        config = cls(**values)
    except ConfigError as err:
        problems.append(str(err).removeprefix(prefix))
    if problems:
        raise ConfigError(prefix + "; ".join(problems))
    return config

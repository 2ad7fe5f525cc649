"""Dataclasses read from and written to JSON files (meshlm.evaluation.results builds on them).

A `Record` subclass declares its keys as fields, in the order a file lists them; `from_dict` builds
one from parsed JSON (nested records, lists and dicts of records, by the field types) and `to_dict`
gives the JSON back. Keys a class does not declare ride along in `extra` and are written back, so
reading and rewriting a file from a newer meshlm loses nothing. A field declared with `optional()`
is left out of the file while it is None (a section not measured); every other field is always
written, None as null.
"""
from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any, TypeVar

from meshlm.errors import MeshlmError

R = TypeVar("R", bound="Record")


class ResultError(MeshlmError):
    """A results file that does not hold what its kind of record needs."""


class UnreadableResult(ResultError):
    """A results file that cannot be read or parsed."""


def optional(default: Any = None) -> Any:
    """A field left out of the file while it is None."""
    return dataclasses.field(default=default, metadata={"omit_none": True})


@dataclasses.dataclass(kw_only=True)
class Record:
    extra: dict[str, Any] = dataclasses.field(default_factory=dict, repr=False)  # undeclared keys

    @classmethod
    def from_dict(cls: type[R], data: Any) -> R:
        if not isinstance(data, dict):
            raise ResultError(f"{cls.__name__} must be a JSON object, not {type(data).__name__}")
        declared = [f for f in dataclasses.fields(cls) if f.name != "extra"]
        missing = [f.name for f in declared if f.name not in data and _required(f)]
        if missing:
            raise ResultError(f"{cls.__name__} lacks {', '.join(map(repr, missing))}")
        hints = _hints(cls)
        values = {f.name: _decode(hints[f.name], data[f.name]) for f in declared if f.name in data}
        names = {f.name for f in declared}
        return cls(**values, extra={k: v for k, v in data.items() if k not in names})

    def to_dict(self) -> dict[str, Any]:
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "extra" or (value is None and f.metadata.get("omit_none")):
                continue
            out[f.name] = _encode(value)
        return {**out, **self.extra}


def _required(f: dataclasses.Field) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _decode(hint: Any, value: Any) -> Any:
    """JSON `value` as the field type `hint` says: records built, list items and dict values
    decoded."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):  # X | None
        kinds = [a for a in args if a is not type(None)]
        return None if value is None else _decode(kinds[0], value)
    if origin is list and args:
        if not isinstance(value, list):
            raise ResultError(f"expected a list, not {type(value).__name__}")
        return [_decode(args[0], v) for v in value]
    if origin is dict and len(args) == 2:
        if not isinstance(value, dict):
            raise ResultError(f"expected a JSON object, not {type(value).__name__}")
        return {k: _decode(args[1], v) for k, v in value.items()}
    if isinstance(hint, type) and issubclass(hint, Record):
        return hint.from_dict(value)
    return value


def _encode(value: Any) -> Any:
    if isinstance(value, Record):
        return value.to_dict()
    if isinstance(value, list):
        return [_encode(v) for v in value]
    if isinstance(value, dict):
        return {k: _encode(v) for k, v in value.items()}
    return value

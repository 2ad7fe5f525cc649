"""The one way a class joins a registry by name: schemes (meshlm.model.schemes) and exit criteria
(meshlm.model.exit) both register through it."""
from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T", bound=type)


def named_into(table: dict[str, T], name: str) -> Callable[[T], T]:
    """Class decorator: the class's `name` becomes `name`, and `table[name]` the class."""

    def enter(cls: T) -> T:
        cls.name = name
        table[name] = cls
        return cls

    return enter

"""Dotted command-line overrides (`model.d_model=128`, `train.lr=1e-3`, `lr=1e-3`) applied to the
flat dict a TrainConfig is built from; values parse as YAML scalars (ints and floats first, so
"1e-3" is a float although YAML 1.1 reads it as a string)."""
from __future__ import annotations

from typing import Any

import yaml

from meshlm.errors import ConfigError


def apply_override(flat: dict[str, Any], item: str, default_preset: str) -> None:
    """Apply one `a.b.c=value` to a flat TrainConfig dict (with a nested "model" dict, started
    from `default_preset` when the override is the first model setting)."""
    key, sep, raw = item.partition("=")
    if not sep or not key:
        raise ConfigError(f"override {item!r} is not key=value; e.g. train.lr=1e-3 or "
                          f"model.d_model=128")
    parts = key.strip().split(".")
    if parts[0] == "train":
        parts = parts[1:]
    value = _parse_scalar(raw.strip())
    if parts[0] == "model":
        if len(parts) == 1:
            raise ConfigError(f"override {item!r} needs a field, e.g. model.d_model=128 or "
                              f"model.preset=tiny")
        target = flat.setdefault("model", {"preset": default_preset})
        for depth, p in enumerate(parts[1:-1], 1):
            target = target.setdefault(p, {})
            if not isinstance(target, dict):
                raise ConfigError(f"override {item!r}: {'.'.join(parts[:depth + 1])} is "
                                  f"{target!r}, not a mapping")
        target[parts[-1]] = value
    elif len(parts) == 1:
        flat[parts[0]] = value
    else:
        raise ConfigError(f"override {item!r}: only model.<field>[.<option>] may be nested")


def _parse_scalar(raw: str) -> Any:
    try:
        return int(raw)
    except ValueError:
        pass
    try:
        return float(raw)
    except ValueError:
        pass
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw

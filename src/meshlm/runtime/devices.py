"""One check for a requested device, shared by every command, so an unavailable one gets the same
line."""
from __future__ import annotations

import re

import torch

from meshlm.errors import ConfigError

_NAME = re.compile(r"^(auto|cpu|cuda)(?::(\d+))?$")


def device_problem(name: object, option: str = "--device") -> str | None:
    """Why `name` cannot be used here, or None. `option` is how the user spelled the setting."""
    show = f"{option}={name}" if not option.startswith("--") else f"{option} {name}"
    use = f"{option}=cpu" if not option.startswith("--") else f"{option} cpu"
    m = _NAME.match(str(name)) if isinstance(name, str) else None
    if m is None or (m.group(1) != "cuda" and m.group(2) is not None):
        return f"{show} is not a device; use auto, cpu, cuda or cuda:N"
    if m.group(1) != "cuda":
        return None
    if not torch.cuda.is_available():
        return f"{show} but no CUDA device is visible; use {use} or auto"
    index = int(m.group(2) or 0)
    if index >= torch.cuda.device_count():
        return (f"{show} but only {torch.cuda.device_count()} CUDA device(s) are visible; "
                f"use cuda:0 … cuda:{torch.cuda.device_count() - 1}")
    return None


def resolve_device(name: str = "auto", option: str = "--device") -> torch.device:
    """"auto" -> cuda if available else cpu; "cpu", "cuda", "cuda:N" checked; ConfigError
    otherwise."""
    problem = device_problem(name, option)
    if problem:
        raise ConfigError(problem)
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)

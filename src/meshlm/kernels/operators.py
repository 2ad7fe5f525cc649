"""The kernels' torch operators implemented in C++ (operators.cpp), where this machine builds it.

Each C kernel is also the torch operator meshlm::<name> (meshlm.kernels.kernel), which a compiled
decode step calls. Implemented in Python, a call goes from the dispatcher back into the interpreter
and through ctypes; implemented in C++ it does not (docs/quantize.md has the measure).
`register(name, function)` gives meshlm::<name> its C++ implementation bound to `function` (the C
kernel as this process loaded it) and says whether it did; where not, the kernel's Python
implementation serves (the same numbers, slower), and `unavailable()` names why in one line with
its fix. It is called once a process traces a graph through an operator
(meshlm.kernels.kernel.compiled_operators); the library is built then, once per machine and torch
version (meshlm.kernels.build), and loaded once per process: a process has one dispatcher, and the
registrations live as long as the process.
"""
from __future__ import annotations

import ctypes
import threading
from pathlib import Path

from meshlm.kernels import build

SOURCE = Path(__file__).with_name("operators.cpp")
_LOADED: list[ctypes.CDLL] = []  # the library, once loaded
_WHY_NOT: list[str] = []  # why the latest register() returned False
_LOCK = threading.Lock()  # one registration at a time (a first one registers, the others rebind)


def _library() -> ctypes.CDLL | None:
    if not _LOADED:
        library = build.library(SOURCE)
        if library is None:
            return None
        library.meshlm_register.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_char_p,
                                            ctypes.c_size_t]
        library.meshlm_register.restype = ctypes.c_int
        _LOADED.append(library)
    return _LOADED[0]


def register(name: str, function: ctypes._CFuncPtr) -> bool:
    """Whether meshlm::<name> now runs in C++ through `function` (a C kernel bound by ctypes):
    registered at the first call of a process, rebound at every later one."""
    with _LOCK:
        return _register(name, function)


def _register(name: str, function: ctypes._CFuncPtr) -> bool:
    _WHY_NOT.clear()
    library = _library()
    if library is None:
        _WHY_NOT.append(build.why_not(SOURCE) or f"{SOURCE.name} did not load")
        return False
    error = ctypes.create_string_buffer(512)
    address = ctypes.cast(function, ctypes.c_void_p).value
    if library.meshlm_register(name.encode(), address, error, len(error)):
        _WHY_NOT.append(f"meshlm::{name} was not registered in C++ "
                        f"({error.value.decode(errors='replace')}); reinstall meshlm")
        return False
    return True


def unavailable() -> str | None:
    """Why the latest register() left an operator in Python (one line: the problem and its fix),
    None where it did not."""
    return _WHY_NOT[0] if _WHY_NOT else None

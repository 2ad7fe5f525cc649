"""glibc malloc tuned for training loops: keep freed activation memory in the process instead of
handing it back to the kernel and faulting it in again next step.

By default glibc serves every allocation above a (dynamic, at most 32 MiB) threshold with its own
mmap and returns it with munmap on free, and trims the heap top above 128 KiB. A training step
allocates and frees the same large activation buffers every step, so each step pays page faults and
zeroing in the kernel again (the default job: 20.9% of its CPU time in the kernel, 69,659 minor
faults a step; docs/benchmarks.md).

`tune()` raises the mmap threshold to 1 GiB (one huge tensor may still use mmap), never trims, pads
each heap growth by 64 MiB and caps malloc arenas at 4 (PyTorch's worker threads would otherwise
each grow an arena). It calls mallopt(3) in this process and sets the matching MALLOC_* environment
variables, which glibc reads at start-up, for every child process (`meshlm reproduce`'s runs,
benchmarks' children). A MALLOC_* variable already in the environment wins over its setting here.

Harmless elsewhere: without glibc (macOS, musl, Windows) nothing is changed. MESHLM_MALLOC=default
leaves malloc alone (for comparisons: benchmarks/train_policy.py measures both).
"""
from __future__ import annotations

import ctypes
import os

# mallopt(3) parameter numbers (malloc.h) -> (value, the environment variable glibc reads at
# start-up)
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -2, -3, -8
SETTINGS = {
    M_MMAP_THRESHOLD: (1 << 30, "MALLOC_MMAP_THRESHOLD_"),
    M_TRIM_THRESHOLD: ((1 << 31) - 1, "MALLOC_TRIM_THRESHOLD_"),
    M_TOP_PAD: (64 << 20, "MALLOC_TOP_PAD_"),
    M_ARENA_MAX: (4, "MALLOC_ARENA_MAX"),
}
OPT_OUT = "MESHLM_MALLOC"  # "default": leave malloc alone

_state = {"done": None}


def _glibc():
    """libc as a ctypes library if it is glibc (has gnu_get_libc_version and mallopt), else None."""
    try:
        libc = ctypes.CDLL(None)
        version = libc.gnu_get_libc_version
        libc.mallopt  # noqa: B018 (an AttributeError here means no mallopt)
    except (OSError, AttributeError, TypeError):
        return None
    version.restype = ctypes.c_char_p
    return libc


def tune() -> str:
    """Tune malloc for this process and its children, once; returns what was done, in words."""
    if _state["done"] is not None:
        return _state["done"]
    if os.environ.get(OPT_OUT, "").lower() == "default":
        _state["done"] = f"malloc left at its defaults ({OPT_OUT}=default)"
        return _state["done"]
    libc = _glibc()
    if libc is None:
        _state["done"] = "malloc left alone (not glibc)"
        return _state["done"]
    applied, kept = 0, []
    for param, (value, env_name) in SETTINGS.items():
        if env_name in os.environ:  # the user's own setting, already applied by glibc: keep it
            kept.append(env_name)
            continue
        applied += libc.mallopt(ctypes.c_int(param), ctypes.c_int(value)) == 1
        os.environ[env_name] = str(value)  # children: glibc reads these before main()
    version = libc.gnu_get_libc_version().decode()
    _state["done"] = (f"glibc {version} malloc tuned ({applied} mallopt settings applied"
                      + (f"; kept the environment's {', '.join(kept)})" if kept else ")"))
    return _state["done"]


"""C kernels compiled on the machine that runs them: meshlm.runtime.fp32_rows (fp32 products of
up to a few dozen rows, decoding's) and meshlm.quant.native (one-row int8 products).

`library(source)` compiles one of meshlm's own C files once per machine with the C compiler ($CC,
else cc or gcc; -O3 -march=native -fopenmp, with fewer flags where the compiler refuses those)
into <cache>/kernels/<name>-<digest>.so (<cache> as meshlm.runtime.machine), keyed by the source,
the compiler and the CPU, and loads it; None where that cannot be done (no compiler, a failed
build) or MESHLM_NATIVE=0: the callers then keep PyTorch's ops. The library is code this process
runs, built from meshlm's own source: one that another user could have written (not owned by this
user, or its file or folder writable by group or others) is not loaded. Delete the folder to
rebuild. OpenMP comes from the runtime torch itself loads, so the kernels share its threads.

Each kernel's module checks the numbers before use and times it against PyTorch's path (a probe
cached in machine.json): whether a plain loop beats oneDNN depends on the CPU.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

from meshlm.data.cache_dir import cache_dir
from meshlm.runtime import machine

# tried in order: the first set this compiler accepts is built
FLAG_SETS = (("-O3", "-march=native", "-fopenmp"), ("-O3", "-fopenmp"), ("-O3",))
BUILD_SECONDS = 60


def enabled() -> bool:
    """False where MESHLM_NATIVE=0 asks for PyTorch's ops alone."""
    return os.environ.get("MESHLM_NATIVE", "1") != "0"


def compiler() -> str | None:
    """The C compiler to build with: $CC, else cc, else gcc (None: none on PATH)."""
    found = (shutil.which(name) for name in (os.environ.get("CC"), "cc", "gcc") if name)
    return next((path for path in found if path), None)


def library(source: Path) -> ctypes.CDLL | None:
    """`source` built for this CPU and loaded: from the cache, or compiled now (module
    docstring)."""
    cc = compiler() if enabled() and source.is_file() else None
    if cc is None:
        return None
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True,
                                 timeout=BUILD_SECONDS).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    key = hashlib.sha256("\n".join([source.read_text(), cc, version, machine.cpu_id()]).encode())
    target = cache_dir() / "kernels" / f"{source.stem}-{key.hexdigest()[:16]}.so"
    if not target.is_file() and not _compile(cc, source, target):
        return None
    if not (_private(target) and _private(target.parent)):
        return None
    try:
        return ctypes.CDLL(str(target))
    except OSError:
        return None


def _private(path: Path) -> bool:
    """Whether only this user could have written `path`: owned by them, not writable by group or
    others. A library is code this process runs, and $MESHLM_CACHE may be a folder others share;
    one that someone else could have replaced is not loaded (as ssh treats its keys)."""
    try:
        st = path.stat()
    except OSError:
        return False
    return st.st_uid == os.getuid() and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def _compile(cc: str, source: Path, target: Path) -> bool:
    """Compile `source` into `target` with the first flag set `cc` accepts; written to a temp file
    beside it and renamed, so a reader never loads half a library."""
    try:
        target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # this user's alone
    except OSError:
        return False
    for flags in FLAG_SETS:
        tmp = None
        try:
            fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
            os.close(fd)
            if subprocess.run([cc, *flags, "-shared", "-fPIC", str(source), "-o", tmp],
                              capture_output=True, timeout=BUILD_SECONDS).returncode == 0:
                os.replace(tmp, target)
                return True
        except (OSError, subprocess.SubprocessError):
            pass
        finally:
            if tmp and os.path.exists(tmp):
                os.unlink(tmp)
    return False

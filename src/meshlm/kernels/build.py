"""The builder of meshlm's C kernels: `library(source)` compiles one of meshlm's own C files once
per machine with the C compiler ($CC, else cc or gcc; -O3 -march=native -fopenmp, with fewer flags
where the compiler refuses those) into <cache>/kernels/<name>-<digest>.so (<cache> as
meshlm.machine), keyed by the source, the compiler and the CPU, and loads it; a C++ file (.cpp:
the kernels' torch operators, meshlm.kernels.operators) with the C++ compiler ($CXX, else c++ or
g++) against the installed torch's headers and libraries, keyed by torch's version too; None where
that cannot be done (the source missing from the install, no compiler, a failed build) or
MESHLM_NATIVE=0, and then `why_not(source)` names the reason and its fix. A source may include
headers of its own folder (`#include "name.h"`, kernels' shared pieces): they key its library too,
so editing one rebuilds every kernel that includes it. A library is code this
process runs: one that another user could have written (not owned by this user, or its file or
folder writable by group or others) is not loaded. Delete the folder to rebuild. OpenMP comes from
the runtime torch itself loads, so the kernels share its threads.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from meshlm import machine
from meshlm.data.cache_dir import cache_dir, untrusted

# tried in order: the first set this compiler accepts is built
FLAG_SETS = (("-O3", "-march=native", "-fopenmp"), ("-O3", "-fopenmp"), ("-O3",))
CXX_FLAG_SETS = (("-O2", "-std=c++20"), ("-O2", "-std=c++17"))  # torch's headers want C++17 or 20
BUILD_SECONDS = 60
INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"', re.MULTILINE)  # a local header
COMMENT = re.compile(r"/\*.*?\*/|//[^\n]*", re.DOTALL)  # what the include scan skips
# per source: why the latest library() call returned None (why_not)
_WHY_NOT: dict[Path, str] = {}


def enabled() -> bool:
    """False where MESHLM_NATIVE=0 asks for PyTorch's ops alone."""
    return os.environ.get("MESHLM_NATIVE", "1") != "0"


def compiler(cpp: bool = False) -> str | None:
    """The C compiler to build with: $CC, else cc, else gcc; with `cpp` the C++ one: $CXX, else
    c++, else g++ (None: none on PATH)."""
    names = (os.environ.get("CXX"), "c++", "g++") if cpp else (os.environ.get("CC"), "cc", "gcc")
    found = (shutil.which(name) for name in names if name)
    return next((path for path in found if path), None)


def _torch_flags() -> tuple[str, ...]:
    """What a C++ file needs to build against the installed torch: its ABI, headers and
    libraries (found at run time through the ones this process has loaded, and the rpath)."""
    root = Path(torch.__file__).parent
    lib = root / "lib"
    return (f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
            f"-I{root / 'include'}", f"-I{root / 'include' / 'torch' / 'csrc' / 'api' / 'include'}",
            f"-L{lib}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{lib}")


def library(source: Path) -> ctypes.CDLL | None:
    """`source` built for this CPU and loaded: from the cache, or compiled now (module
    docstring); None where that cannot be done, and then why_not(source) says why."""
    loaded, why = _load(source)
    if loaded is None:
        _WHY_NOT[source] = why
    else:
        _WHY_NOT.pop(source, None)
    return loaded


def why_not(source: Path) -> str | None:
    """Why the latest library(source) call of this process returned None, in one line that names
    the problem and its fix (for the precision line: decoding falls back to PyTorch's ops); None
    after a call that loaded it, or before any."""
    return _WHY_NOT.get(source)


def _load(source: Path) -> tuple[ctypes.CDLL | None, str]:
    """(the library, "") or (None, why not: one line naming the problem and its fix)."""
    if not enabled():
        return None, "turned off by MESHLM_NATIVE=0; unset it to build the kernel"
    if not source.is_file():
        return None, (f"its source {source.name} is missing from the install ({source.parent}); "
                      "reinstall meshlm from a wheel or sdist that ships it")
    cpp = source.suffix == ".cpp"
    cc = compiler(cpp)
    if cc is None:
        return None, ("no C++ compiler on PATH ($CXX, c++ or g++); install one or set $CXX to one"
                      if cpp else
                      "no C compiler on PATH ($CC, cc or gcc); install one or set $CC to one")
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True,
                                 timeout=BUILD_SECONDS).stdout
    except (OSError, subprocess.SubprocessError) as err:
        return None, f"the C compiler {cc} did not run ({err}); set $CC to a working one"
    try:
        text = source_text(source)
    except FileNotFoundError as err:
        return None, (f"its header {Path(err.filename).name}, which {source.name} includes, is "
                      f"missing from the install ({source.parent}); reinstall meshlm from a "
                      "wheel or sdist that ships it")
    extra = [torch.__version__, *_torch_flags()] if cpp else []
    key = hashlib.sha256("\n".join([text, cc, version, machine.cpu_id(), *extra]).encode())
    target = cache_dir() / "kernels" / f"{source.stem}-{key.hexdigest()[:16]}.so"
    failed = None if target.is_file() else _compile(cc, source, target, cpp)
    if failed:
        return None, failed
    refused = untrusted(target)
    if refused:
        return None, refused
    try:
        return ctypes.CDLL(str(target)), ""
    except OSError as err:
        return None, f"{target} did not load ({err}); delete it to rebuild"


def includes(text: str) -> list[str]:
    """The names of the local headers (`#include "name"`) a C source's `text` includes; one
    inside a comment is none (the compiler skips it too)."""
    return INCLUDE.findall(COMMENT.sub("", text))


def source_text(source: Path) -> str:
    """`source`'s text, then that of every header of its own folder it includes (`#include
    "name"`, and theirs, each once): what its library is keyed by. FileNotFoundError names a
    missing one."""
    texts, seen, todo = [], set(), [source]
    while todo:
        path = todo.pop(0)
        if path in seen:
            continue
        seen.add(path)
        text = path.read_text()
        texts.append(text)
        todo += [source.parent / name for name in includes(text)]
    return "\n".join(texts)


def _compile(cc: str, source: Path, target: Path, cpp: bool = False) -> str | None:
    """Compile `source` (C++ with `cpp`, against torch) into `target` with the first flag set `cc`
    accepts; written to a temp file
    beside it and renamed, so a reader never loads half a library. None once built, else why not
    (one line naming the problem and its fix)."""
    try:
        target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # this user's alone
    except OSError as err:
        return (f"cannot create {target.parent} ({err.strerror or err}); set MESHLM_CACHE to a "
                "folder you can write")
    detail = "no flag set tried"
    for flags in (CXX_FLAG_SETS if cpp else FLAG_SETS):
        tmp = None
        try:
            fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
            os.close(fd)
            done = subprocess.run([cc, *flags, "-shared", "-fPIC", str(source), "-o", tmp,
                                   *(_torch_flags() if cpp else ())],
                                  capture_output=True, text=True, errors="replace",
                                  timeout=BUILD_SECONDS)
            if done.returncode == 0:
                os.replace(tmp, target)
                return None
            detail = _first_error(done.stderr) or f"exit status {done.returncode}"
        except (OSError, subprocess.SubprocessError) as err:
            detail = str(err)
        finally:
            if tmp and os.path.exists(tmp):
                os.unlink(tmp)
    which = "$CXX to a C++ compiler that builds it (g++ or clang++)" if cpp else \
        "$CC to a C compiler that builds it (gcc or clang)"
    return f"{cc} failed to build {source.name} ({detail}); set {which}"


def _first_error(text: str, limit: int = 160) -> str:
    """A compiler output's first line that names an error, else its last non-blank line, cut to
    `limit` characters ("" for none)."""
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower()]
    return (errors or lines[-1:] or [""])[0][:limit]

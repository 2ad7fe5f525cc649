"""The plain decode step compiled ahead of time by AOTInductor (`meshlm generate --aot`).

torch.compile's step (meshlm.generate.steps) runs, every token, Dynamo's guards (~4,000 checks of
the model's tensors) and the Python wrapper Inductor generates around its kernels; here the same
`steps.forward` over a StaticKVCache is exported (torch.export) and compiled by AOTInductor into
a shared library whose one call runs the whole step in C++: at d = 768 on a 2-core Zen 5 that took
a w4a8 token from 2.85 to 2.39 ms, int4 from 3.57 to 2.74 (docs/quantize.md, "The decode step
compiled ahead of time").

Contract of `step_for(model, schedule, cache, tokens, window)`, a callable
`(tokens (B, 1), window (B, W), at (1,)) -> (B, V)` logits:
- The library holds no weights. The model's parameters and buffers (a quantized layer's packed
  operands among them: QuantizedLinear keeps them as non-persistent buffers) and the cache's
  buffers are bound as user-managed constants: the library reads and writes this process's
  tensors, none is copied, and a new cache (each generation's) is bound in their place (`bind`).
  So one library serves every checkpoint of an architecture, quantized or not (~2.5 MB each).
- The cache's column `at` is an input, not a constant: AOTInductor folds a buffer the graph does
  not write, and the decoder moves it on between steps (StaticKVCache.advance).
- The window's width is dynamic, as in the compiled step; the batch size, the capacity and the
  threads (Inductor's kernels are built for a number of threads) are not: one library each, kept
  for the process per model, and on disk under <cache>/aot (<cache> as meshlm.data.cache_dir),
  keyed by the exported program (its graph, shapes and dtypes), torch's version, the CPU's vector
  capability and the threads, so a later run of the same architecture exports (~2 s) and loads
  instead of compiling (~20 s); the least recently used go once the folder holds more than
  KEEP_BYTES (`prune`). A library this user could not have written alone is not loaded,
  and a build that fails is a ConfigError naming why (a C++ compiler is needed, as for
  torch.compile).
- A tensor the step reads that no module holds AOTInductor renames, so it cannot be bound: the
  library holds its own copy, and its key includes its bytes (no meshlm layer has one today).
- The numbers are the eager step's to floating-point rounding, as the compiled step's (Inductor
  fuses what eager ops round apart); tests/test_ahead.py checks greedy tokens in fp32.
"""
from __future__ import annotations

import hashlib
import os
import platform
import tempfile
import time
import warnings
import weakref
from pathlib import Path

import torch
from torch import nn

from meshlm.data.cache_dir import cache_dir, untrusted
from meshlm.errors import ConfigError
from meshlm.generate import steps

# the libraries on disk: at most this many bytes (~2.5 MB each at d = 768; the least recently
# used go first); a build's temp file older than an hour was left by a killed process
KEEP_BYTES, STALE_SECONDS = 1 << 30, 3600.0
# per model: (schedule, batch, capacity, threads, dtypes) -> its step; dropped with the model
_STEPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class _Forward(nn.Module):
    """steps.forward as a module torch.export takes, the cache's column an input."""

    def __init__(self, model: nn.Module, schedule: tuple[int, ...], cache: nn.Module):
        super().__init__()
        self.model, self.cache, self.schedule = model, cache, schedule

    def forward(self, tokens: torch.Tensor, window: torch.Tensor, at: torch.Tensor):
        self.cache.window = window
        self.cache._buffers["at"] = at  # read by StaticKVCache.update, never written in a step
        return steps.forward(self.model, self.schedule, tokens, window, self.cache)


class AheadStep:
    """One AOT-compiled step (module docstring): `seconds` it took to have (export, then compile or
    load), `loaded` whether the library came from the disk."""

    def __init__(self, runner, constants: dict[str, torch.Tensor], seconds: float, loaded: bool):
        self.runner, self.seconds, self.loaded = runner, seconds, loaded
        # the library's names that are this process's tensors (not the copies it holds: _build)
        self.names = {n for n in runner.get_constant_fqns() if n in constants}
        self.constants = constants  # kept alive: the library reads them (user-managed)
        runner.load_constants({n: constants[n] for n in self.names}, check_full_update=False,
                              user_managed=True)

    def bind(self, cache: nn.Module) -> None:
        """Read and write `cache`'s buffers from the next call on (a cache of the same shapes)."""
        tensors = {f"cache.{name}": t for name, t in cache.named_buffers()}
        self.constants.update(tensors)
        self.runner.load_constants({n: t for n, t in tensors.items() if n in self.names},
                                   check_full_update=False, user_managed=True)

    def __call__(self, tokens: torch.Tensor, window: torch.Tensor, at: torch.Tensor):
        return self.runner(tokens, window, at)


def step_for(model: nn.Module, schedule: tuple[int, ...], cache: nn.Module,
             tokens: torch.Tensor, window: torch.Tensor) -> AheadStep:
    """The AOT-compiled step for `model` at `schedule` over caches shaped as `cache` (bound to it),
    from this process's, the disk's or a new compile (module docstring)."""
    dtypes = tuple(sorted({str(t.dtype) for t in model.state_dict().values()}))
    key = (schedule, tokens.shape[0], cache.capacity, torch.get_num_threads(), dtypes)
    kept = _STEPS.setdefault(model, {})
    if key not in kept:
        kept[key] = _build(model, schedule, cache, tokens, window)
    step = kept[key]
    step.bind(cache)
    return step


def _build(model: nn.Module, schedule: tuple[int, ...], cache: nn.Module, tokens: torch.Tensor,
           window: torch.Tensor) -> AheadStep:
    start = time.perf_counter()
    width, at = torch.export.Dim("width", min=2, max=cache.capacity), cache.at
    forward = _Forward(model, schedule, cache)
    try:
        with warnings.catch_warnings():  # the window is the forward's input, set back below
            warnings.filterwarnings("ignore", "The tensor attribute self.cache.window")
            program = torch.export.export(forward, (tokens, window, at),
                                          strict=False, dynamic_shapes={
                                              "tokens": None, "window": {1: width}, "at": None})
    finally:  # the cache as it was: its own column, the decoder sets the window
        cache.window, cache._buffers["at"] = None, at
    # tensors the step reads that no module holds: AOTInductor renames them, so the library
    # keeps its own copy, and its key their bytes
    buffers = dict(forward.named_buffers())
    lifted = {n: t for n, t in program.constants.items() if n not in buffers}
    # Inductor's options: the compiled step's; no weights in the library but those copies
    options = {**steps.INDUCTOR_OPTIONS, "aot_inductor.package_constants_in_so": bool(lifted)}
    constants = {**program.state_dict, **program.constants}
    target = cache_dir() / "aot" / f"step-{_digest(program, constants, options, lifted)}.pt2"
    loaded = target.is_file()
    if loaded:
        _touch(target)  # the most recently used: the last a prune would remove
    else:
        _compile(program, target, options)
        prune(target.parent, keep=target)
    refused = untrusted(target)
    if refused:
        raise ConfigError(refused)
    runner = torch._inductor.aoti_load_package(str(target))
    return AheadStep(runner, constants, time.perf_counter() - start, loaded)


def _digest(program, constants: dict[str, torch.Tensor], options: dict,
            lifted: dict[str, torch.Tensor]) -> str:
    """What the library depends on: the exported graph with its shapes and dtypes, the constants'
    layout, the bytes of those it holds, torch, the CPU's vector capability, the threads and the
    options."""
    layout = sorted((name, tuple(t.shape), tuple(t.stride()), str(t.dtype))
                    for name, t in constants.items())
    key = hashlib.sha256("\n".join([
        program.graph_module.print_readable(print_output=False), repr(layout), torch.__version__,
        torch.backends.cpu.get_cpu_capability(), platform.machine(),
        str(torch.get_num_threads()), repr(sorted(options.items()))]).encode())
    for name in sorted(lifted):
        key.update(lifted[name].detach().contiguous().view(-1).view(torch.uint8).numpy())
    return key.hexdigest()[:16]


def _touch(path: Path) -> None:
    try:
        os.utime(path)
    except OSError:  # removed by another process's prune since: loading it says so
        pass


def prune(folder: Path, keep: Path | None = None, budget: int = KEEP_BYTES,
          stale: float = STALE_SECONDS) -> list[Path]:
    """Remove the least recently used libraries in `folder` (by modification time, which a load
    renews) until the rest hold at most `budget` bytes, never `keep` (the one just built), and
    the partial files of builds that stopped more than `stale` seconds ago (a killed process
    leaves its temp file). Returns what it removed; a file another process removed first is
    skipped."""
    now, removed = time.time(), []
    libraries = []
    for path in folder.glob("*.pt2"):
        try:
            st = path.stat()
        except OSError:
            continue
        if path.name.startswith(".partial-"):
            if now - st.st_mtime > stale:
                removed.append(path)
        elif path.name.startswith("step-"):
            libraries.append((st.st_mtime, st.st_size, path))
    held = 0
    for _, size, path in sorted(libraries, reverse=True):  # newest first
        held += size
        if held > budget and path != keep:
            removed.append(path)
    for path in removed:
        try:
            path.unlink()
        except FileNotFoundError:
            pass
    return removed


def _compile(program, target: Path, options: dict) -> None:
    """AOTInductor's library for `program` at `target`, written beside it and renamed (a reader
    never loads half a package)."""
    target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".partial-", suffix=".pt2")
    os.close(fd)
    try:
        with warnings.catch_warnings():  # torch's own deprecation, nothing a user can change
            warnings.filterwarnings("ignore", ".*LeafSpec", FutureWarning)
            torch._inductor.aoti_compile_and_package(program, package_path=tmp,
                                                     inductor_configs=options)
        os.replace(tmp, target)
    except Exception as err:  # Inductor's C++ build: a missing or failing compiler, no room
        first = (str(err).strip().splitlines() or [type(err).__name__])[0][:160]
        raise ConfigError(f"AOTInductor could not build the decode step ({first}); decode with "
                          "--compile instead, or install a C++ compiler (g++) and retry") from err
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)

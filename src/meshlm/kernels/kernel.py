"""Kernel: what each of meshlm's C kernels needs, written once (the package docstring)."""
from __future__ import annotations

import ctypes
import functools
import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from meshlm.kernels import build, operators

# a kernel is used where its probe found it at least this many times as fast as every PyTorch
# path it raced (meshlm.machine.race, cached by meshlm.machine.measured)
MIN_SPEEDUP = 1.05
# the torch operators meshlm::<name> through which a compiled graph calls the kernels
LIBRARY = torch.library.Library("meshlm", "DEF")


# every Kernel defined in this process (compiled_operators gives them their C++ operators)
KERNELS: list[Kernel] = []
_COMPILING: list[bool] = []  # whether compiled_operators() was called in this process


def operator(schema: str, impl: Callable[..., torch.Tensor], fake: Callable[..., torch.Tensor],
             key: str = "CPU"):
    """The torch operator meshlm::<name> for `schema` ("<name>(Tensor x, …) -> Tensor"), run by
    `impl` (registered for dispatch `key`): torch.compile traces an operator, not a C function
    bound by ctypes or a layout Inductor would lower worse; `fake` gives the output's shape and
    dtype from the inputs' while tracing."""
    name = schema.split("(")[0]
    LIBRARY.define(schema)
    LIBRARY.impl(name, impl, key)
    torch.library.register_fake(f"meshlm::{name}", fake, lib=LIBRARY)
    return getattr(torch.ops.meshlm, name)


def compiled_operators() -> None:
    """Give every kernel's operator its C++ implementation (meshlm.kernels.operators), now for the
    kernels this process has loaded and at load for later ones; once a process. Called the first
    time torch.compile traces through a kernel's operator (its fake runs then, before any compiled
    graph does), so only a process that compiles builds operators.cpp (~5 s, once per machine and
    torch version); eager decoding calls the kernels by ctypes and needs none."""
    if _COMPILING:
        return
    _COMPILING.append(True)
    for kernel in KERNELS:
        if kernel.function is not None:
            kernel.implement()


def _tracing(fake: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """`fake`, after compiled_operators(): a graph traced through the operator will call it."""
    def traced(*args):
        compiled_operators()
        return fake(*args)
    return traced


def close_to_float64(y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                     bias: torch.Tensor | None) -> bool:
    """Whether y is x Wᵀ + b to fp32 rounding: against the product in float64 over the same
    numbers, within 1e-5 of Σ|x||W| (+1e-6) per output. The check of the fp32 and bf16 kernels."""
    exact = x.double() @ weight.double().t() + (0 if bias is None else bias.double())
    bound = 1e-5 * (x.abs().double() @ weight.abs().double().t()) + 1e-6
    return bool(((y.double() - exact).abs() <= bound).all())


class Kernel:
    """The C function `symbol` of `source` (a C file of this package): it returns an int (0: done)
    and takes `argtypes`. `product()` is it built for this CPU and loaded (build.library), bound,
    made into what its callers take (`wrap(function)`) and returned where `check(product)` passes
    (a comparison with `reference`, named in words), else None; once per process
    (`product.cache_clear()` forgets it). `unavailable()` says why it is None, `paying()` whether
    its probe found it the faster. `operator` is the torch operator meshlm::<name> (`schema`,
    `fake`) a compiled graph calls it through: in Python, and in C++ once the process traces a graph
    through it (compiled_operators; `implemented` says which)."""

    def __init__(self, source: str, symbol: str, argtypes: list, wrap: Callable[[Any], Callable],
                 check: Callable[[Callable], bool], reference: str, schema: str,
                 fake: Callable[..., torch.Tensor]):
        self.source = Path(__file__).with_name(source)
        self.symbol, self.argtypes, self.reference = symbol, argtypes, reference
        self.wrap, self.check = wrap, check
        self.product = functools.cache(self._product)
        # the product as the torch operator meshlm::<name>, which a compiled graph calls: in
        # Python (for every dispatch key a backend kernel does not take), and in C++ for the CPU
        # once a process compiles (compiled_operators): self.implemented
        self.name, self.schema, self.fake = schema.split("(")[0], schema, fake
        self.implemented, self.function = "python", None  # the C function, once loaded
        self.operator = operator(schema, lambda *args: self.product()(*args), _tracing(fake),
                                 "CompositeExplicitAutograd")
        KERNELS.append(self)

    def _product(self) -> Callable | None:
        library = build.library(self.source)
        if library is None:
            return None
        function = self.bound(library)
        product = self.wrap(function)
        if not self.check(product):
            return None
        self.function = function
        if _COMPILING:
            self.implement()

        def traceable(*args):
            """The bound function; its operator inside a graph torch.compile is tracing."""
            return self.operator(*args) if torch.compiler.is_compiling() else product(*args)
        return traceable

    def bound(self, library: ctypes.CDLL):
        """The C function `symbol` of a loaded build of `source` (this one's, or another's: a
        benchmark's older revision, a test's build for another CPU), typed for ctypes."""
        function = getattr(library, self.symbol)
        function.argtypes, function.restype = self.argtypes, ctypes.c_int
        return function

    def implement(self) -> None:
        """meshlm::<name> on the CPU in C++, bound to the C function as loaded now (rebound at every
        later call) where operators.cpp builds; else it stays in Python (the product by ctypes:
        the same numbers, ~4 us slower a call) and operators.unavailable() says why."""
        if operators.register(self.name, self.function):
            self.implemented = "c++"

    def probed_by(self, method: str) -> str:
        """`method` (a probe's description, meshlm.machine.measured) naming this kernel's source
        by its digest: a probe cached for an older source is measured again, not trusted."""
        try:
            digest = hashlib.sha256(self.source.read_bytes()).hexdigest()[:12]
        except OSError:
            digest = "missing"
        return f"{method}; {self.source.name} {digest}"

    def unavailable(self) -> str | None:
        """Why this process has no product(), in one line naming the problem and its fix (the
        source missing from the install, no compiler, a failed build or check, MESHLM_NATIVE=0);
        None where it has it. The precision line prints it: the fallback is never silent."""
        if self.product() is not None:
            return None
        return build.why_not(self.source) or (
            f"the kernel built from {self.source.name} failed its check against "
            f"{self.reference}; set $CC to another C compiler (gcc or clang)")

    def paying(self, speedup: Callable[[Callable], dict],
               floors: dict[str, float] | None = None) -> Callable | None:
        """product() where its probe's figures (`speedup(product)`: meshlm.machine.race's, cached
        in machine.json) have it at least MIN_SPEEDUP times as fast as every path it raced, and
        each figure named in `floors` at least its floor, else None."""
        kernel = self.product()
        if kernel is None:
            return None
        figures = speedup(kernel)
        ratios = [figures[name] for name in figures if name.startswith("kernel_over_")]
        floors = floors or {}
        met = all(figures.get(name, 0.0) >= floor for name, floor in floors.items())
        return kernel if min(ratios) >= MIN_SPEEDUP and met else None

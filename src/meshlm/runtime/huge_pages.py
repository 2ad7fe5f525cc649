"""A decoding model's weights on 2 MB pages (Linux transparent huge pages), collapsed in place.

Decoding streams every weight once a token. On 4 KB pages the core misses its TLB every 4 KB of
that stream and walks the page tables, and its prefetchers stop at every page boundary; on 2 MB
pages neither happens. PyTorch's CPU allocator maps ordinary pages, and where the system's THP
setting is `madvise` (the common default) no tensor is ever backed by huge pages. `back` asks
Linux (6.1 or later) to collapse the memory under each tensor into 2 MB pages where it is
(madvise MADV_COLLAPSE): the kernel copies the pages, no tensor moves or changes, and where it
cannot (an older kernel, THP set to `never`, no free 2 MB pages, another OS) everything stays as it
was and `Backed.why_not` says why. The 2 MB regions around a tensor are collapsed whole, so small
tensors that share a region with their neighbours (meshlm's allocator keeps them in one heap:
meshlm.runtime.allocator) gain too; a region that reaches past its mapping is retried without its
partial ends. Measured on a 2-core AMD Zen 5 EPYC (docs/quantize.md, "Weights on 2 MB pages"):
1.05-1.12x a decoded fp32 token at d = 768, 0.99-1.05x bf16 and 0.98-1.04x the quantized ones,
for 0.06-1.5 s a collapse of 0.3-0.6 GB: decoding asks for it only where it decodes long
(meshlm.decoding.HUGE_PAGES_STEPS).
"""
from __future__ import annotations

import ctypes
import errno
import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass

import torch

MADV_COLLAPSE = 25  # linux/mman.h, since Linux 6.1
PAGE = 2 << 20  # the huge page size on x86-64 and on arm64 with 4 KB base pages


@dataclass(frozen=True)
class Backed:
    """What `back` did: `bytes` of memory now on 2 MB pages (whole regions), `regions` asked for,
    and `why_not` (one line) where none could be."""
    bytes: int = 0
    regions: int = 0
    why_not: str | None = None


def back(tensors: Iterable[torch.Tensor]) -> Backed:
    """Collapse the memory under the CPU `tensors` into 2 MB pages where Linux can (module
    docstring); their contents and addresses do not change."""
    ranges = _regions(t for t in tensors if t.device.type == "cpu" and t.numel())
    if not ranges:
        return Backed()
    madvise = _madvise()
    if madvise is None:
        return Backed(0, len(ranges), f"no transparent huge pages on {sys.platform}")
    done, error = 0, 0

    def collapse(span: Span) -> bool:
        nonlocal done, error
        lo, hi = span
        if hi > lo and madvise(lo, hi - lo, MADV_COLLAPSE) == 0:
            done += hi - lo
            return True
        if hi > lo:
            error = error or ctypes.get_errno()
        return False

    for outer, inner in ranges:  # the whole region; failing that, each storage's own part
        if not collapse(outer):
            for span in inner:
                collapse(span)
    if done:
        return Backed(done, len(ranges))
    why = f"madvise(MADV_COLLAPSE): {os.strerror(error) if error else 'no whole 2 MB page'}"
    if error == errno.EINVAL:
        why += " (it needs Linux 6.1 or later, transparent huge pages not set to never)"
    return Backed(0, len(ranges), why)


Span = tuple[int, int]  # [start, end) addresses


def _regions(tensors: Iterable[torch.Tensor]) -> list[tuple[Span, list[Span]]]:
    """The 2 MB-aligned regions covering the tensors' storages, overlapping ones merged: (the
    region, each storage's own bytes in it aligned inwards)."""
    spans = sorted({(s.data_ptr(), s.data_ptr() + s.nbytes())
                    for s in (t.untyped_storage() for t in tensors) if s.nbytes()})
    merged: list[tuple[list[int], list[Span]]] = []
    for a, b in spans:
        lo, hi = a // PAGE * PAGE, -(-b // PAGE) * PAGE
        inner = (-(-a // PAGE) * PAGE, b // PAGE * PAGE)
        if merged and lo <= merged[-1][0][1]:
            merged[-1][0][1] = max(merged[-1][0][1], hi)
            merged[-1][1].append(inner)
        else:
            merged.append(([lo, hi], [inner]))
    return [((lo, hi), inner) for (lo, hi), inner in merged]


def _madvise():
    """libc's madvise, or None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    return libc.madvise

"""A small per-machine cache of measured facts (matmul peaks, the bf16 probe, the probes of
meshlm's layouts and compiled kernels): <cache>/machine.json, where <cache> is $MESHLM_CACHE or
~/.cache/meshlm. Each entry is keyed by what it depends on (CPU model and flags (cpu_id) or GPU
model, torch version, threads) and records its value, the date it was measured and how.

Delete the file (or one entry) to measure again, e.g. after a run on a busy machine measured a low
peak.
"""
from __future__ import annotations

import datetime
import hashlib
import json
import platform
import time
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from meshlm import atomic
from meshlm.data.cache_dir import cache_dir
from meshlm.errors import StorageError

FILE = "machine.json"
# how a cold race (race(cold=True)) reads, in the words of the probes' methods
COLD = "each after a read that empties the caches"
CACHES = Path("/sys/devices/system/cpu/cpu0/cache")


@lru_cache(maxsize=1)
def cpu_info() -> dict[str, Any]:
    """{"model": CPU model name, "flags": set of /proc/cpuinfo flags} (empty flags off Linux)."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and value.strip():
                    model = value.strip()
                elif key in ("flags", "Features"):  # x86, arm64
                    flags = set(value.split())
                if key == "" and flags:  # the first processor's block is enough
                    break
    except OSError:
        pass
    return {"model": model, "flags": frozenset(flags)}


def cpu_id() -> str:
    """The CPU as cache keys name it: its model and a digest of its flags. A hypervisor may report
    only "AMD EPYC" for an AVX2-only and an AVX-512 generation alike, and a home folder (with the
    cache) may be shared by machines of both; the flags tell them apart."""
    info = cpu_info()
    digest = hashlib.sha256(" ".join(sorted(info["flags"])).encode()).hexdigest()[:8]
    return f"{info['model']} #{digest}"


def cpu_key(measured: str, threads: int) -> str:
    """The cache key of a measurement named `measured` of this CPU at `threads` threads."""
    return f"{measured}|{cpu_id()}|torch {torch.__version__}|threads {threads}"


def best_seconds(step: Callable[[], Any], reps: int) -> float:
    """The fastest of `reps` timed calls of `step`, after one untimed warm-up (kernels chosen,
    caches filled): how the probes measure."""
    step()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - start)
    return best


def flush_bytes(caches: Path = CACHES) -> int:
    """Bytes a read must cover to leave nothing of what was read before in the caches: twice this
    CPU's largest cache (`caches`: Linux's sysfs folder of them), from 64 MB to 1 GiB (a probe's
    memory); 256 MB where it is not known."""
    sizes = []
    for entry in caches.glob("index*/size"):
        try:
            text = entry.read_text().strip()
            sizes.append(int(text[:-1]) << {"K": 10, "M": 20}[text[-1]] if text[-1] in "KM"
                         else int(text))
        except (OSError, ValueError, IndexError):
            continue
    return min(max(64 << 20, 2 * max(sizes)), 1 << 30) if sizes else 256 << 20


def race(steps: dict[str, Callable[[], Any]], reps: int, fastest: str,
         cold: bool = False) -> dict[str, float]:
    """Each of `steps` timed without autograd: one untimed call each (kernels chosen), then `reps`
    rounds in which each step takes its turn, so a slow moment of a shared machine (a VM's read
    bandwidth moves within seconds) meets them alike; {"<step>_ms": its fastest call in
    milliseconds, "<fastest>_over_<step>": its time over that of the step named `fastest`}.
    `cold`: every timed call follows a read of flush_bytes(), so what the step reads comes from
    memory, as a decoded token's weights do once a model is larger than the caches; warm, a probe
    whose weights the last-level cache partly holds times that cache instead (a 2-core Intel
    Xeon's fp32 probe found its kernel 1.23x the split layout that decoding then ran at 0.89x,
    docs/quantize.md; on a 2-core Zen 5, 32 MB of L3, the probes' figures are the same either
    way)."""
    flush = torch.ones(flush_bytes() // 4) if cold else None
    best = dict.fromkeys(steps, float("inf"))
    with torch.no_grad():
        for step in steps.values():
            step()
        for _ in range(reps):
            for name, step in steps.items():
                if flush is not None:
                    flush.sum()
                start = time.perf_counter()
                step()
                best[name] = min(best[name], time.perf_counter() - start)
    ratios = {f"{fastest}_over_{name}": value / best[fastest] for name, value in best.items()
              if name != fastest}
    return {**ratios, **{f"{name}_ms": value * 1e3 for name, value in best.items()}}


def race_rows(steps: Callable[[int], dict[str, Callable[[], Any]]], batch: int, reps: int,
              fastest: str = "kernel") -> dict[str, float]:
    """race(steps(rows), cold) at one row and at `batch` rows, the batch's figures prefixed
    "batch_": what the decoding probes measure of a kernel that may serve every row count."""
    one = race(steps(1), reps, fastest, cold=True)
    batched = race(steps(batch), reps, fastest, cold=True)
    return {**one, **{f"batch_{name}": value for name, value in batched.items()}}


def measured(name: str, method: str, measure: Callable[[int], Any]) -> dict[str, Any]:
    """The cached entry of measurement `name` of this CPU at torch's thread count (cpu_key), or
    `measure(threads)` now by `method` (lookup)."""
    threads = torch.get_num_threads()
    return lookup(cpu_key(name, threads), lambda: measure(threads), method)


def path() -> Path:
    return cache_dir() / FILE


def read() -> dict[str, dict[str, Any]]:
    try:
        data = json.loads(path().read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def lookup(key: str, measure: Callable[[], Any], method: str) -> dict[str, Any]:
    """The cached entry for `key`, or measure it now (`measure()` -> JSON value) and cache it with
    today's date and `method`. An entry measured by another method is measured again. A cache that
    cannot be written (read-only home) only costs a re-measurement."""
    entry = read().get(key)
    if isinstance(entry, dict) and "value" in entry and entry.get("method") == method:
        return entry
    entry = {"value": measure(), "date": datetime.date.today().isoformat(), "method": method}
    data = read()
    data[key] = entry
    try:  # atomic, with a temp file per process: ranks measuring at once each leave a whole file
        atomic.write_text(path(), json.dumps(data, indent=1, sort_keys=True))
    # a full or read-only cache: the temp file is gone, the old cache as it was
    except StorageError:
        pass
    return entry

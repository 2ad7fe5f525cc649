"""How many 512-bit vector instructions one core retires a nanosecond: the ceiling under a
compute-bound kernel (an int4 product unpacks every weight before its dot product;
docs/quantize.md).

    .venv/bin/python benchmarks/vector_rate.py

Builds a small C loop with the C compiler meshlm's kernels use ($CC, cc or gcc; -O2 -march=native)
in a temporary folder and runs it pinned to one core: eight independent chains of fma, vdpbf16ps
(AVX512-BF16), vpermw (AVX512BW) and vpermps, each timed over 1.6 billion instructions. A CPU
without AVX512-BF16 prints why instead.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from meshlm.kernels.build import compiler  # noqa: E402

SOURCE = r"""
#include <immintrin.h>
#include <stdio.h>
#include <time.h>
#define N 200000000L
#define KEEP(a) __asm__ volatile("" :: "v"(a[0]), "v"(a[1]), "v"(a[2]), "v"(a[3]), \
                                 "v"(a[4]), "v"(a[5]), "v"(a[6]), "v"(a[7]))
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t);
                          return t.tv_sec + t.tv_nsec * 1e-9; }
#define TIME(name, init, op) do { init; double t0 = now(); \
    for (long i = 0; i < N; i++) { for (int j = 0; j < 8; j++) op; KEEP(a); } \
    printf("%-8s %.2f a nanosecond\n", name, N * 8 / (now() - t0) / 1e9); } while (0)
int main(void) {
    __m512 b = _mm512_set1_ps(1.0f), c = _mm512_set1_ps(1e-9f);
    __m512bh x = (__m512bh)_mm512_set1_epi16(0x3f80);
    __m512i t = _mm512_set1_epi32(5);
    TIME("fma", __m512 a[8]; for (int j = 0; j < 8; j++) a[j] = _mm512_set1_ps(j),
         a[j] = _mm512_fmadd_ps(a[j], b, c));
    TIME("vdpbf16ps", __m512 a[8]; for (int j = 0; j < 8; j++) a[j] = _mm512_set1_ps(j),
         a[j] = _mm512_dpbf16_ps(a[j], x, x));
    TIME("vpermw", __m512i a[8]; for (int j = 0; j < 8; j++) a[j] = _mm512_set1_epi32(j),
         a[j] = _mm512_permutexvar_epi16(a[j], t));
    TIME("vpermps", __m512 a[8]; for (int j = 0; j < 8; j++) a[j] = _mm512_set1_ps(j),
         a[j] = _mm512_permutexvar_ps(t, a[j]));
    return 0;
}
"""


def main() -> None:
    cc = compiler()
    if cc is None:
        sys.exit("no C compiler on PATH ($CC, cc or gcc); install one or set $CC")
    with tempfile.TemporaryDirectory() as folder:
        source, binary = Path(folder, "rate.c"), Path(folder, "rate")
        source.write_text(SOURCE)
        built = subprocess.run([cc, "-O2", "-march=native", str(source), "-o", str(binary)],
                               capture_output=True, text=True)
        if built.returncode:
            sys.exit(f"{cc} could not build the loop for this CPU (it needs AVX512-BF16 and "
                     f"AVX512BW): {built.stderr.strip().splitlines()[-1:]}")
        pin = ["taskset", "-c", str(min(os.sched_getaffinity(0)))] if os.path.exists(
            "/usr/bin/taskset") else []
        print(subprocess.run([*pin, str(binary)], capture_output=True, text=True,
                             check=True).stdout, end="")


if __name__ == "__main__":
    main()

/* meshlm's bf16 products for decoding, compiled on the machine that runs it
   (meshlm.kernels.build, used by meshlm.kernels.bf16_rows).

   y (m, n) fp32 = x (m, k) W^T + b: x bf16 rows, W (n, k) bf16 row-major -- an nn.Linear's bf16
   weight as it is, so the one copy of it serves here and in F.linear (longer calls) -- and b (n)
   fp32 or NULL. k must be a multiple of 32 (else 1 is returned: the caller keeps F.linear).

   Every output is one dot product in a fixed order of operations (vector lanes, then their sum),
   the same whichever rows share the call, so a row's outputs do not depend on the batch, bit for
   bit (meshlm.kernels.bf16_rows checks it before use). A tile is OUT weight rows by up to ROWS x
   rows: OUT x ROWS independent accumulators, each weight read once for every row of the tile,
   while each weight row AHEAD rows on is prefetched. A tile's weight rows come from four places
   in the matrix, rows p, p + n/4, p + n/2 and p + 3n/4, so that a thread reads four streams at
   once: one core of a 2-core Zen 3 VM read 10.5 GB/s of int8 weights as one sequential stream and
   17.7 as four. Over 26 (3072, 768) bf16 layers from memory at one row this read 1.40-1.45x as
   fast (one thread) and 1.22-1.55x (two) as two pairs of adjacent rows from two places did, and
   as fast at 16 rows. The last n % 4 weight rows go one output at a time after. The tiles are
   split over `threads` OpenMP threads.

   Why: a decoded token is a matrix-vector product bound by streaming the weights. On a 2-core
   Intel Xeon with AMX, oneDNN's bf16 F.linear at one row reads the weights of a 12-layer d = 768
   stack and its head at 12.1-12.9 GB/s with two threads; this, through AVX512-BF16's vdpbf16ps
   (32 products an instruction, summed in fp32), at 21.3-22.0 with the prefetch and 17.4 without
   (docs/quantize.md). With AVX512F alone the weights are widened to fp32 (exact) for fma; with
   AVX2 the same, eight at a time and two rows a tile (on a 2-core Zen 5 held to AVX2, 1.5x
   oneDNN's F.linear at one row, 2.4-3.1x at 2-16; the plain loop was 13x slower); elsewhere a
   plain C loop, which the probe will rarely find paying. */
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define VECTOR 1
#include <immintrin.h>
#endif
#include "rows.h"

#define OUT 4   /* weight rows a tile, from four places */
#define AHEAD 4 /* rows */
#define INLINE static inline __attribute__((always_inline))

static inline float widen(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* per path: STEP bf16 a dot_step, Acc the accumulator (acc_zero, acc_sum: its lanes' sum in a
   fixed order), Wv a step's weights as dot_step takes them, ROWS the rows sharing each weight */
#if defined(__AVX512F__)
#define ROWS 4
typedef __m512 Acc;
typedef __m512i Wv;
#define acc_zero _mm512_setzero_ps
#define acc_sum _mm512_reduce_add_ps
#if defined(__AVX512BF16__)
#define STEP 32
/* acc += the products of 32 bf16 of x and of w, pairwise */
INLINE Acc dot_step(Acc acc, const uint16_t *x, Wv w) {
    return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(x), (__m512bh)w);
}
INLINE Wv weights(const uint16_t *w) { return _mm512_loadu_si512(w); }
#else
#define STEP 16
INLINE Wv weights(const uint16_t *w) {
    return _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)w)), 16);
}
INLINE Acc dot_step(Acc acc, const uint16_t *x, Wv w) {
    return _mm512_fmadd_ps(_mm512_castsi512_ps(weights(x)), _mm512_castsi512_ps(w), acc);
}
#endif
#elif defined(VECTOR)
#define ROWS 2 /* 16 registers: 2 x OUT sums, OUT weights */
#define STEP 8
typedef __m256 Acc;
typedef __m256 Wv;
#define acc_zero _mm256_setzero_ps
/* 8 bf16 widened to fp32 (exact) */
INLINE Wv weights(const uint16_t *w) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)w));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
INLINE Acc dot_step(Acc acc, const uint16_t *x, Wv w) {
    return _mm256_fmadd_ps(weights(x), w, acc);
}
INLINE float acc_sum(Acc v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#else
#define ROWS 4
#endif

/* tile row o: `gap` rows after the one before */
#define ROW(o) ((o) * gap)

#if defined(VECTOR)
/* rows x outs outputs (compile-time counts once inlined): y[r * n + ROW(o)] */
INLINE void tile(const uint16_t *restrict x, const uint16_t *restrict w, float *restrict y,
                 int64_t k, int64_t n, int64_t gap, const int rows, const int outs) {
    Acc acc[ROWS][OUT];
    for (int r = 0; r < rows; r++)
        for (int o = 0; o < outs; o++)
            acc[r][o] = acc_zero();
    for (int64_t j = 0; j < k; j += STEP) {
        Wv wv[OUT];
        for (int o = 0; o < outs; o++) {
            const uint16_t *row = w + ROW(o) * k + j;
            _mm_prefetch((const char *)(row + AHEAD * k), _MM_HINT_T0);
            wv[o] = weights(row);
        }
        for (int r = 0; r < rows; r++)
            for (int o = 0; o < outs; o++)
                acc[r][o] = dot_step(acc[r][o], x + r * k + j, wv[o]);
    }
    for (int r = 0; r < rows; r++)
        for (int o = 0; o < outs; o++)
            y[r * n + ROW(o)] = acc_sum(acc[r][o]);
}
#else
INLINE void tile(const uint16_t *restrict x, const uint16_t *restrict w, float *restrict y,
                 int64_t k, int64_t n, int64_t gap, const int rows, const int outs) {
    for (int r = 0; r < rows; r++)
        for (int o = 0; o < outs; o++) {
            float acc = 0.0f;
            for (int64_t j = 0; j < k; j++)
                acc += widen(x[r * k + j]) * widen(w[ROW(o) * k + j]);
            y[r * n + ROW(o)] = acc;
        }
}
#endif

/* `rows` rows against the weight rows at `w`, `w` + gap rows, ... (a full tile), or against
   `outs` rows from `w` one output at a time (outs < OUT; the same operations per output either
   way) */
static void block(const uint16_t *restrict x, const uint16_t *restrict w, float *restrict y,
                  int64_t k, int64_t n, int64_t gap, int64_t rows, int64_t outs) {
    if (outs < OUT) {
        for (int64_t o = 0; o < outs; o++)
            for (int64_t r = 0; r < rows; r++)
                tile(x + r * k, w + o * k, y + r * n + o, k, n, 0, 1, 1);
        return;
    }
    switch (rows) {
    case 1: tile(x, w, y, k, n, gap, 1, OUT); break;
#if ROWS == 4
    case 2: tile(x, w, y, k, n, gap, 2, OUT); break;
    case 3: tile(x, w, y, k, n, gap, 3, OUT); break;
#endif
    default: tile(x, w, y, k, n, gap, ROWS, OUT); /* rows == ROWS */
    }
}

int bf16_rows_product(const uint16_t *restrict x, const uint16_t *restrict w,
                      const float *restrict bias, float *restrict y, int64_t m, int64_t k,
                      int64_t n, int threads) {
    if (k % 32)
        return 1;
    const int64_t part = n / OUT;  /* tile t: weight rows t, t + part, t + 2 part, t + 3 part */
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < part; t++) {
        for (int64_t r = 0; r < m; r += ROWS)
            block(x + r * k, w + t * k, y + r * n + t, k, n, part, m - r < ROWS ? m - r : ROWS,
                  OUT);
        for (int o = 0; o < OUT; o++)  /* by the thread that wrote the tile's outputs */
            add_bias(y, bias, t + o * part, 1, m, n);
    }
    for (int64_t r = 0; r < m; r += ROWS)  /* the last n % OUT weight rows */
        block(x + r * k, w + part * OUT * k, y + r * n + part * OUT, k, n, 0,
              m - r < ROWS ? m - r : ROWS, n - part * OUT);
    add_bias(y, bias, part * OUT, n - part * OUT, m, n);
    return 0;
}

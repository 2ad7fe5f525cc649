/* meshlm's int8-activation product for decoding, compiled on the machine that runs it
   (meshlm.quant.row_kernel).

   For each fp32 activation row x (m rows of k) and int8 weights w (n, k), row-major:
       s    = max(max_j |x[j]| * (float)(1/127), 1e-30f)        the row's scale
       q[j] = nearbyint(x[j] / s)                                in [-127, 127]
       y[i] = (float)(sum_j w[i*k + j] * q[j]) * s               the exact int32 sum, scaled
   Every step is the fp32 operation meshlm.quant.linear does with torch ops for
   other row counts (quantize_rows, then torch._int_mm, then the product by s), in IEEE
   arithmetic (no -ffast-math), so the results are the same bit for bit.

   The sum is taken as sum_j (q[j] + 128) * w[i*k + j] - 128 * wsum[i]: unsigned activations
   times signed weights is the pattern of the CPU's int8 dot-product instruction (AVX512-VNNI's
   vpdpbusd, 64 products an instruction), which the compiler then emits; wsum[i] = sum_j
   w[i*k + j], the weights' own sums, are the caller's (computed once per layer: taking them here
   doubled the dot products; without them the weights went 1.05-1.26x faster on a 2-core Zen 5).
   Integers throughout, so exact while |sum| <= k * 255 * 128 fits int32: k up to MAX_K (wider
   rows go through the torch ops). On a 2-core Zen 5 this ran 1.2-1.4x the plain signed loop.

   The rows of w go in tiles over `threads` OpenMP threads; within a row the compiler vectorises
   the loop for this CPU (-march=native), or, on a CPU with AVX2 and no int8 dot-product
   instruction, the loop below (SIGNS), whose tiles are four weight rows from four places of the
   matrix (four streams a thread; each loaded q serves the four). Every activation row meets a
   tile while it is in the cache, each with the same steps whatever m is, so a row's outputs do
   not depend on the batch; the sums are exact on every CPU, where oneDNN's int8 kernels may
   saturate without VNNI (on those the layers take this at every row count). A decoded token is a
   matrix-vector product bound by streaming w: this reads it at ~80% of a core's bandwidth on a
   Zen 5, where oneDNN's int8 kernel at one row reads ~60% (docs/quantize.md); and one call does
   what took eight tensor ops. With one weight row a tile, each thread prefetches the row AHEAD
   rows on: on a 2-core Intel Xeon with AMX one row over a 12-layer d = 768 stack and its head
   took 8.4 ms with it against 9.3 without (benchmarks/quant_rows.py --rows 1 --threads 2; 8.6
   ms 4 rows ahead, 8.9 ms 8 ahead). On a 2-core Zen 3 EPYC VM (AVX2) the four places took a
   decoded w8a8 token of the AOT step of a 12-layer d = 768 model from 16.0 to 12.4 ms at one
   thread and from 9.9 to 8.4 at two, and 16 rows 1.23-1.28x as fast. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#if defined(__AVX2__) && !defined(__AVX512VNNI__) && !defined(__AVXVNNI__)
#include <immintrin.h>
#define SIGNS 1
#endif

#define AHEAD 2

#ifdef SIGNS
/* Without an int8 dot-product instruction (the AVX2-only CPUs) the compiler's loop widened the
   values to 16 bits and multiplied those (vpmullw): ~10 GB/s of weights on a 2-core Zen 3 EPYC,
   two fifths of its read bandwidth, 1.4-1.5x slower than this. Here vpmaddubsw multiplies |w|
   (unsigned, at most 128) by q with w's sign (vpsignb; |q| <= 127), so each 16-bit pair sum is at
   most 2 * 128 * 127 < 2^15: no saturation, the exact integers, 32 products an instruction;
   vpmaddwd by ones widens the pairs into 32-bit lanes. q is stored signed (OFFSET 0), so the sum
   needs no weight sums. */
#define OFFSET 0
/* PLACES weight rows a tile, from four places: one core of a 2-core Zen 3 EPYC VM read 10.5 GB/s
   as one sequential stream and 17.7 as four; one row a tile with the next rows prefetched read 52
   (3072, 768) layers from memory at one row 1.29-1.34x slower than this */
#define PLACES 4
#define INLINE static inline __attribute__((always_inline))
/* out[o] = sum_j q[j] * w[o][j] for `outs` weight rows (PLACES or 1) */
INLINE void row_sums(const uint8_t *restrict q, const int8_t *const *w, int outs, int64_t k,
                     int32_t *out) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i acc[PLACES];
    for (int o = 0; o < outs; o++)
        acc[o] = _mm256_setzero_si256();
    int64_t j = 0;
    for (; j + 32 <= k; j += 32) {
        const __m256i qv = _mm256_loadu_si256((const __m256i *)(q + j));
        for (int o = 0; o < outs; o++) {
            const __m256i wv = _mm256_loadu_si256((const __m256i *)(w[o] + j));
            const __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(wv),
                                                       _mm256_sign_epi8(qv, wv));
            acc[o] = _mm256_add_epi32(acc[o], _mm256_madd_epi16(pairs, ones));
        }
    }
    for (int o = 0; o < outs; o++) {
        __m128i half = _mm_add_epi32(_mm256_castsi256_si128(acc[o]),
                                     _mm256_extracti128_si256(acc[o], 1));
        half = _mm_add_epi32(half, _mm_shuffle_epi32(half, 0x4e));
        half = _mm_add_epi32(half, _mm_shuffle_epi32(half, 0xb1));
        int32_t sum = _mm_cvtsi128_si32(half);
        for (int64_t i = j; i < k; i++)
            sum += (int32_t)(int8_t)q[i] * (int32_t)w[o][i];
        out[o] = sum;
    }
}
#else
/* q + 128 (OFFSET) times w, the dot-product instruction's pattern; the caller takes 128 * wsum
   off. One weight row a tile, the tiles in order, the rows AHEAD on prefetched (not measured
   with more places on a CPU with VNNI). */
#define OFFSET 128
#define PLACES 1
static inline void row_sums(const uint8_t *restrict q, const int8_t *const *w, int outs,
                            int64_t k, int32_t *out) {
    (void)outs;
    int32_t shifted = 0;
    for (int64_t j = 0; j < k; j++)
        shifted += (int32_t)q[j] * (int32_t)w[0][j];
    out[0] = shifted;
}
#endif

/* y[r, i] for the weight rows i of `rows` (`outs` of them) and every activation row r */
static inline void outputs(const uint8_t *q, const float *scales, const int8_t *w,
                           const int32_t *wsum, const int64_t *rows, int outs, float *y,
                           int64_t m, int64_t n, int64_t k) {
    const int8_t *at[PLACES];
    for (int o = 0; o < outs; o++)
        at[o] = w + rows[o] * k;
    for (int64_t r = 0; r < m; r++) {  /* the weight rows from the cache after the first */
        int32_t sums[PLACES];
        if (outs == PLACES)
            row_sums(q + r * k, at, PLACES, k, sums);
        else
            row_sums(q + r * k, at, 1, k, sums);
        for (int o = 0; o < outs; o++)
            y[r * n + rows[o]] = (float)(sums[o] - OFFSET * wsum[rows[o]]) * scales[r];
    }
}

int int8_row_product(const float *restrict x, const int8_t *restrict w,
                     const int32_t *restrict wsum, float *restrict y, int64_t m, int64_t n,
                     int64_t k, int threads) {
    float *scales = malloc(sizeof(float) * (size_t)(m > 0 ? m : 1));
    uint8_t *q = malloc((size_t)(m * k > 0 ? m * k : 1));  /* each row's q + OFFSET */
    if (!q || !scales) {
        free(q), free(scales);
        return 1;
    }
    for (int64_t r = 0; r < m; r++) {
        const float *row = x + r * k;
        float amax = 0.0f;
        for (int64_t j = 0; j < k; j++)
            amax = fmaxf(amax, fabsf(row[j]));
        float s = amax * (float)(1.0 / 127.0);
        scales[r] = s < 1e-30f ? 1e-30f : s;
        for (int64_t j = 0; j < k; j++)
            q[r * k + j] = (uint8_t)((int32_t)nearbyintf(row[j] / scales[r]) + OFFSET);
    }
    const int64_t part = n / PLACES;  /* tile p: rows p, p + part, ... */
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t p = 0; p < part; p++) {
        int64_t rows[PLACES];
        for (int o = 0; o < PLACES; o++)
            rows[o] = p + o * part;
        if (PLACES == 1 && p + AHEAD < n)  /* the hardware prefetch runs short of this */
            for (int64_t j = 0; j < k; j += 64)
                __builtin_prefetch(w + (p + AHEAD) * k + j);
        outputs(q, scales, w, wsum, rows, PLACES, y, m, n, k);
    }
    for (int64_t i = PLACES * part; i < n; i++)  /* the last n % PLACES rows, one at a time */
        outputs(q, scales, w, wsum, &i, 1, y, m, n, k);
    free(q), free(scales);
    return 0;
}

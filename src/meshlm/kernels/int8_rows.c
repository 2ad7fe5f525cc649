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

   The rows of w are split over `threads` OpenMP threads (the runtime torch's own kernels use);
   within a row the compiler vectorises the loop for this CPU (-march=native), or, on a CPU with
   AVX2 and no int8 dot-product instruction, the loop below (SIGNS). Every activation row meets a
   weight row while it is in the cache, each with the same steps whatever m is, so a row's
   outputs do not depend on the batch; the sums are exact on every CPU, where oneDNN's int8
   kernels may saturate without VNNI (on those the layers take this at every row count). A
   decoded token is a matrix-vector product bound by streaming w: this reads it at ~80% of a
   core's bandwidth on a
   Zen 5, where oneDNN's int8 kernel at one row reads ~60% (docs/quantize.md); and one call does
   what took eight tensor ops. Each thread prefetches the weight row AHEAD rows on: on a 2-core
   Intel Xeon with AMX one row over a 12-layer d = 768 stack and its head took 8.4 ms with it
   against 9.3 without (benchmarks/quant_rows.py --rows 1 --threads 2; 8.6 ms 4 rows ahead, 8.9
   ms 8 ahead). */
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
static inline int32_t row_sum(const uint8_t *restrict q, const int8_t *restrict w, int64_t k) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i acc = _mm256_setzero_si256();
    int64_t j = 0;
    for (; j + 32 <= k; j += 32) {
        __m256i wv = _mm256_loadu_si256((const __m256i *)(w + j));
        __m256i qv = _mm256_loadu_si256((const __m256i *)(q + j));
        __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(wv), _mm256_sign_epi8(qv, wv));
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, ones));
    }
    __m128i half = _mm_add_epi32(_mm256_castsi256_si128(acc), _mm256_extracti128_si256(acc, 1));
    half = _mm_add_epi32(half, _mm_shuffle_epi32(half, 0x4e));
    half = _mm_add_epi32(half, _mm_shuffle_epi32(half, 0xb1));
    int32_t sum = _mm_cvtsi128_si32(half);
    for (; j < k; j++)
        sum += (int32_t)(int8_t)q[j] * (int32_t)w[j];
    return sum;
}
#else
/* q + 128 (OFFSET) times w, the dot-product instruction's pattern; the caller takes 128 * wsum
   off */
#define OFFSET 128
static inline int32_t row_sum(const uint8_t *restrict q, const int8_t *restrict w, int64_t k) {
    int32_t shifted = 0;
    for (int64_t j = 0; j < k; j++)
        shifted += (int32_t)q[j] * (int32_t)w[j];
    return shifted;
}
#endif

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
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < n; i++) {
        const int8_t *row = w + i * k;
        if (i + AHEAD < n)  /* the hardware's prefetch does not run this far ahead of short rows */
            for (int64_t j = 0; j < k; j += 64)
                __builtin_prefetch(row + AHEAD * k + j);
        for (int64_t r = 0; r < m; r++)  /* the weight row from the cache after the first */
            y[r * n + i] = (float)(row_sum(q + r * k, row, k) - OFFSET * wsum[i]) * scales[r];
    }
    free(q), free(scales);
    return 0;
}

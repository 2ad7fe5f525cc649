/* meshlm's int8-weight, bf16-activation product (int8 weight-only), compiled on the machine that
   runs it (meshlm.quant.int8_bf16_kernel).

   Weights are meshlm's per-channel int8 (meshlm.quant.linear): W[n, j] ≈ scale[n] · q[n, j], q in
   [-128, 127], stored (n, k) row-major as the layer holds them, scale bf16. The activations are
   bf16 (the layer rounds its rows to bf16, as torch's weight-only kernel takes them), widened to
   fp32 exactly once a call; for every output, in fp32,
       y[m, n] = scale[n] · sum_j q[n, j] · x[m, j]
   Each product q · x is exact in fp32 (8 and 8 significant bits); the sum is taken in this
   kernel's order (VW lanes, four sums a lane, added at the end), not torch's, so the kernel is
   used where a check finds its outputs within fp32 rounding of the float64 product
   (kernel.close_to_float64). With AVX-512 16 weights a step (vpmovsxbd, vcvtdq2ps, vfmadd), with
   AVX2 and FMA 8, without either a plain C loop (its own order); a machine runs one of them for
   every (row, output), whatever the number of rows, so a row's outputs do not depend on the batch.
   Two rows share each converted weight.

   Outputs go in blocks of BLOCK weight rows (a few KB: they stay in the L1 cache while every
   activation row meets them), the blocks split over `threads` OpenMP threads; each thread
   prefetches the block AHEAD blocks on. On a 2-core Zen 3 EPYC (AVX2) torch's
   _weight_int8pack_mm read a 12-layer d = 768 stack at ~5 GB/s at one row, a fifth of the read
   bandwidth (docs/quantize.md). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#define BLOCK 8
#define AHEAD 2

/* a bf16 value (its bits) as the fp32 it stands for, exactly */
static inline float widen(uint16_t bits) {
    uint32_t wide = (uint32_t)bits << 16;
    float value;
    memcpy(&value, &wide, 4);
    return value;
}

#if defined(__AVX512F__)
#define VW 16
typedef __m512 V;
#define v_zero _mm512_setzero_ps
#define v_add _mm512_add_ps
#define v_fmadd _mm512_fmadd_ps
#define v_load _mm512_loadu_ps
/* VW int8 weights as floats, exactly */
static inline V weights_v(const int8_t *w) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)w)));
}
static inline float v_sum(V v) {
    __m256 high = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
    __m256 half = _mm256_add_ps(_mm512_castps512_ps256(v), high);
    __m128 quarter = _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
    quarter = _mm_add_ps(quarter, _mm_movehl_ps(quarter, quarter));
    return _mm_cvtss_f32(_mm_add_ss(quarter, _mm_movehdup_ps(quarter)));
}
#elif defined(__AVX2__) && defined(__FMA__)
#define VW 8
typedef __m256 V;
#define v_zero _mm256_setzero_ps
#define v_add _mm256_add_ps
#define v_fmadd _mm256_fmadd_ps
#define v_load _mm256_loadu_ps
static inline V weights_v(const int8_t *w) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)w)));
}
static inline float v_sum(V v) {
    __m128 quarter = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    quarter = _mm_add_ps(quarter, _mm_movehl_ps(quarter, quarter));
    return _mm_cvtss_f32(_mm_add_ss(quarter, _mm_movehdup_ps(quarter)));
}
#endif

/* sum_j w[j] · x_r[j] over k for ROWS rows x_r (1 or 2) in the order the module comment gives,
   into out[r * n]: each row's sums take the same steps whether it runs alone or beside another,
   which shares each weight's load and conversion (the conversions, not the loads, bound a row
   from the cache) */
static inline void dots(const int8_t *restrict w, const float *restrict x, int64_t k, int rows,
                        float scale, float *restrict out, int64_t n) {
    float total[2] = {0.0f, 0.0f};
    int64_t j = 0;
#ifdef VW
    V s[2][4];
    for (int r = 0; r < rows; r++)
        s[r][0] = s[r][1] = s[r][2] = s[r][3] = v_zero();
    for (; j + 4 * VW <= k; j += 4 * VW)
        for (int t = 0; t < 4; t++) {
            const V wv = weights_v(w + j + t * VW);
            for (int r = 0; r < rows; r++)
                s[r][t] = v_fmadd(wv, v_load(x + r * k + j + t * VW), s[r][t]);
        }
    for (; j + VW <= k; j += VW) {
        const V wv = weights_v(w + j);
        for (int r = 0; r < rows; r++)
            s[r][0] = v_fmadd(wv, v_load(x + r * k + j), s[r][0]);
    }
    for (int r = 0; r < rows; r++)
        total[r] = v_sum(v_add(v_add(s[r][0], s[r][1]), v_add(s[r][2], s[r][3])));
#endif
    for (int r = 0; r < rows; r++) {
        for (int64_t i = j; i < k; i++)
            total[r] = total[r] + (float)w[i] * x[r * k + i];
        out[r * n] = total[r] * scale;
    }
}

/* y (m, n) = the bf16 rows x (m, k) times the int8 weights w (n, k) scaled per output; 0, or 1
   without memory */
int int8_bf16_rows_product(const uint16_t *restrict x, const int8_t *restrict w,
                           const uint16_t *restrict scales, float *restrict y, int64_t m,
                           int64_t n, int64_t k, int threads) {
    float *wide = malloc(sizeof(float) * (size_t)(m * k > 0 ? m * k : 1));
    if (!wide)
        return 1;
    for (int64_t i = 0; i < m * k; i++)
        wide[i] = widen(x[i]);
    const int64_t blocks = (n + BLOCK - 1) / BLOCK;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t first = b * BLOCK, last = first + BLOCK < n ? first + BLOCK : n;
        if (b + AHEAD < blocks)  /* as int8_rows.c asks for its rows ahead (not measured here) */
            for (int64_t j = 0; j < BLOCK * k; j += 64)
                __builtin_prefetch(w + (first + AHEAD * BLOCK) * k + j);
        for (int64_t r = 0; r < m; r += 2)  /* the block from the cache after the first rows */
            for (int64_t i = first; i < last; i++) {
                if (r + 1 < m)  /* each call's rows a constant: the sums stay in registers */
                    dots(w + i * k, wide + r * k, k, 2, widen(scales[i]), y + r * n + i, n);
                else
                    dots(w + i * k, wide + r * k, k, 1, widen(scales[i]), y + r * n + i, n);
            }
    }
    free(wide);
    return 0;
}

/* meshlm's int8-weight, bf16-activation product (int8 weight-only), compiled on the machine that
   runs it (meshlm.quant.int8_bf16_kernel).

   Weights are meshlm's per-channel int8 (meshlm.quant.linear): W[n, j] ≈ scale[n] · q[n, j], q in
   [-128, 127], stored (n, k) row-major as the layer holds them, scale bf16. The activations are
   bf16 (the layer rounds its rows to bf16, as torch's weight-only kernel takes them), widened to
   fp32 exactly once a call; for every output, in fp32,
       y[m, n] = scale[n] · sum_j q[n, j] · x[m, j]
   Each product q · x is exact in fp32 (8 and 8 significant bits); the sum is taken in this
   kernel's order (VW lanes, SUMS sums a lane, added at the end: tile()), not torch's, so the
   kernel is used where a check finds its outputs within fp32 rounding of the float64 product
   (kernel.close_to_float64). With AVX-512 16 weights a step (vpmovsxbd, vcvtdq2ps, vfmadd), with
   AVX2 and FMA 8, without either a plain C loop (its own order); a machine runs one of them for
   every (row, output), whatever the number of rows, so a row's outputs do not depend on the batch.

   A tile is four weight rows from four places in the matrix, rows p, p + n/4, p + n/2 and
   p + 3n/4 (the last n % 4 rows one at a time after), so each thread reads four streams at once,
   each converted weight meeting one or two activation rows and each loaded activation every
   weight row of the tile; the tiles are split over `threads` OpenMP threads. On a 2-core Zen 3
   EPYC VM (AVX2) one core read 10.5 GB/s as one sequential stream and 17.7 as four; this kernel
   had read a row's weights in blocks of 8 consecutive rows, one stream a thread, each block
   prefetched two ahead: over 52 (3072, 768) layers from memory at one row four places read 1.3-1.6x
   as fast (prefetching them too was 0.84-0.90x), and a decoded token of the AOT step of a 12-layer
   d = 768 int8 model took 12.1 ms instead of 21.0 at one thread, 7.1 instead of 9.9 at two
   (docs/quantize.md); torch's _weight_int8pack_mm had read that stack at ~5 GB/s at one row. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#define PLACES 4 /* weight rows a tile, from four places: four streams a thread */
#define SUMS 2   /* sums a (row, output) */
#define INLINE static inline __attribute__((always_inline))

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

/* A tile: the sums of `outs` weight rows w[o] (each (k) int8) with `rows` rows x_r (each k fp32,
   x_r = x + r * k), out[r * n] of output o = scale[o] · its sum. Every (row, output) takes the
   same steps in every tile: SUMS sums of VW lanes over the steps of SUMS · VW weights, the odd
   VW-step into the first, the sums added in order and their lanes summed (v_sum), then the weights
   past the last VW-step one by one; so a row's outputs do not depend on the rows or outputs beside
   it. Each converted weight serves every row and each loaded activation every output of the tile;
   always inlined where called with constant `outs` and `rows`, so the sums stay in registers. */
INLINE void tile(const int8_t *const *w, int outs, const float *restrict x, int rows, int64_t k,
                 const float *scale, float *const *out, int64_t n) {
    float total[PLACES][2];
    int64_t j = 0;
#ifdef VW
    V s[PLACES][2][SUMS];
    for (int o = 0; o < outs; o++)
        for (int r = 0; r < rows; r++)
            for (int t = 0; t < SUMS; t++)
                s[o][r][t] = v_zero();
    for (; j + SUMS * VW <= k; j += SUMS * VW)
        for (int t = 0; t < SUMS; t++)
            for (int o = 0; o < outs; o++) {
                const V wv = weights_v(w[o] + j + t * VW);
                for (int r = 0; r < rows; r++)
                    s[o][r][t] = v_fmadd(wv, v_load(x + r * k + j + t * VW), s[o][r][t]);
            }
    for (; j + VW <= k; j += VW)
        for (int o = 0; o < outs; o++) {
            const V wv = weights_v(w[o] + j);
            for (int r = 0; r < rows; r++)
                s[o][r][0] = v_fmadd(wv, v_load(x + r * k + j), s[o][r][0]);
        }
    for (int o = 0; o < outs; o++)
        for (int r = 0; r < rows; r++) {
            V sum = s[o][r][0];
            for (int t = 1; t < SUMS; t++)
                sum = v_add(sum, s[o][r][t]);
            total[o][r] = v_sum(sum);
        }
#else
    for (int o = 0; o < outs; o++)
        for (int r = 0; r < rows; r++)
            total[o][r] = 0.0f;
#endif
    for (int o = 0; o < outs; o++)
        for (int r = 0; r < rows; r++) {
            for (int64_t i = j; i < k; i++)
                total[o][r] = total[o][r] + (float)w[o][i] * x[r * k + i];
            out[o][r * n] = total[o][r] * scale[o];
        }
}

/* the outputs of weight rows w[0..outs) (outs = PLACES, or 1) for all m rows of x: the rows two
   at a time against two of the weight rows, a last row alone against all of them (so at most
   four (output, row) pairs a tile) */
INLINE void outputs(const int8_t *const *w, int outs, const float *x, int64_t m, int64_t k,
                    const float *scale, float *const *out, int64_t n) {
    for (int64_t r = 0; r < m; r += 2) {
        float *at[PLACES];
        for (int o = 0; o < outs; o++)
            at[o] = out[o] + r * n;
        if (outs == PLACES && r + 1 < m)
            for (int o = 0; o < PLACES; o += 2)
                tile(w + o, 2, x + r * k, 2, k, scale + o, at + o, n);
        else if (outs == PLACES)
            tile(w, PLACES, x + r * k, 1, k, scale, at, n);
        else if (r + 1 < m)
            tile(w, 1, x + r * k, 2, k, scale, at, n);
        else
            tile(w, 1, x + r * k, 1, k, scale, at, n);
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
    const int64_t part = n / PLACES;  /* tile p: rows p, p + part, p + 2 part, p + 3 part */
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t p = 0; p < part; p++) {
        const int8_t *rows[PLACES];
        float scale[PLACES], *out[PLACES];
        for (int o = 0; o < PLACES; o++) {
            const int64_t i = p + o * part;
            rows[o] = w + i * k, scale[o] = widen(scales[i]), out[o] = y + i;
        }
        outputs(rows, PLACES, wide, m, k, scale, out, n);
    }
    for (int64_t i = PLACES * part; i < n; i++) {  /* the last n % PLACES rows, one at a time */
        const int8_t *row = w + i * k;
        float scale = widen(scales[i]), *out = y + i;
        outputs(&row, 1, wide, m, k, &scale, &out, n);
    }
    free(wide);
    return 0;
}

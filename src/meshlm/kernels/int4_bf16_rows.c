/* meshlm's int4-weight, bf16-activation product (int4 weight-only), compiled on the machine that
   runs it (meshlm.quant.int4_kernel).

   Weights are meshlm's grouped int4 (meshlm.quant.linear): W[n, j] ≈ scale[n, g] · (q[n, j] − 8)
   + zero[n, g], g = j / group, q in 0 … 15, in int4_rows.c's layout (QuantizedLinear.
   _int4_rows_operands: blocks of 16 outputs, one per 32-bit lane of a 512-bit register; k in
   chunks of 8; lane l's 4 bytes of chunk c hold q[16b + l, 8c + t] in byte t's low nibble and
   q[16b + l, 8c + 4 + t] in its high one), so the layer keeps one packed copy for both kernels.
   The activations are bf16 (the layer rounds its rows to bf16, as torch's weight-only kernel
   takes them), widened to fp32 exactly; for every output n, in fp32,
       P[g] = sum_{j in g} q[n, j] · x[j],   X[g] = sum_{j in g} x[j]
       y[n] = sum_g (scale[n, g] · (P[g] − 8 · X[g]) + zero[n, g] · X[g])
   The sums are fp32 sums in this kernel's order (not torch's), so the kernel is used where a
   check finds its outputs within fp32 rounding of the float64 product (kernel.close_to_float64).

   Each lane's weights are 4-bit integers: two masks split a chunk's 64 bytes into low and high
   nibbles, a byte shuffle (vpshufb) takes byte t of every lane out zero-extended, one conversion
   makes it a float, one fused multiply-add adds its product with the broadcast x[8c + t] to the
   running sum (with a shift and a mask for each value instead, 1.13-1.18x slower at one row on
   a 2-core Zen 5; at 16 rows the multiply-adds bound it either way). Four sums a row (t = 0 …
   3, the low and the high nibble of byte t to the same one) keep four chains of multiply-adds
   apart, and every row takes exactly these steps whether it runs alone or among four that share
   each load and its unpacking: a row's outputs do not depend on the batch. Blocks are split over
   `threads` OpenMP threads. Without AVX512 a plain C loop runs over the same layout (its own
   rounding: its sums are not fused; a machine runs one of the two for every row). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#define LANES 16
#define CHUNK 8
#define ROWS 4

/* a bf16 value (its bits) as the fp32 it stands for, exactly */
static inline float widen(uint16_t bits) {
    uint32_t wide = (uint32_t)bits << 16;
    float value;
    memcpy(&value, &wide, 4);
    return value;
}

/* one row widened (x, k floats) and its group sums (X, k / group floats) */
static void widen_row(const uint16_t *restrict bits, int64_t k, int64_t group,
                      float *restrict x, float *restrict sums) {
    for (int64_t j = 0; j < k; j++)
        x[j] = widen(bits[j]);
    for (int64_t g = 0; g < k / group; g++) {
        float total = 0.0f;
        for (int64_t j = g * group; j < (g + 1) * group; j++)
            total = total + x[j];
        sums[g] = total;
    }
}

#if defined(__AVX512F__)
static inline __m512 widen16(const uint16_t *bits) {
    __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)bits));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

/* the 16 outputs of a block for R rows (R = 1 or ROWS once inlined): each chunk's 64 bytes are
   loaded and unpacked once for the R rows; every row's steps are the same for either R */
static inline __attribute__((always_inline)) void block(
        const uint8_t *restrict w, const uint16_t *restrict sz, const float *restrict x,
        const float *restrict sums, int64_t k, int64_t group, float *restrict out, int64_t n,
        const int R) {
    const int64_t groups = k / group, chunks = group / CHUNK;
    const __m512i low = _mm512_set1_epi8(0x0F);
    /* spread[t]: byte t of every 32-bit lane, zero-extended (vpshufb, within each 128 bits) */
    const __m512i dword = _mm512_set_epi32(12, 8, 4, 0, 12, 8, 4, 0, 12, 8, 4, 0, 12, 8, 4, 0);
    __m512i spread[4];
    for (int t = 0; t < 4; t++)
        spread[t] = _mm512_add_epi32(_mm512_set1_epi32((int)(0x80808000u | (uint32_t)t)), dword);
    __m512 acc[ROWS];
    for (int r = 0; r < R; r++)
        acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m512 p[ROWS][4];
        for (int r = 0; r < R; r++)
            for (int t = 0; t < 4; t++)
                p[r][t] = _mm512_setzero_ps();
        for (int64_t c = 0; c < chunks; c++) {
            const int64_t j = (g * chunks + c) * CHUNK;
            const __m512i packed = _mm512_loadu_si512((const void *)(w + j * LANES / 2));
            const __m512i lows = _mm512_and_si512(packed, low);
            const __m512i highs = _mm512_and_si512(_mm512_srli_epi32(packed, 4), low);
            for (int t = 0; t < 4; t++) {
                const __m512 lo = _mm512_cvtepi32_ps(_mm512_shuffle_epi8(lows, spread[t]));
                const __m512 hi = _mm512_cvtepi32_ps(_mm512_shuffle_epi8(highs, spread[t]));
                for (int r = 0; r < R; r++) {
                    p[r][t] = _mm512_fmadd_ps(lo, _mm512_set1_ps(x[r * k + j + t]), p[r][t]);
                    p[r][t] = _mm512_fmadd_ps(hi, _mm512_set1_ps(x[r * k + j + 4 + t]), p[r][t]);
                }
            }
        }
        const uint16_t *scale = sz + g * 2 * LANES, *zero = scale + LANES;
        const __m512 sc = widen16(scale), ze = widen16(zero);
        for (int r = 0; r < R; r++) {
            const float sum = sums[r * groups + g];
            __m512 total = _mm512_add_ps(_mm512_add_ps(p[r][0], p[r][1]),
                                         _mm512_add_ps(p[r][2], p[r][3]));
            total = _mm512_sub_ps(total, _mm512_set1_ps(8.0f * sum));
            acc[r] = _mm512_add_ps(acc[r], _mm512_add_ps(_mm512_mul_ps(sc, total),
                                                         _mm512_mul_ps(ze, _mm512_set1_ps(sum))));
        }
    }
    for (int r = 0; r < R; r++)
        _mm512_storeu_ps(out + r * n, acc[r]);
}
#else
/* the plain loop over the same layout, one row */
static void block(const uint8_t *restrict w, const uint16_t *restrict sz, const float *restrict x,
                  const float *restrict sums, int64_t k, int64_t group, float *restrict out,
                  int64_t n, const int R) {
    (void)n, (void)R;
    const int64_t groups = k / group, chunks = group / CHUNK;
    float acc[LANES] = {0};
    for (int64_t g = 0; g < groups; g++) {
        float p[LANES] = {0};
        for (int64_t c = 0; c < chunks; c++) {
            const int64_t j = (g * chunks + c) * CHUNK;
            const uint8_t *chunk = w + j * LANES / 2;
            for (int l = 0; l < LANES; l++)
                for (int t = 0; t < 4; t++) {
                    const uint8_t byte = chunk[l * 4 + t];
                    p[l] = p[l] + (float)(byte & 15) * x[j + t];
                    p[l] = p[l] + (float)(byte >> 4) * x[j + 4 + t];
                }
        }
        const uint16_t *scale = sz + g * 2 * LANES, *zero = scale + LANES;
        for (int l = 0; l < LANES; l++)
            acc[l] = acc[l] + (widen(scale[l]) * (p[l] - 8.0f * sums[g]) +
                               widen(zero[l]) * sums[g]);
    }
    memcpy(out, acc, sizeof(acc));
}
#endif

/* y (m, n_blocks * 16) = the bf16 rows x (m, k) times the packed weights; 0, or 1 without
   memory */
int int4_bf16_rows_product(const uint16_t *restrict x, const uint8_t *restrict w,
                           const uint16_t *restrict sz, float *restrict y, int64_t m, int64_t k,
                           int64_t n_blocks, int64_t group, int threads) {
    const int64_t groups = k / group;
    float *wide = malloc(sizeof(float) * (size_t)(m * k > 0 ? m * k : 1));
    float *sums = malloc(sizeof(float) * (size_t)(m * groups > 0 ? m * groups : 1));
    if (!wide || !sums) {
        free(wide), free(sums);
        return 1;
    }
    for (int64_t r = 0; r < m; r++)
        widen_row(x + r * k, k, group, wide + r * k, sums + r * groups);
    const int64_t n = n_blocks * LANES;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < n_blocks; b++) {
        const uint8_t *packed = w + b * (k / CHUNK) * LANES * 4;
        const uint16_t *block_sz = sz + b * groups * 2 * LANES;
        int64_t r = 0;
#if defined(__AVX512F__)
        for (; r + ROWS <= m; r += ROWS)
            block(packed, block_sz, wide + r * k, sums + r * groups, k, group,
                  y + r * n + b * LANES, n, ROWS);
#endif
        for (; r < m; r++)
            block(packed, block_sz, wide + r * k, sums + r * groups, k, group,
                  y + r * n + b * LANES, n, 1);
    }
    free(wide), free(sums);
    return 0;
}

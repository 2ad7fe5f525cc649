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

   With AVX512_BF16 (vdpbf16ps: two bf16 products added to each fp32 lane) a table lookup
   (vpermw) turns the nibbles of a chunk's 64 bytes straight into bf16 (q − 8), which are exact:
   four lookups of the bytes shifted by 0, 8, 4 and 12 bits give each lane the pairs (q[8c],
   q[8c+2]), (q[8c+1], q[8c+3]), (q[8c+4], q[8c+6]), (q[8c+5], q[8c+7]), and four vdpbf16ps
   multiply them by the row's matching pairs of activations (arranged once a call, `pair_row`):
       P8[g] = sum_{j in g} (q[n, j] − 8) · x[j]
       y[n] = sum_g (scale[n, g] · P8[g] + zero[n, g] · X[g])
   (vdpbf16ps treats denormal inputs and results as zero: ~1e-38, far inside the check). That
   is 12 vector operations a chunk where the fused multiply-adds below take 27: 1.7x the
   weights a second from cache at one row on a 2-core Zen 5, and, with the next lines fetched
   ahead (PREFETCH), 1.25x from memory. Without it, one mask (vpand) keeps the nibble of a
   chunk's place p where it lies in every lane: q · 2^s, s = SHIFT[p] (0, 8, 16, 24 for the low
   nibbles of bytes 0-3, 4, 12, 20 for the high ones; the top nibble is shifted down to q), one
   conversion makes that a float exactly (four significant bits), one fused multiply-add adds its
   product with the broadcast x[8c + p] · 2^-s (the row scaled once a call, `unshift_row`: exact
   for |x| above 2^-102) to the running sum: exactly q · x[8c + p], the numbers a byte shuffle
   taking byte t out zero-extended gave before (vpshufb runs on two of a Zen 3's four vector
   pipes, vpand on all four: 1.10-1.18x at one row, 1.57x at 16, on a 2-core Zen 3; a shift and a
   mask for each value were 1.13-1.18x slower than the shuffle at one row on a 2-core Zen 5). Four
   sums a row (one per pair, or per byte t with the low and the high nibble of byte t to the
   same one) keep four chains apart, and every row takes exactly these steps whether it runs
   alone or among four that share each load and its unpacking: a row's outputs do not depend on
   the batch. With AVX2 (no AVX512) the same multiply-adds run eight outputs a vector, a block's
   two halves in one pass (each broadcast activation serving both; two sums a half, as 16
   registers hold two rows' of them), two rows sharing each load: at one row 2.4x torch's kernel
   held to AVX2 on a 2-core Zen 5, where that converts every weight too. (A block in two passes
   of eight outputs with four sums each, the second pass from the cache, was 0.82-0.87x at one
   row and 1.11-1.14x at 16 with one thread on a 2-core Zen 3, 0.83-0.94x at both with two.)
   Blocks are split over `threads` OpenMP threads. Without AVX2 a plain C loop runs over the same
   layout (its own rounding: its sums are not fused; a machine runs one of the four for every
   row). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#define LANES 16
#define CHUNK 8
/* bytes ahead of the chunk being read that its loop asks the cache for (prefetcht0): one thread's
   hardware prefetch alone left the weights' stream ~10% slower (a 2-core Zen 5; 4-12 KB alike) */
#define PREFETCH 8192

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

/* the vectors the block skeleton and the multiply-add path work in: V holds VLANES floats of a
   block's outputs (all 16 with AVX512; with AVX2 a half: HALVES vectors a block), VI their 32-bit
   words, ROWS the rows that share each load, SUMS the sums a row keeps for each vector */
#if defined(__AVX512F__)
#define VECTOR 1
#define VLANES 16
#define ROWS 4
#define SUMS 4
typedef __m512 V;
typedef __m512i VI;
#define v_zero _mm512_setzero_ps
#define v_add _mm512_add_ps
#define v_sub _mm512_sub_ps
#define v_mul _mm512_mul_ps
#define v_fmadd _mm512_fmadd_ps
#define v_set1 _mm512_set1_ps
#define v_store _mm512_storeu_ps
#define v_of_int _mm512_cvtepi32_ps
#define vi_load(p) _mm512_loadu_si512((const void *)(p))
#define vi_and _mm512_and_si512
#define vi_srli _mm512_srli_epi32
/* VLANES bf16 (their bits) as fp32, exactly */
static inline V widen_v(const uint16_t *bits) {
    __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)bits));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
#elif defined(__AVX2__) && defined(__FMA__)
#define VECTOR 1
#define VLANES 8
#define ROWS 2 /* 16 registers: two rows' two sums for each half, four weight vectors */
#define SUMS 2 /* four a half spill: 0.85x at one row (a 2-core Zen 3) */
typedef __m256 V;
typedef __m256i VI;
#define v_zero _mm256_setzero_ps
#define v_add _mm256_add_ps
#define v_sub _mm256_sub_ps
#define v_mul _mm256_mul_ps
#define v_fmadd _mm256_fmadd_ps
#define v_set1 _mm256_set1_ps
#define v_store _mm256_storeu_ps
#define v_of_int _mm256_cvtepi32_ps
#define vi_load(p) _mm256_loadu_si256((const __m256i *)(p))
#define vi_and _mm256_and_si256
#define vi_srli _mm256_srli_epi32
static inline V widen_v(const uint16_t *bits) {
    __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)bits));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
#endif

#if defined(VECTOR)
#define HALVES (LANES / VLANES) /* vectors a block's outputs take */
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define DOT 1
/* one row's bf16 pairs as vdpbf16ps takes them: for chunk c, four 32-bit words holding
   (x[8c], x[8c+2]), (x[8c+1], x[8c+3]), (x[8c+4], x[8c+6]), (x[8c+5], x[8c+7]), low half first */
static void pair_row(const uint16_t *restrict x, int64_t k, uint32_t *restrict pairs) {
    static const int order[4][2] = {{0, 2}, {1, 3}, {4, 6}, {5, 7}};
    for (int64_t c = 0; c < k / CHUNK; c++)
        for (int t = 0; t < 4; t++)
            pairs[c * 4 + t] = (uint32_t)x[c * CHUNK + order[t][0]] |
                               (uint32_t)x[c * CHUNK + order[t][1]] << 16;
}

/* the unpacking's constant: word i is bf16(i % 16 − 8); vpermw reads an index's low 5 bits, so
   the nibble in a word's low 4 bits selects its value whatever the bit above them */
typedef struct { __m512i table; } Unpack;
static inline Unpack unpack_init(void) {
    uint16_t words[32];
    for (int i = 0; i < 32; i++) {
        const float v = (float)(i % 16 - 8);
        uint32_t bits;
        memcpy(&bits, &v, 4);
        words[i] = (uint16_t)(bits >> 16);
    }
    return (Unpack){_mm512_loadu_si512((const void *)words)};
}

/* chunk c's (at w, k index j) products added to p[r][0][t], R rows (x: their pairs, pair_row) */
static inline __attribute__((always_inline)) void chunk(
        V p[ROWS][HALVES][SUMS], const Unpack *u, const uint8_t *restrict w,
        const uint32_t *restrict x, int64_t j, int64_t k, const int R) {
    _mm_prefetch((const char *)(w + PREFETCH), _MM_HINT_T0);
    const __m512i packed = _mm512_loadu_si512((const void *)w);
    const __m512bh q[4] = {
        (__m512bh)_mm512_permutexvar_epi16(packed, u->table),
        (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(packed, 8), u->table),
        (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(packed, 4), u->table),
        (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(packed, 12), u->table)};
    for (int r = 0; r < R; r++)
        for (int t = 0; t < 4; t++)
            p[r][0][t] = _mm512_dpbf16_ps(p[r][0][t], q[t], (__m512bh)_mm512_set1_epi32(
                (int)x[(r * (k / CHUNK) + j / CHUNK) * 4 + t]));
}
typedef uint32_t Row; /* what a row's activations are to chunk(): bf16 pairs */
#elif defined(VECTOR)
/* where the mask of a chunk's place p (k index 8c + p) leaves its nibble: q 2^SHIFT[p] (place 7,
   the lane's top nibble, is shifted down to q instead) */
static const int SHIFT[CHUNK] = {0, 8, 16, 24, 4, 12, 20, 0};

/* a widened row as chunk() takes it: x[j] · 2^-SHIFT[j % 8], exact (above 2^-102 in magnitude) */
static void unshift_row(float *restrict x, int64_t k) {
    float scale[CHUNK];
    for (int p = 0; p < CHUNK; p++) {
        scale[p] = 1.0f;
        for (int s = 0; s < SHIFT[p]; s++)
            scale[p] *= 0.5f;  /* exact: a power of two */
    }
    for (int64_t j = 0; j < k; j++)
        x[j] = x[j] * scale[j % CHUNK];
}

/* the unpacking's constants: mask[p] keeps the nibble of place p in every 32-bit lane */
typedef struct { VI mask[CHUNK - 1]; } Unpack;
static inline Unpack unpack_init(void) {
    Unpack u;
    for (int p = 0; p < CHUNK - 1; p++) {
        uint32_t words[VLANES];
        for (int i = 0; i < VLANES; i++)
            words[i] = (uint32_t)0x0F << SHIFT[p];
        u.mask[p] = vi_load(words);
    }
    return u;
}

/* chunk c's (at w, k index j; the block's 16 outputs, VLANES a vector) products added to
   p[r][h][t % SUMS], R rows (x: them widened, unshift_row); each broadcast activation serves
   every half */
static inline __attribute__((always_inline)) void chunk(
        V p[ROWS][HALVES][SUMS], const Unpack *u, const uint8_t *restrict w,
        const float *restrict x, int64_t j, int64_t k, const int R) {
    _mm_prefetch((const char *)(w + PREFETCH), _MM_HINT_T0);
    VI packed[HALVES];
    for (int h = 0; h < HALVES; h++)
        packed[h] = vi_load(w + h * VLANES * 4);
    for (int t = 0; t < 4; t++) {
        V lo[HALVES], hi[HALVES];
        for (int h = 0; h < HALVES; h++) {
            lo[h] = v_of_int(vi_and(packed[h], u->mask[t]));
            hi[h] = v_of_int(t < 3 ? vi_and(packed[h], u->mask[4 + t]) : vi_srli(packed[h], 28));
        }
        for (int r = 0; r < R; r++) {
            const V xl = v_set1(x[r * k + j + t]), xh = v_set1(x[r * k + j + 4 + t]);
            for (int h = 0; h < HALVES; h++)
                p[r][h][t % SUMS] = v_fmadd(lo[h], xl, p[r][h][t % SUMS]);
            for (int h = 0; h < HALVES; h++)
                p[r][h][t % SUMS] = v_fmadd(hi[h], xh, p[r][h][t % SUMS]);
        }
    }
}
typedef float Row; /* what a row's activations are to chunk(): fp32 */
#endif

#if defined(VECTOR)
/* a row's SUMS sums of one vector added up, in a fixed order */
static inline V total_of(const V s[SUMS]) {
#if SUMS == 4
    return v_add(v_add(s[0], s[1]), v_add(s[2], s[3]));
#else
    return v_add(s[0], s[1]);
#endif
}

/* the 16 outputs of a block for R rows (R = 1 or ROWS once inlined), HALVES vectors of VLANES:
   each chunk's bytes are loaded and unpacked once for the R rows; every row's steps are the same
   for either R */
static inline __attribute__((always_inline)) void block(
        const uint8_t *restrict w, const uint16_t *restrict sz, const Row *restrict x,
        const float *restrict sums, int64_t k, int64_t group, float *restrict out, int64_t n,
        const int R) {
    const int64_t groups = k / group, chunks = group / CHUNK;
    const Unpack u = unpack_init();
    V acc[ROWS][HALVES];
    for (int r = 0; r < R; r++)
        for (int h = 0; h < HALVES; h++)
            acc[r][h] = v_zero();
    for (int64_t g = 0; g < groups; g++) {
        V p[ROWS][HALVES][SUMS];
        for (int r = 0; r < R; r++)
            for (int h = 0; h < HALVES; h++)
                for (int s = 0; s < SUMS; s++)
                    p[r][h][s] = v_zero();
        for (int64_t c = 0; c < chunks; c++) {
            const int64_t j = (g * chunks + c) * CHUNK;
            chunk(p, &u, w + j * LANES / 2, x, j, k, R);
        }
        for (int h = 0; h < HALVES; h++) {
            const uint16_t *scale = sz + g * 2 * LANES + h * VLANES, *zero = scale + LANES;
            const V sc = widen_v(scale), ze = widen_v(zero);
            for (int r = 0; r < R; r++) {
                const float sum = sums[r * groups + g];
                V total = total_of(p[r][h]);
#ifndef DOT  /* P[g] − 8 · X[g]; vdpbf16ps summed q − 8 already */
                total = v_sub(total, v_set1(8.0f * sum));
#endif
                acc[r][h] = v_add(acc[r][h], v_add(v_mul(sc, total), v_mul(ze, v_set1(sum))));
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int h = 0; h < HALVES; h++)
            v_store(out + r * n + h * VLANES, acc[r][h]);
}
#else
typedef float Row;
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
    const int64_t groups = k / group, rows = m > 0 ? m : 1;
    float *wide = malloc(sizeof(float) * (size_t)(rows * k));
    float *sums = malloc(sizeof(float) * (size_t)(rows * groups));
    /* a row's activations as block() takes them: k / 2 bf16 pairs (pair_row), or k fp32 */
#ifdef DOT
    uint32_t *pairs = malloc(sizeof(uint32_t) * (size_t)(rows * k / 2));
    const Row *rows_in = pairs;
    const int64_t stride = k / 2;
#else
    uint32_t *pairs = NULL;
    const Row *rows_in = wide;
    const int64_t stride = k;
#endif
    if (!wide || !sums || !rows_in) {
        free(wide), free(sums), free(pairs);
        return 1;
    }
    for (int64_t r = 0; r < m; r++) {
        widen_row(x + r * k, k, group, wide + r * k, sums + r * groups);
#ifdef DOT
        pair_row(x + r * k, k, pairs + r * k / 2);
#elif defined(VECTOR)
        unshift_row(wide + r * k, k);
#endif
    }
    const int64_t n = n_blocks * LANES;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < n_blocks; b++) {
        const uint8_t *packed = w + b * (k / CHUNK) * LANES * 4;
        const uint16_t *block_sz = sz + b * groups * 2 * LANES;
        int64_t r = 0;
#if defined(VECTOR)
        for (; r + ROWS <= m; r += ROWS)
            block(packed, block_sz, rows_in + r * stride, sums + r * groups, k, group,
                  y + r * n + b * LANES, n, ROWS);
#endif
        for (; r < m; r++)
            block(packed, block_sz, rows_in + r * stride, sums + r * groups, k, group,
                  y + r * n + b * LANES, n, 1);
    }
    free(wide), free(sums), free(pairs);
    return 0;
}

/* meshlm's int4-weight, int8-activation product (w4a8), compiled on the machine that runs it
   (meshlm.quant.int4_kernel).

   Weights are meshlm's grouped int4 (meshlm.quant.linear): W[n, j] ≈ scale[n, g] · (q[n, j] − 8)
   + zero[n, g], g = j / group, q in 0 … 15. Each activation row x (k) is rounded to int8 as the
   int8 kernels round it:
       s    = max(max_j |x[j]| * (float)(1/127), 1e-30f)
       a[j] = nearbyint(x[j] / s)                                  in [-127, 127]
   and for every output n, with the exact integer sums of each group
       P[g] = sum_{j in g} (q[n, j] − 8) · a[j],   A[g] = sum_{j in g} a[j]
   the output is, in fp32 and in this order (each product and sum rounded on its own, no fused
   multiply-add; groups added first to last):
       acc  = 0;  for g: acc = acc + (scale[n, g] · P[g] + zero[n, g] · A[g])
       y[n] = acc · s
   meshlm.quant.linear.int4_int8_products computes the same numbers with torch ops; the kernel is
   used only where a check finds them equal bit for bit.

   The weights are repacked once (QuantizedLinear._int4_rows_operands) so that no sum needs a
   horizontal reduction: outputs go in blocks of 16 (one per 32-bit lane of a 512-bit register), k
   in chunks of 8. For block b and chunk c, lane l holds 4 bytes; byte t carries q[16b + l, 8c + t]
   in its low nibble and q[16b + l, 8c + 4 + t] in its high one, so one 64-byte load holds 128
   weights:
       packed[((b * (k / 8) + c) * 16 + l) * 4 + t]
   With AVX512-VNNI one vpdpbusd multiplies the 16 lanes' low nibbles by the broadcast activations
   a[8c … 8c+3] and adds each lane's four products to its running sum, a second the high nibbles
   by a[8c+4 … 8c+7]: unsigned weights times signed activations, the instruction's own pattern;
   the −8 is taken out per group as 8 · A[g]. Scales and zeros are the stored bf16 (widened to
   fp32 exactly, by a 16-bit shift), laid out per block and group:
   sz[((b * G + g) * 2 + {0: scale, 1: zero}) * 16 + l]: 4 bytes to a group of 64 weights' 32.

   Several rows reuse a block's weights while they are in cache (with VNNI four rows share each
   load and its unpacking), and every (row, output) is computed the same way whatever the number
   of rows, so a row's outputs do not depend on the batch. Blocks are split over `threads` OpenMP
   threads. Without AVX512-VNNI, AVX2's vpmaddubsw and vpmaddwd take the same sums in two halves
   of 8 lanes (each row's rounding vectorised too), and without AVX2 a plain C loop runs over the
   same layout (the same integers, the same float steps). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define VNNI 1
#elif defined(__AVX2__)
#define AVX2 1
#endif

#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#define LANES 16
#define CHUNK 8
/* bytes ahead of the chunk being read that the loops ask the cache for (prefetcht0): with VNNI a
   decoded w4a8 token 1.04-1.14x at one thread, 0.98-1.02x at two (a 2-core Zen 5, the AOT step:
   benchmarks/kernel_versions.py --aot); with the hardware prefetcher alone one thread did not
   stream its weights as fast as it reads. On a 2-core Zen 3 (AVX2) it took the AVX2 loop's pass
   over a d = 768 stack from memory 1.23-1.34x (2-16 KB ahead alike, within the noise) */
#define PREFETCH 8192

/* one row's rounding: a (k int8), A (G int32 group sums); returns s. With AVX512 16 values a
   step, with AVX2 8: the maximum is exact in any order (a NaN is passed over, as fmaxf passes it),
   the division is IEEE's and the rounding to nearest even is nearbyintf's, and each integer's low
   byte is kept (vpmovdb's truncation), so the numbers are the plain loop's (which called libm's
   fmaxf once a value: ~85 us a token at d = 768; ~4 us a call of the 49 on a Zen 3) */
static float quantize_row(const float *restrict x, int64_t k, int64_t group, int8_t *restrict a,
                          int32_t *restrict sums) {
    float amax = 0.0f;
    int64_t j = 0;
#ifdef __AVX512F__
    __m512 top = _mm512_setzero_ps();
    for (; j + 16 <= k; j += 16)
        top = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(x + j)), top);
    amax = _mm512_reduce_max_ps(top);
#elif defined(__AVX2__)
    __m256 top = _mm256_setzero_ps();
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    for (; j + 8 <= k; j += 8)  /* maxps returns its second operand where the first is a NaN */
        top = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(x + j), magnitude), top);
    float eight[8];
    _mm256_storeu_ps(eight, top);
    for (int l = 0; l < 8; l++)
        amax = eight[l] > amax ? eight[l] : amax;
#endif
    for (; j < k; j++)
        amax = fmaxf(amax, fabsf(x[j]));
    float s = amax * (float)(1.0 / 127.0);
    s = s < 1e-30f ? 1e-30f : s;
    j = 0;
#ifdef __AVX512F__
    const __m512 scale = _mm512_set1_ps(s);
    for (; j + 16 <= k; j += 16) {
        __m512 r = _mm512_roundscale_ps(_mm512_div_ps(_mm512_loadu_ps(x + j), scale),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        _mm_storeu_si128((__m128i *)(a + j), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(r)));
    }
#elif defined(__AVX2__)
    const __m256 scale = _mm256_set1_ps(s);
    /* each 32-bit integer's low byte, as vpmovdb truncates: bytes 0-3 of each 128-bit half */
    const __m256i low_bytes = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                               -1, -1, -1, 0, 4, 8, 12, -1, -1, -1, -1, -1, -1,
                                               -1, -1, -1, -1, -1, -1);
    for (; j + 8 <= k; j += 8) {
        __m256 r = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(x + j), scale),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        __m256i bytes = _mm256_shuffle_epi8(_mm256_cvtps_epi32(r), low_bytes);
        int32_t first = _mm256_cvtsi256_si32(bytes), second = _mm256_extract_epi32(bytes, 4);
        memcpy(a + j, &first, 4);
        memcpy(a + j + 4, &second, 4);
    }
#endif
    for (; j < k; j++)
        a[j] = (int8_t)nearbyintf(x[j] / s);
    for (int64_t g = 0; g < k / group; g++) {
        int32_t total = 0;
        for (int64_t i = g * group; i < (g + 1) * group; i++)
            total += a[i];
        sums[g] = total;
    }
    return s;
}

/* a bf16 value (its bits) as the fp32 it stands for, exactly */
static inline float widen(uint16_t bits) {
    uint32_t wide = (uint32_t)bits << 16;
    float value;
    memcpy(&value, &wide, 4);
    return value;
}

#if defined(VNNI) || defined(AVX2)
/* four activations (bytes) in every 32-bit lane */
static inline int32_t four_bytes(const int8_t *a) {
    int32_t four;
    memcpy(&four, a, 4);
    return four;
}
#endif

#ifdef AVX2
#define PAIRS 4 /* chunks whose 16-bit pair sums add up before widening (block_row) */

/* eight bf16 values (their bits) as the fp32 they stand for, exactly */
static inline __m256 widen8(const uint16_t *bits) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)bits)), 16));
}
#endif

#ifdef VNNI
static inline __m512i broadcast4(const int8_t *a) {
    return _mm512_set1_epi32(four_bytes(a));
}

static inline __m512 widen16(const uint16_t *bits) {
    __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)bits));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
#endif

#ifdef VNNI
/* one row's exact integer sums over `chunks` chunks of a block, per lane: four independent chains
   of vpdpbusd (two chunks a step, low and high nibbles apart), added at the end: one chain was
   bound by the instruction's latency, ~10 cycles a 64-byte load, not by the weights' streaming */
static inline __m512i group_sums(const uint8_t *restrict w, const int8_t *restrict a,
                                 int64_t chunks, __m512i low) {
    __m512i t0 = _mm512_setzero_si512(), t1 = t0, t2 = t0, t3 = t0;
    int64_t c = 0;
    for (; c + 2 <= chunks; c += 2) {
        const int64_t j = c * CHUNK;
        _mm_prefetch((const char *)(w + j * LANES / 2 + PREFETCH), _MM_HINT_T0);
        _mm_prefetch((const char *)(w + j * LANES / 2 + PREFETCH + 64), _MM_HINT_T0);
        __m512i p0 = _mm512_loadu_si512((const void *)(w + j * LANES / 2));
        __m512i p1 = _mm512_loadu_si512((const void *)(w + (j + CHUNK) * LANES / 2));
        t0 = _mm512_dpbusd_epi32(t0, _mm512_and_si512(p0, low), broadcast4(a + j));
        t1 = _mm512_dpbusd_epi32(t1, _mm512_and_si512(_mm512_srli_epi16(p0, 4), low),
                                 broadcast4(a + j + 4));
        t2 = _mm512_dpbusd_epi32(t2, _mm512_and_si512(p1, low), broadcast4(a + j + 8));
        t3 = _mm512_dpbusd_epi32(t3, _mm512_and_si512(_mm512_srli_epi16(p1, 4), low),
                                 broadcast4(a + j + 12));
    }
    if (c < chunks) {
        const int64_t j = c * CHUNK;
        __m512i p0 = _mm512_loadu_si512((const void *)(w + j * LANES / 2));
        t0 = _mm512_dpbusd_epi32(t0, _mm512_and_si512(p0, low), broadcast4(a + j));
        t1 = _mm512_dpbusd_epi32(t1, _mm512_and_si512(_mm512_srli_epi16(p0, 4), low),
                                 broadcast4(a + j + 4));
    }
    return _mm512_add_epi32(_mm512_add_epi32(t0, t1), _mm512_add_epi32(t2, t3));
}
#endif

#ifdef VNNI
#define ROWS 4
/* block_row for ROWS rows at once: each 64-byte load and its unpacking serve every row; the
   operations of each (row, output) are block_row's, in its order */
static void block_rows(const uint8_t *restrict w, const uint16_t *restrict sz,
                       const int8_t *restrict a, const int32_t *restrict sums,
                       const float *restrict s, int64_t k, int64_t group, float *restrict out,
                       int64_t n) {
    const int64_t groups = k / group, chunks = group / CHUNK;
    const __m512i low = _mm512_set1_epi8(0x0F);
    __m512 acc[ROWS];
    for (int r = 0; r < ROWS; r++)
        acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        /* the low and the high nibbles' sums in separate registers: two chains of vpdpbusd a row
           (its latency, not the loads, bounded one chain); integers, so the split is exact */
        __m512i total[ROWS], high[ROWS];
        for (int r = 0; r < ROWS; r++)
            total[r] = high[r] = _mm512_setzero_si512();
        for (int64_t c = 0; c < chunks; c++) {
            const int64_t j = (g * chunks + c) * CHUNK;
            _mm_prefetch((const char *)(w + j * LANES / 2 + PREFETCH), _MM_HINT_T0);
            __m512i packed = _mm512_loadu_si512((const void *)(w + j * LANES / 2));
            __m512i lo = _mm512_and_si512(packed, low);
            __m512i hi = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low);
            for (int r = 0; r < ROWS; r++) {
                total[r] = _mm512_dpbusd_epi32(total[r], lo, broadcast4(a + r * k + j));
                high[r] = _mm512_dpbusd_epi32(high[r], hi, broadcast4(a + r * k + j + 4));
            }
        }
        for (int r = 0; r < ROWS; r++)
            total[r] = _mm512_add_epi32(total[r], high[r]);
        const uint16_t *scale = sz + g * 2 * LANES, *zero = scale + LANES;
        const __m512 sc = widen16(scale), ze = widen16(zero);
        for (int r = 0; r < ROWS; r++) {
            const int32_t sum = sums[r * groups + g];
            __m512i exact = _mm512_sub_epi32(total[r], _mm512_set1_epi32(8 * sum));
            __m512 t = _mm512_add_ps(_mm512_mul_ps(sc, _mm512_cvtepi32_ps(exact)),
                                     _mm512_mul_ps(ze, _mm512_set1_ps((float)sum)));
            acc[r] = _mm512_add_ps(acc[r], t);
        }
    }
    for (int r = 0; r < ROWS; r++)
        _mm512_storeu_ps(out + r * n, _mm512_mul_ps(acc[r], _mm512_set1_ps(s[r])));
}
#endif

/* the 16 outputs of block b for one quantized row */
static void block_row(const uint8_t *restrict w, const uint16_t *restrict sz,
                      const int8_t *restrict a, const int32_t *restrict sums, float s, int64_t k,
                      int64_t group, float *restrict out) {
    const int64_t groups = k / group, chunks = group / CHUNK;
#ifdef VNNI
    const __m512i low = _mm512_set1_epi8(0x0F);
    __m512 acc = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m512i total = group_sums(w + g * chunks * CHUNK * LANES / 2, a + g * chunks * CHUNK,
                                   chunks, low);
        total = _mm512_sub_epi32(total, _mm512_set1_epi32(8 * sums[g]));
        const uint16_t *scale = sz + g * 2 * LANES, *zero = scale + LANES;
        __m512 t = _mm512_add_ps(_mm512_mul_ps(widen16(scale), _mm512_cvtepi32_ps(total)),
                                 _mm512_mul_ps(widen16(zero), _mm512_set1_ps((float)sums[g])));
        acc = _mm512_add_ps(acc, t);
    }
    _mm512_storeu_ps(out, _mm512_mul_ps(acc, _mm512_set1_ps(s)));
#elif defined(AVX2)
    /* the same sums in two halves of 8 lanes (h0, h1), both in one pass so that each chunk's
       activations are broadcast once: vpmaddubsw multiplies unsigned nibbles by signed
       activations into 16-bit pair sums (at most 2 * 15 * 127 = 3810); up to PAIRS chunks of them
       (8 pair sums a lane, at most 30480 < 2^15: exact) add up in 16 bits before one vpmaddwd
       widens them into each lane's 32-bit sum */
    const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0;
    for (int64_t g = 0; g < groups; g++) {
        __m256i t0 = _mm256_setzero_si256(), t1 = t0;
        for (int64_t c0 = 0; c0 < chunks; c0 += PAIRS) {
            const int64_t end = c0 + PAIRS < chunks ? c0 + PAIRS : chunks;
            __m256i h0 = _mm256_setzero_si256(), h1 = h0;
            for (int64_t c = c0; c < end; c++) {
                const int64_t j = (g * chunks + c) * CHUNK;
                const uint8_t *chunk = w + j * LANES / 2;
                _mm_prefetch((const char *)(chunk + PREFETCH), _MM_HINT_T0);
                const __m256i lo = _mm256_set1_epi32(four_bytes(a + j));
                const __m256i hi = _mm256_set1_epi32(four_bytes(a + j + 4));
                __m256i p0 = _mm256_loadu_si256((const __m256i *)chunk);
                __m256i p1 = _mm256_loadu_si256((const __m256i *)(chunk + 32));
                h0 = _mm256_add_epi16(h0, _mm256_add_epi16(
                    _mm256_maddubs_epi16(_mm256_and_si256(p0, low), lo),
                    _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(p0, 4), low), hi)));
                h1 = _mm256_add_epi16(h1, _mm256_add_epi16(
                    _mm256_maddubs_epi16(_mm256_and_si256(p1, low), lo),
                    _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(p1, 4), low), hi)));
            }
            t0 = _mm256_add_epi32(t0, _mm256_madd_epi16(h0, ones));
            t1 = _mm256_add_epi32(t1, _mm256_madd_epi16(h1, ones));
        }
        const __m256i eight = _mm256_set1_epi32(8 * sums[g]);
        const __m256 sum = _mm256_set1_ps((float)sums[g]);
        const uint16_t *scale = sz + g * 2 * LANES, *zero = scale + LANES;
        acc0 = _mm256_add_ps(acc0, _mm256_add_ps(
            _mm256_mul_ps(widen8(scale), _mm256_cvtepi32_ps(_mm256_sub_epi32(t0, eight))),
            _mm256_mul_ps(widen8(zero), sum)));
        acc1 = _mm256_add_ps(acc1, _mm256_add_ps(
            _mm256_mul_ps(widen8(scale + 8), _mm256_cvtepi32_ps(_mm256_sub_epi32(t1, eight))),
            _mm256_mul_ps(widen8(zero + 8), sum)));
    }
    _mm256_storeu_ps(out, _mm256_mul_ps(acc0, _mm256_set1_ps(s)));
    _mm256_storeu_ps(out + 8, _mm256_mul_ps(acc1, _mm256_set1_ps(s)));
#else
    float acc[LANES] = {0};
    for (int64_t g = 0; g < groups; g++) {
        int32_t p[LANES] = {0};
        for (int64_t c = 0; c < chunks; c++) {
            const int64_t j = (g * chunks + c) * CHUNK;
            const uint8_t *chunk = w + j * LANES / 2;
            for (int l = 0; l < LANES; l++)
                for (int t = 0; t < 4; t++) {
                    uint8_t byte = chunk[l * 4 + t];
                    p[l] += (int32_t)(byte & 15) * a[j + t] + (int32_t)(byte >> 4) * a[j + 4 + t];
                }
        }
        const uint16_t *scale = sz + g * 2 * LANES, *zero = scale + LANES;
        for (int l = 0; l < LANES; l++) {
            volatile float product = widen(scale[l]) * (float)(p[l] - 8 * sums[g]);
            volatile float offset = widen(zero[l]) * (float)sums[g];
            acc[l] = acc[l] + (product + offset);
        }
    }
    for (int l = 0; l < LANES; l++)
        out[l] = acc[l] * s;
#endif
}

/* y (m, n_blocks * 16) = the rows of x (m, k) times the packed weights; 0, or 1 without memory */
int int4_rows_product(const float *restrict x, const uint8_t *restrict w,
                      const uint16_t *restrict sz, float *restrict y, int64_t m, int64_t k,
                      int64_t n_blocks, int64_t group, int threads) {
    const int64_t groups = k / group;
    int8_t *a = malloc((size_t)(m * k > 0 ? m * k : 1));
    int32_t *sums = malloc(sizeof(int32_t) * (size_t)(m * groups > 0 ? m * groups : 1));
    float *scale = malloc(sizeof(float) * (size_t)(m > 0 ? m : 1));
    if (!a || !sums || !scale) {
        free(a), free(sums), free(scale);
        return 1;
    }
#pragma omp parallel for num_threads(threads) schedule(static) if (m > 1)
    for (int64_t r = 0; r < m; r++)
        scale[r] = quantize_row(x + r * k, k, group, a + r * k, sums + r * groups);
    const int64_t n = n_blocks * LANES;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < n_blocks; b++) {
        const uint8_t *block = w + b * (k / CHUNK) * LANES * 4;
        const uint16_t *block_sz = sz + b * groups * 2 * LANES;
        int64_t r = 0;
#ifdef VNNI
        for (; r + ROWS <= m; r += ROWS)
            block_rows(block, block_sz, a + r * k, sums + r * groups, scale + r, k, group,
                       y + r * n + b * LANES, n);
#endif
        for (; r < m; r++)
            block_row(block, block_sz, a + r * k, sums + r * groups, scale[r], k, group,
                      y + r * n + b * LANES);
    }
    free(a), free(sums), free(scale);
    return 0;
}

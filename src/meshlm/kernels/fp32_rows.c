/* meshlm's fp32 products for decoding, compiled on the machine that runs it
   (meshlm.kernels.build, used by meshlm.kernels.fp32_rows).

   y (m, n) = x (m, k) W^T + b, with W (n, k) stored as meshlm.kernels.fp32_rows.as_blocks lays it
   out: P column blocks (P, k, w), block p holding columns p*w ... p*w + w - 1 (the last
   zero-padded), each block contiguous, w <= TILE. bias (n) may be NULL.

   Every output is one accumulator summed over j = 0 ... k-1 in order, then + b: the same
   operations for a row whatever m is and whichever rows share its pass, so a row's outputs do not
   depend on the batch, bit for bit (meshlm.kernels.fp32_rows checks it before use).

   Why a plain loop: a decoded token is a matrix-vector product bound by streaming the weights. A
   full block is TILE columns of k rows, read once, front to back, into TILE accumulators held in
   registers; a tile is four full blocks from four places of the matrix, blocks p, p + F/4,
   p + F/2 and p + 3F/4 of the F full ones (the rest one at a time after), read side by side, so
   each thread reads four streams at once (their 4 x TILE sums fill the 16 AVX2 registers; two
   rows at a time share each weight read, two blocks at a time). The tiles are split over
   `threads` OpenMP threads (the runtime torch's own kernels use). On a 2-core Zen 5 one block of
   128 columns at a time read the weights at 23-29 GB/s on every shape, where torch.bmm over a
   block per thread reads 14-29 depending on the block's width (docs/quantize.md); on a 2-core
   Zen 3 VM, where one core read 10.5 GB/s as one stream and 17.7 as four, four 32-column blocks
   at a time read 1.24-1.32x as fast at one thread and 1.09-1.15x at two. */
#include <stdint.h>
#include <string.h>
#include "rows.h"

#define TILE 32
#define PLACES 4
#define INLINE static inline __attribute__((always_inline))

/* `rows` rows x, x + k (1 or 2) through `count` full blocks (rows x count <= PLACES once inlined
   with constants, so the sums stay in registers): into y[q] + r * n, TILE columns each */
INLINE void full_blocks(const float *restrict x, const float *const *block, float *const *y,
                        int64_t k, int64_t n, const int rows, const int count) {
    float a[2][PLACES][TILE];
    for (int r = 0; r < rows; r++)
        for (int q = 0; q < count; q++)
            for (int t = 0; t < TILE; t++)
                a[r][q][t] = 0.0f;
    for (int64_t j = 0; j < k; j++) {
        const float x0 = x[j], x1 = rows > 1 ? x[k + j] : 0.0f;
        for (int q = 0; q < count; q++) {
            const float *w = block[q] + j * TILE;
#pragma omp simd
            for (int t = 0; t < TILE; t++) {
                a[0][q][t] += x0 * w[t];
                if (rows > 1)
                    a[1][q][t] += x1 * w[t];
            }
        }
    }
    for (int r = 0; r < rows; r++)
        for (int q = 0; q < count; q++)
            memcpy(y[q] + r * n, a[r][q], sizeof a[r][q]);
}

/* every row through `count` full blocks (PLACES, or 1): two rows against two blocks at a time, a
   last odd row against all of them */
INLINE void tile(const float *restrict x, const float *const *block, float *const *y, int64_t m,
                 int64_t k, int64_t n, const int count) {
    int64_t r = 0;
    for (; r + 2 <= m; r += 2)
        for (int q = 0; q < count; q += 2) {
            float *at[2] = {y[q] + r * n, count > 1 ? y[q + 1] + r * n : NULL};
            if (count > 1)
                full_blocks(x + r * k, block + q, at, k, n, 2, 2);
            else
                full_blocks(x + r * k, block + q, at, k, n, 2, 1);
        }
    if (r < m) {
        float *at[PLACES];
        for (int q = 0; q < count; q++)
            at[q] = y[q] + r * n;
        full_blocks(x + r * k, block, at, k, n, 1, count);
    }
}

/* one row over a narrow block (w < TILE columns), the first `cols` of them kept: the loop with the
   width known only at run time, kept apart from the full blocks' on purpose: their compile-time
   TILE is what lets the compiler hold the accumulators in registers */
static void narrow_row(const float *restrict x, const float *restrict block, float *restrict y,
                       int64_t k, int64_t w, int64_t cols) {
    float a[TILE];
    for (int64_t t = 0; t < w; t++)
        a[t] = 0.0f;
    for (int64_t j = 0; j < k; j++) {
        const float *row = block + j * w;
        float x0 = x[j];
        for (int64_t t = 0; t < w; t++)
            a[t] += x0 * row[t];
    }
    memcpy(y, a, cols * sizeof(float));
}

/* every row through a narrow block (w < TILE) or the last, padded one (computed in full, the kept
   columns copied): `cols` columns of y. Not inlined: beside the full blocks' loops it made the
   compiler keep their accumulators out of registers (1.3-1.8x slower, measured) */
__attribute__((noinline)) static void partial_block(const float *restrict x,
                                                    const float *restrict block,
                                                    float *restrict y, int64_t m, int64_t k,
                                                    int64_t w, int64_t n, int64_t cols) {
    float full[TILE];
    for (int64_t r = 0; r < m; r++) {
        if (w < TILE) {
            narrow_row(x + r * k, block, y + r * n, k, w, cols);
        } else {
            const float *blocks[1] = {block};
            float *at[1] = {full};
            full_blocks(x + r * k, blocks, at, k, n, 1, 1);
            memcpy(y + r * n, full, cols * sizeof(float));
        }
    }
}

int fp32_rows_product(const float *restrict x, const float *restrict blocks,
                      const float *restrict bias, float *restrict y, int64_t m, int64_t parts,
                      int64_t k, int64_t w, int64_t n, int threads) {
    if (w > TILE || w < 1)
        return 1;
    /* the F full blocks: tiles of PLACES (tile p: blocks p, p + part, ...), then the rest */
    const int64_t full = w == TILE ? n / TILE : 0, part = full / PLACES;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t p = 0; p < part; p++) {
        const float *block[PLACES];
        float *at[PLACES];
        for (int q = 0; q < PLACES; q++) {
            block[q] = blocks + (p + q * part) * k * TILE;
            at[q] = y + (p + q * part) * TILE;
        }
        tile(x, block, at, m, k, n, PLACES);
        for (int q = 0; q < PLACES; q++)
            add_bias(y, bias, (p + q * part) * TILE, TILE, m, n);
    }
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = PLACES * part; b < parts; b++) {
        const int64_t first = b * w, cols = n - first < w ? n - first : w;
        const float *block = blocks + b * k * w;
        float *at = y + first;
        if (b < full)
            tile(x, &block, &at, m, k, n, 1);
        else if (cols > 0)
            partial_block(x, block, y + first, m, k, w, n, cols);
        add_bias(y, bias, first, cols > 0 ? cols : 0, m, n);
    }
    return 0;
}

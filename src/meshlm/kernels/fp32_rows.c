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
   registers (two rows at a time share each weight read); the blocks are split over `threads`
   OpenMP threads (the runtime torch's own kernels use). On a 2-core Zen 5 this reads the weights
   at 23-29 GB/s on every shape, where torch.bmm over a block per thread reads 14-29 depending on
   the block's width (docs/quantize.md). */
#include <stdint.h>
#include <string.h>

#define TILE 128

/* one row over a full block: y[0 .. TILE) */
static void one_row(const float *restrict x, const float *restrict block, float *restrict y,
                    int64_t k) {
    float a[TILE];
    for (int t = 0; t < TILE; t++)
        a[t] = 0.0f;
    for (int64_t j = 0; j < k; j++) {
        const float *w = block + j * TILE;
        float x0 = x[j];
#pragma omp simd
        for (int t = 0; t < TILE; t++)
            a[t] += x0 * w[t];
    }
    memcpy(y, a, sizeof a);
}

/* rows x and x + k over a full block, each weight read once for both: y and y + n */
static void two_rows(const float *restrict x, const float *restrict block, float *restrict y,
                     int64_t k, int64_t n) {
    float a[TILE], b[TILE];
    for (int t = 0; t < TILE; t++) {
        a[t] = 0.0f;
        b[t] = 0.0f;
    }
    for (int64_t j = 0; j < k; j++) {
        const float *w = block + j * TILE;
        float x0 = x[j], x1 = x[k + j];
#pragma omp simd
        for (int t = 0; t < TILE; t++) {
            a[t] += x0 * w[t];
            b[t] += x1 * w[t];
        }
    }
    memcpy(y, a, sizeof a);
    memcpy(y + n, b, sizeof b);
}

/* one row over a narrow block (w < TILE columns), the first `cols` of them kept: one_row's loop
   with the width known only at run time, kept apart from it on purpose. one_row's compile-time
   TILE is what lets the compiler hold the accumulators in registers; a shared run-time width
   would lose that for the full blocks that carry nearly all the weights */
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

/* every row through a full block: into its TILE columns of y (n per row) */
static void full_block(const float *restrict x, const float *restrict block, float *restrict y,
                       int64_t m, int64_t k, int64_t n) {
    int64_t r = 0;
    for (; r + 2 <= m; r += 2)
        two_rows(x + r * k, block, y + r * n, k, n);
    if (r < m)
        one_row(x + r * k, block, y + r * n, k);
}

/* every row through a narrow block (w < TILE) or the last, padded one (computed in full, the kept
   columns copied): `cols` columns of y. Not inlined: beside full_block's loops it made the
   compiler keep full blocks' accumulators out of registers (1.3-1.8x slower, measured) */
__attribute__((noinline)) static void partial_block(const float *restrict x,
                                                    const float *restrict block,
                                                    float *restrict y, int64_t m, int64_t k,
                                                    int64_t w, int64_t n, int64_t cols) {
    float full[TILE];
    for (int64_t r = 0; r < m; r++) {
        if (w < TILE) {
            narrow_row(x + r * k, block, y + r * n, k, w, cols);
        } else {
            one_row(x + r * k, block, full, k);
            memcpy(y + r * n, full, cols * sizeof(float));
        }
    }
}

int fp32_rows_product(const float *restrict x, const float *restrict blocks,
                      const float *restrict bias, float *restrict y, int64_t m, int64_t parts,
                      int64_t k, int64_t w, int64_t n, int threads) {
    if (w > TILE || w < 1)
        return 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t p = 0; p < parts; p++) {
        int64_t first = p * w, cols = n - first < w ? n - first : w;
        if (cols <= 0)
            continue;
        if (w == TILE && cols == TILE)
            full_block(x, blocks + p * k * w, y + first, m, k, n);
        else
            partial_block(x, blocks + p * k * w, y + first, m, k, w, n, cols);
        if (bias)
            for (int64_t r = 0; r < m; r++)
                for (int64_t t = 0; t < cols; t++)
                    y[r * n + first + t] += bias[first + t];
    }
    return 0;
}

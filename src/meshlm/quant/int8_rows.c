/* meshlm's one-row int8 product, compiled on the machine that runs it (meshlm.quant.native).

   y[i] = sum_j w[i*k + j] * a[j] for i < n: the exact int32 sum of k int8 products (|sum| <=
   k * 128 * 128 fits int32 for k up to 131,071), the same integers torch._int_mm returns. The
   rows of w are split over `threads` OpenMP threads (the runtime torch's own kernels use); within
   a row the compiler vectorises the loop for this CPU (-march=native). A decoded token is a
   matrix-vector product bound by streaming w: this reads it at ~80% of a core's bandwidth on a
   Zen 5, where oneDNN's int8 kernel at one row reads ~60% (docs/quantize.md). */
#include <stdint.h>

void int8_row_product(const int8_t *restrict w, const int8_t *restrict a, int32_t *restrict y,
                      int64_t n, int64_t k, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < n; i++) {
        const int8_t *row = w + i * k;
        int32_t sum = 0;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < k; j++)
            sum += (int32_t)row[j] * (int32_t)a[j];
        y[i] = sum;
    }
}

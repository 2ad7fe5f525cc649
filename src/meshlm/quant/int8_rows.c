/* meshlm's one-row int8-activation product, compiled on the machine that runs it
   (meshlm.quant.native).

   For one fp32 activation row x (k) and int8 weights w (n, k), row-major:
       s    = max(max_j |x[j]| * (float)(1/127), 1e-30f)        the row's scale
       q[j] = nearbyint(x[j] / s)                                int8, in [-127, 127]
       y[i] = (float)(sum_j w[i*k + j] * q[j]) * s               the exact int32 sum, scaled
   Every step is the fp32 operation meshlm.quant.linear does with torch ops for
   other row counts (quantize_rows, then torch._int_mm, then the product by s), in IEEE
   arithmetic (no -ffast-math), so the results are the same bit for bit. |sum| <= k * 127 * 127
   fits int32 for k up to 133,000.

   The rows of w are split over `threads` OpenMP threads (the runtime torch's own kernels use);
   within a row the compiler vectorises the loop for this CPU (-march=native). A decoded token is
   a matrix-vector product bound by streaming w: this reads it at ~80% of a core's bandwidth on a
   Zen 5, where oneDNN's int8 kernel at one row reads ~60% (docs/quantize.md); and one call does
   what took eight tensor ops. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

int int8_row_product(const float *restrict x, const int8_t *restrict w, float *restrict y,
                     int64_t n, int64_t k, int threads) {
    float amax = 0.0f;
    for (int64_t j = 0; j < k; j++)
        amax = fmaxf(amax, fabsf(x[j]));
    float s = amax * (float)(1.0 / 127.0);
    s = s < 1e-30f ? 1e-30f : s;
    int8_t *q = malloc(k > 0 ? k : 1);
    if (!q)
        return 1;
    for (int64_t j = 0; j < k; j++)
        q[j] = (int8_t)nearbyintf(x[j] / s);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < n; i++) {
        const int8_t *row = w + i * k;
        int32_t sum = 0;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < k; j++)
            sum += (int32_t)row[j] * (int32_t)q[j];
        y[i] = (float)sum * s;
    }
    free(q);
    return 0;
}

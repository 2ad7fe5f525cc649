/* Pieces the row kernels share (fp32_rows.c, bf16_rows.c), included by each: a kernel is built
   from its own source and the headers of this folder it includes (meshlm.kernels.build keys its
   library by all of them). */
#ifndef MESHLM_ROWS_H
#define MESHLM_ROWS_H
#include <stdint.h>

/* the bias added to outputs first .. first + cols of each of y's m rows (n wide); none without
   one. Each kernel calls it in its parallel loop, by the thread that wrote those outputs. */
static inline void add_bias(float *restrict y, const float *restrict bias, int64_t first,
                            int64_t cols, int64_t m, int64_t n) {
    if (bias)
        for (int64_t r = 0; r < m; r++)
            for (int64_t t = 0; t < cols; t++)
                y[r * n + first + t] += bias[first + t];
}

#endif

/* RmsNorm rows for other kernels of the library (the few-row matmul fuses it). */
#ifndef ATB_NORM_H
#define ATB_NORM_H

#include <stdint.h>

/* rows r0..rows-1 of y = x / sqrt(mean(x^2) + eps) * (w + w_offset) with x = x (+ res,
 * stored rounded into sum when given); fp32 math, y rounded once to dt; w optional */
int atb_rms_norm_rows(const void *x, const void *res, void *sum, void *y, const void *w, int dt,
                      int w_dt, int64_t r0, int64_t rows, int64_t n, int64_t x_stride,
                      int64_t res_stride, int64_t sum_stride, int64_t y_stride, float eps,
                      float w_offset);

#endif

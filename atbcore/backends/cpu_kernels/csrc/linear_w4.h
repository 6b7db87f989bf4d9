/* The w4 matmul (linear_w4.c): its argument block, the job its panel tiles read and
 * the tiles themselves (linear_w4_tile.c: VNNI, AVX2 or plain C, the same sums). */
#ifndef ATB_LINEAR_W4_H
#define ATB_LINEAR_W4_H

#include "common.h"

#define W4_PANEL 32
#define W4_BLOCK 32
#define W4_BLOCK_BYTES 512
#define W4_MB 4 /* x rows per tile */

typedef struct {
    int64_t x, x_dt, x_stride, m, k, n;
    int64_t w, scales, zeros, group;   /* zeros 0: symmetric (z = 8) */
    int64_t bias, bias_dt;             /* bias 0: none */
    int64_t y, y_dt, y_stride, accumulate;
    int64_t norm, norm_w, norm_w_dt;   /* norm 1: RmsNorm x first (weight optional) */
    int64_t threads;
    double norm_eps;
    int64_t res, res_dt, res_stride;   /* res 0: none; else y = x W^T + bias + res */
} W4Args;

typedef struct {
    const W4Args *a;
    const int8_t *xq;  /* [m, nblk * 32] */
    const float *dx;   /* [m, nblk] */
    const int32_t *xsum; /* [m, nblk] */
    int64_t nblk, chunk_panels, pchunks, mblock;
} W4Job;

/* res[i * 32 + j] (mb rows from row m, one panel: codes wp, scales sp, zero points zp
 * or NULL) = sum over blocks of s dx (sum q x_q - z sum x_q) */
void atb_w4_tile(const W4Job *job, int mb, const uint8_t *wp, const uint16_t *sp,
                 const uint8_t *zp, int64_t m, float *res);

#endif

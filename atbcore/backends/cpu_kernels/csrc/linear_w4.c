/* Matmul on group-wise 4-bit weights (w4): y = x W^T (+ bias), W stored as 4-bit codes
 * q in [0, 15] with a scale s and a zero point z per output and group of G inputs
 * (W[n, k] = s (q - z)); z = 8 for every group when no zero points are given (the
 * symmetric form, Q4_0's information content), one per group otherwise (GPTQ/AWQ).
 *
 * Layout (packed by torch_linear_w4.pack_w4): outputs in 32-wide panels, K in blocks
 * of 32 (K padded to a multiple of G with codes whose x is zero). A block of a panel
 * is 512 bytes, 8 sub-blocks of 4 k; in sub-block kk, byte 4 j + t holds the code of
 * output j (low nibble) and output j + 16 (high nibble) at k = 4 kk + t, so one 64-byte
 * load masked and shifted gives the u8 operands of two VPDPBUSD (16 outputs x 4 k
 * each). Scales are fp16 [P, K/G, 32], zero points u8 [P, K/G, 32].
 *
 * The activations are quantized per row and block of 32 to int8 with an fp32 scale
 * (dx = absmax / 127, x_q = rint(x * 127 / absmax)), as llama.cpp does for Q4_0
 * (Q8_0 activations): the block's dot product is an exact int32 sum, the zero point
 * enters as z * sum(x_q), and each block adds s * dx * (sum - z sum(x_q)) in fp32.
 * The quantizer is panel_q8.c's (w8 reads the same blocks). */
#include <stdlib.h>
#include <string.h>

#include "gemm.h"
#include "linear_w4.h"
#include "norm.h"
#include "pool.h"

#define W4_MBLOCK 64 /* x rows per chunk of a many-row matmul */

#define PTR(v) ((const void *)(intptr_t)(v))

/* y[m, n0 .. n0+nv) from the fp32 sums r (bias, residual or accumulate, one rounding); NV a
 * constant for whole panels, so that r (just stored by the tile) is read back by
 * whole-vector loads, which the store forwards to (masked loads of a variable count
 * waited for the stores to retire: two thirds of a small matmul's time) */
static inline __attribute__((always_inline)) void emit_n(const W4Args *a, int64_t m, int64_t n0,
                                                         const float *r, int64_t NV) {
    float v[W4_PANEL], bb[W4_PANEL], yy[W4_PANEL];
    const float *bi = a->bias ? atb_load(PTR(a->bias), (int)a->bias_dt, n0, NV, bb) : NULL;
    const int64_t off = m * a->y_stride + n0;
    /* the addend: the residual rows (which may be y itself), else y when accumulating */
    const float *acc = a->res ? atb_load(PTR(a->res), (int)a->res_dt, m * a->res_stride + n0, NV, yy)
                       : a->accumulate ? atb_load(PTR(a->y), (int)a->y_dt, off, NV, yy) : NULL;
    /* one loop per term, the tests outside: a test inside let GCC if-convert the bias
     * and addend reads into masked loads from a NULL pointer, which AMD cores take as a
     * fault assist (hundreds of cycles each: half a 1-row matmul's time) */
    for (int64_t j = 0; j < NV; ++j) v[j] = r[j];
    if (bi)
        for (int64_t j = 0; j < NV; ++j) v[j] += bi[j];
    if (acc)
        for (int64_t j = 0; j < NV; ++j) v[j] = acc[j] + v[j];
    if (a->y_dt == ATB_F32) {
        float *d = (float *)PTR(a->y) + off;
        for (int64_t j = 0; j < NV; ++j) d[j] = v[j];
    } else {
        atb_store((void *)PTR(a->y), (int)a->y_dt, off, NV, v);
    }
}

static void w4_emit(const W4Args *a, int64_t m, int64_t n0, const float *r) {
    const int64_t nv = a->n - n0 < W4_PANEL ? a->n - n0 : W4_PANEL;
    if (nv == W4_PANEL)
        emit_n(a, m, n0, r, W4_PANEL);
    else
        emit_n(a, m, n0, r, nv);
}

/* chunk: panels [p0, p1) against x rows [m0, m0 + mblock) */
static void run_w4(void *ctx, int64_t chunk) {
    const W4Job *job = (const W4Job *)ctx;
    const W4Args *a = job->a;
    const int64_t np = (a->n + W4_PANEL - 1) / W4_PANEL, ng = job->nblk * W4_BLOCK / a->group;
    const int64_t pc = chunk % job->pchunks, m0 = chunk / job->pchunks * job->mblock;
    const int64_t M = m0 + job->mblock < a->m ? m0 + job->mblock : a->m;
    const int64_t p0 = pc * job->chunk_panels;
    const int64_t p1 = p0 + job->chunk_panels < np ? p0 + job->chunk_panels : np;
    const uint8_t *w = (const uint8_t *)PTR(a->w);
    const uint16_t *sc = (const uint16_t *)PTR(a->scales);
    const uint8_t *zs = (const uint8_t *)PTR(a->zeros);
    for (int64_t p = p0; p < p1; ++p) {
        const uint8_t *wp = w + p * job->nblk * W4_BLOCK_BYTES;
        const uint16_t *sp = sc + p * ng * W4_PANEL;
        const uint8_t *zp = zs ? zs + p * ng * W4_PANEL : NULL;
        for (int64_t m = m0; m < M; m += W4_MB) {
            const int mb = M - m < W4_MB ? (int)(M - m) : W4_MB;
            float res[W4_MB * W4_PANEL];
            atb_w4_tile(job, mb, wp, sp, zp, m, res);
            for (int i = 0; i < mb; ++i) w4_emit(a, m + i, p * W4_PANEL, res + i * W4_PANEL);
        }
    }
}

typedef struct {
    const W4Args *a;
    const void *x;
    int64_t xs, nblk;
    float *xf;
    int8_t *xq;
    float *dx;
    int32_t *xsum;
} QuantJob;

static void quant_rows(void *ctx, int64_t r0, int64_t r1) {
    const QuantJob *q = (const QuantJob *)ctx;
    const int64_t K = q->a->k, kp = q->nblk * W4_BLOCK;
    for (int64_t m = r0; m < r1; ++m) {
        float *row = q->xf + m * K;
        const float *xr = atb_load(q->x, (int)q->a->x_dt, m * q->xs, K, row);
        atb_q8_quantize_row(xr, K, q->nblk, q->xq + m * kp, q->dx + m * q->nblk,
                            q->xsum + m * q->nblk);
    }
}

/* Returns 0, ATB_ERR_ARGS for a bad call, ATB_ERR_NOMEM when the scratch fails. */
ATB_API int64_t atb_linear_w4(const W4Args *a) {
    if (!a || a->m < 0 || a->k <= 0 || a->n <= 0 || !a->x || !a->w || !a->scales || !a->y)
        return ATB_ERR_ARGS;
    if (a->group < W4_BLOCK || a->group % W4_BLOCK) return ATB_ERR_ARGS;
    if (a->x_dt < 0 || a->x_dt > ATB_F16 || a->y_dt < 0 || a->y_dt > ATB_F16) return ATB_ERR_ARGS;
    if (a->bias && (a->bias_dt < 0 || a->bias_dt > ATB_F16)) return ATB_ERR_ARGS;
    if (a->res && (a->res_dt < 0 || a->res_dt > ATB_F16 || a->res_stride < a->n)) return ATB_ERR_ARGS;
    if (a->m == 0) return 0;
    const int64_t M = a->m, K = a->k;
    const int64_t nblk = (K + a->group - 1) / a->group * (a->group / W4_BLOCK);
    const int64_t kp = nblk * W4_BLOCK;
    void *normed = NULL;
    const void *x = PTR(a->x);
    int64_t xs = a->x_stride;
    if (a->norm) { /* RmsNorm rows stored at x's dtype, as the separate kernel would */
        normed = malloc((size_t)(M * K * atb_dt_size((int)a->x_dt)));
        if (!normed) return ATB_ERR_NOMEM;
        atb_rms_norm_rows(x, NULL, NULL, normed, PTR(a->norm_w), (int)a->x_dt, (int)a->norm_w_dt, 0,
                          M, K, xs, 0, 0, K, (float)a->norm_eps, 0.f);
        x = normed;
        xs = K;
    }
    float *xf = (float *)malloc((size_t)(M * K) * sizeof(float));
    int8_t *xq = (int8_t *)malloc((size_t)(M * kp));
    float *dx = (float *)malloc((size_t)(M * nblk) * sizeof(float));
    int32_t *xsum = (int32_t *)malloc((size_t)(M * nblk) * sizeof(int32_t));
    int64_t rc = 0;
    if (!xf || !xq || !dx || !xsum) {
        rc = ATB_ERR_NOMEM;
        goto done;
    }
    int nth = (int)(a->threads > 0 ? a->threads : 1);
    {
        QuantJob qj = {a, x, xs, nblk, xf, xq, dx, xsum};
        atb_parallel_rows(quant_rows, &qj, M, M * K, nth);
    }
    W4Job job = {a, xq, dx, xsum, nblk, 0, 0, 0};
    const int64_t np = (a->n + W4_PANEL - 1) / W4_PANEL;
    if (np * nblk * W4_BLOCK_BYTES * ((M + W4_MB - 1) / W4_MB) < (64 << 10)) nth = 1;
    const int big = M > W4_MBLOCK;
    job.mblock = big ? W4_MBLOCK : M;
    const int64_t nmb = (M + job.mblock - 1) / job.mblock;
    const int64_t per_block = (8 * nth + nmb - 1) / nmb;
    job.chunk_panels = (np + per_block - 1) / per_block;
    job.pchunks = (np + job.chunk_panels - 1) / job.chunk_panels;
    if (big)
        atb_parallel_chunks_big(run_w4, &job, nmb * job.pchunks, nth);
    else
        atb_parallel_chunks(run_w4, &job, job.pchunks, nth);
done:
    free(xf);
    free(xq);
    free(dx);
    free(xsum);
    free(normed);
    return rc;
}

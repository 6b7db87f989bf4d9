/* RmsNorm / AddRmsNorm and LayerNorm / AddLayerNorm, one pass per call.
 *
 * Rows of n elements, contiguous inside a row, rows `*_stride` elements apart.
 * With a residual, sum = round(x + residual) is stored (if `sum` is given) and
 * normalised as stored, which is what the reference does. fp32 accumulation.
 */
#include "common.h"
#include "norm.h"
#include "pool.h"

/* s[0..m) = x + r for one block, rounded as stored in dt; writes `sum` if given */
static const float *add_block(const void *x, const void *r, void *sum, int dt, int64_t xo,
                              int64_t ro, int64_t so, int64_t m, float *bx, float *br) {
    const float *a = atb_load(x, dt, xo, m, bx);
    const float *b = atb_load(r, dt, ro, m, br);
    float *s = bx; /* a is bx or the source itself: elementwise in place is safe */
#pragma omp simd
    for (int64_t i = 0; i < m; ++i) s[i] = a[i] + b[i];
    atb_round_trip(dt, m, s);
    if (sum) atb_store(sum, dt, so, m, s);
    return s;
}

/* The argument block both norms take (Python packs it with struct "<16q2d"). */
typedef struct {
    int64_t x, res, sum, y, w, b;                 /* addresses; 0 = absent */
    int64_t dt, w_dt, b_dt, rows, n;
    int64_t x_stride, res_stride, sum_stride, y_stride, threads;
    double eps, w_offset;
} NormArgs;

int atb_rms_norm_rows(const void *x, const void *res, void *sum, void *y, const void *w, int dt,
                      int w_dt, int64_t r0, int64_t rows, int64_t n, int64_t x_stride, int64_t res_stride,
                    int64_t sum_stride, int64_t y_stride, float eps, float w_offset) {
    float bx[ATB_BLOCK], br[ATB_BLOCK], bw[ATB_BLOCK];
    for (int64_t r = r0; r < rows; ++r) {
        const int64_t xo = r * x_stride, ro = r * res_stride, so = r * sum_stride;
        float acc = 0.0f;
        for (int64_t j = 0; j < n; j += ATB_BLOCK) {
            int64_t m = n - j < ATB_BLOCK ? n - j : ATB_BLOCK;
            const float *v = res ? add_block(x, res, sum, dt, xo + j, ro + j, so + j, m, bx, br)
                                 : atb_load(x, dt, xo + j, m, bx);
#pragma omp simd reduction(+ : acc)
            for (int64_t i = 0; i < m; ++i) acc += v[i] * v[i];
        }
        const float inv = 1.0f / sqrtf(acc / (float)n + eps);
        /* the residual sum was stored rounded: re-read it (or recompute it when
         * the caller did not want it back) */
        for (int64_t j = 0; j < n; j += ATB_BLOCK) {
            int64_t m = n - j < ATB_BLOCK ? n - j : ATB_BLOCK;
            const float *v;
            if (!res) v = atb_load(x, dt, xo + j, m, bx);
            else if (sum) v = atb_load(sum, dt, so + j, m, bx);
            else v = add_block(x, res, NULL, dt, xo + j, ro + j, 0, m, bx, br);
            /* fp32: straight into y; else into bx (v is bx or the source: elementwise) */
            float *o = dt == ATB_F32 ? (float *)y + r * y_stride + j : bx;
            if (w) {
                const float *wf = atb_load(w, w_dt, j, m, bw);
#pragma omp simd
                for (int64_t i = 0; i < m; ++i) o[i] = v[i] * inv * (wf[i] + w_offset);
            } else {
#pragma omp simd
                for (int64_t i = 0; i < m; ++i) o[i] = v[i] * inv;
            }
            if (dt != ATB_F32) atb_store(y, dt, r * y_stride + j, m, o);
        }
    }
    return 0;
}

static int layer_norm(const void *x, const void *res, void *sum, void *y, const void *w,
                      const void *b, int dt, int w_dt, int b_dt, int64_t r0, int64_t rows, int64_t n,
                      int64_t x_stride, int64_t res_stride, int64_t sum_stride, int64_t y_stride,
                      float eps) {
    float bx[ATB_BLOCK], br[ATB_BLOCK], bw[ATB_BLOCK], bb[ATB_BLOCK];
    for (int64_t r = r0; r < rows; ++r) {
        const int64_t xo = r * x_stride, ro = r * res_stride, so = r * sum_stride;
        /* the (rounded) input this row normalises: x, or the stored sum */
        const void *src = x;
        int64_t src_o = xo;
        /* the mean is summed relative to the row's first value: an fp32 sum of
         * values with a large common offset (a mean of 100, say) would lose the
         * digits that the normalised output is made of */
        float acc = 0.0f, shift = 0.0f;
        for (int64_t j = 0; j < n; j += ATB_BLOCK) {
            int64_t m = n - j < ATB_BLOCK ? n - j : ATB_BLOCK;
            const float *v = res ? add_block(x, res, sum, dt, xo + j, ro + j, so + j, m, bx, br)
                                 : atb_load(x, dt, xo + j, m, bx);
            if (j == 0) shift = v[0];
#pragma omp simd reduction(+ : acc)
            for (int64_t i = 0; i < m; ++i) acc += v[i] - shift;
        }
        if (res && sum) {
            src = sum;
            src_o = so;
        }
        /* deviations are taken as (v - shift) - md: v - shift is exact for values near
         * the first one, so a large offset costs no digits here either */
        const float md = acc / (float)n;
        /* second pass for the variance: exact for rows with a large mean */
        float var = 0.0f;
        for (int64_t j = 0; j < n; j += ATB_BLOCK) {
            int64_t m = n - j < ATB_BLOCK ? n - j : ATB_BLOCK;
            const float *v = (res && !sum) ? add_block(x, res, NULL, dt, xo + j, ro + j, 0, m, bx, br)
                                           : atb_load(src, dt, src_o + j, m, bx);
#pragma omp simd reduction(+ : var)
            for (int64_t i = 0; i < m; ++i) {
                const float dv = (v[i] - shift) - md;
                var += dv * dv;
            }
        }
        const float inv = 1.0f / sqrtf(var / (float)n + eps);
        for (int64_t j = 0; j < n; j += ATB_BLOCK) {
            int64_t m = n - j < ATB_BLOCK ? n - j : ATB_BLOCK;
            const float *v = (res && !sum) ? add_block(x, res, NULL, dt, xo + j, ro + j, 0, m, bx, br)
                                           : atb_load(src, dt, src_o + j, m, bx);
            float *o = dt == ATB_F32 ? (float *)y + r * y_stride + j : bx;
            const float *wf = w ? atb_load(w, w_dt, j, m, bw) : NULL;
            const float *bf = b ? atb_load(b, b_dt, j, m, bb) : NULL;
            if (wf && bf) {
#pragma omp simd
                for (int64_t i = 0; i < m; ++i) o[i] = ((v[i] - shift) - md) * inv * wf[i] + bf[i];
            } else if (wf) {
#pragma omp simd
                for (int64_t i = 0; i < m; ++i) o[i] = ((v[i] - shift) - md) * inv * wf[i];
            } else if (bf) {
#pragma omp simd
                for (int64_t i = 0; i < m; ++i) o[i] = ((v[i] - shift) - md) * inv + bf[i];
            } else {
#pragma omp simd
                for (int64_t i = 0; i < m; ++i) o[i] = ((v[i] - shift) - md) * inv;
            }
            if (dt != ATB_F32) atb_store(y, dt, r * y_stride + j, m, o);
        }
    }
    return 0;
}

#define P(v) ((void *)(intptr_t)(v))

static void rms_rows(void *ctx, int64_t r0, int64_t r1) {
    const NormArgs *a = (const NormArgs *)ctx;
    atb_rms_norm_rows(P(a->x), P(a->res), P(a->sum), P(a->y), P(a->w), (int)a->dt, (int)a->w_dt,
                      r0, r1, a->n, a->x_stride, a->res_stride, a->sum_stride, a->y_stride,
                      (float)a->eps, (float)a->w_offset);
}

static void layer_rows(void *ctx, int64_t r0, int64_t r1) {
    const NormArgs *a = (const NormArgs *)ctx;
    layer_norm(P(a->x), P(a->res), P(a->sum), P(a->y), P(a->w), P(a->b), (int)a->dt,
               (int)a->w_dt, (int)a->b_dt, r0, r1, a->n, a->x_stride, a->res_stride,
               a->sum_stride, a->y_stride, (float)a->eps);
}

/* y = x / sqrt(mean(x^2) + eps) * (w + w_offset), x = x (+ residual); w optional */
ATB_API int64_t atb_rms_norm(const void *args) {
    NormArgs a;
    memcpy(&a, args, sizeof a);
    if (a.n <= 0 || a.rows < 0 || !a.x || !a.y) return ATB_ERR_ARGS;
    atb_parallel_rows(rms_rows, &a, a.rows, a.rows * a.n, (int)a.threads);
    return 0;
}

/* y = (x - mean) / sqrt(var + eps) * w + b, x = x (+ residual); w, b optional */
ATB_API int64_t atb_layer_norm(const void *args) {
    NormArgs a;
    memcpy(&a, args, sizeof a);
    if (a.n <= 0 || a.rows < 0 || !a.x || !a.y) return ATB_ERR_ARGS;
    atb_parallel_rows(layer_rows, &a, a.rows, a.rows * a.n, (int)a.threads);
    return 0;
}

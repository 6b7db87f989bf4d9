/* Softmax over the last axis, with the ScaledMaskedSoftmax extras:
 *   y = softmax(x * scale + mask)   (mask additive float, or bool: 0 = -inf)
 * and a bottom-right causal mask over the last two axes [..., Sq, n].
 *
 * x rows are `x_stride` elements apart, described by up to ATB_SM_DIMS leading
 * dims so a broadcast mask is read through its own strides (0 on broadcast
 * dims) without being expanded in memory. A row with every element masked
 * gives zeros when empty_rows_zero, else NaN (the plain mathematical result).
 */
#include "common.h"

#define ATB_SM_DIMS 8
#define ATB_SM_STACK 4096

typedef struct {
    int64_t x, y, mask;  /* addresses; mask 0 = absent */
    int64_t dt, mask_dt, rows, n, x_stride, y_stride;
    int64_t causal, sq, empty_rows_zero, nd;
    int64_t lead[ATB_SM_DIMS], mask_strides[ATB_SM_DIMS];
    int64_t mask_last_stride;
    double scale;
} SoftmaxArgs;

#define P(v) ((void *)(intptr_t)(v))

/* the additive or boolean mask of one row, folded into z */
static void add_mask(const SoftmaxArgs *a, int64_t r, float *z) {
    int64_t off = 0, rest = r;
    for (int64_t d = a->nd - 1; d >= 0; --d) {
        off += (rest % a->lead[d]) * a->mask_strides[d];
        rest /= a->lead[d];
    }
    const int64_t n = a->n, ls = a->mask_last_stride;
    if (a->mask_dt == ATB_BOOL) {
        const uint8_t *m = (const uint8_t *)P(a->mask) + off;
        for (int64_t j = 0; j < n; ++j) z[j] = m[j * ls] ? z[j] : -INFINITY;
        return;
    }
    if (ls == 1) {
        float buf[ATB_BLOCK];
        for (int64_t j = 0; j < n; j += ATB_BLOCK) {
            int64_t m = n - j < ATB_BLOCK ? n - j : ATB_BLOCK;
            const float *mv = atb_load(P(a->mask), (int)a->mask_dt, off + j, m, buf);
#pragma omp simd
            for (int64_t i = 0; i < m; ++i) z[j + i] += mv[i];
        }
        return;
    }
    for (int64_t j = 0; j < n; ++j) { /* a mask broadcast along the row: one value */
        float one;
        z[j] += *atb_load(P(a->mask), (int)a->mask_dt, off + j * ls, 1, &one);
    }
}

ATB_API int64_t atb_softmax(const void *args) {
    SoftmaxArgs a;
    memcpy(&a, args, sizeof a);
    if (!a.x || !a.y || a.n <= 0 || a.rows < 0 || a.nd < 0 || a.nd > ATB_SM_DIMS ||
        (a.causal && a.sq <= 0))
        return ATB_ERR_ARGS;
    const int dt = (int)a.dt;
    const int64_t n = a.n;
    float stack[ATB_SM_STACK];
    float *z = n <= ATB_SM_STACK ? stack : (float *)malloc((size_t)n * sizeof(float));
    if (!z) return ATB_ERR_NOMEM;
    const float scale = (float)a.scale;
    for (int64_t r = 0; r < a.rows; ++r) {
        for (int64_t j = 0; j < n; j += ATB_BLOCK) {
            int64_t m = n - j < ATB_BLOCK ? n - j : ATB_BLOCK;
            const float *v = atb_load(P(a.x), dt, r * a.x_stride + j, m, z + j);
#pragma omp simd
            for (int64_t i = 0; i < m; ++i) z[j + i] = v[i] * scale;
        }
        if (a.mask) add_mask(&a, r, z);
        if (a.causal) { /* query i (row r of its [Sq, n] block) sees keys j <= i + n - Sq */
            int64_t last = r % a.sq + n - a.sq;
            for (int64_t j = last + 1 < 0 ? 0 : last + 1; j < n; ++j) z[j] = -INFINITY;
        }
        float mx = -INFINITY;
#pragma omp simd reduction(max : mx)
        for (int64_t j = 0; j < n; ++j) mx = z[j] > mx ? z[j] : mx;
        /* fp32: exponentials go straight into y (x was read into z already) */
        float *o = dt == ATB_F32 ? (float *)P(a.y) + r * a.y_stride : z;
        /* the max skips NaN: a row whose only visible values are NaN is not empty,
         * it is NaN (as torch gives), so look before zeroing it */
        int empty = mx == -INFINITY && a.empty_rows_zero;
        for (int64_t j = 0; empty && j < n; ++j) empty = z[j] == z[j];
        if (empty) {
            memset(o, 0, (size_t)n * sizeof(float));
        } else {
            float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int64_t j = 0; j < n; ++j) {
                o[j] = atb_expf(z[j] - mx);
                sum += o[j];
            }
            const float inv = 1.0f / sum;
#pragma omp simd
            for (int64_t j = 0; j < n; ++j) o[j] *= inv;
        }
        if (dt != ATB_F32) atb_store(P(a.y), dt, r * a.y_stride, n, z);
    }
    if (z != stack) free(z);
    return 0;
}

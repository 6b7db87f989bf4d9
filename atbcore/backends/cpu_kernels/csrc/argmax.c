/* Row argmax (greedy sampling): out[r] = the first index of the row's maximum, a
 * NaN counting as the maximum (torch.argmax's rule: the first NaN wins). fp32,
 * bf16 or fp16 rows of n elements; two passes over each row (the maximum, then
 * its first position), rows split over the pool for big calls. */
#include "common.h"
#include "pool.h"

typedef struct {
    int64_t x, out;           /* addresses: rows, int64 [rows] */
    int64_t dt, rows, n, x_stride, threads;
} ArgmaxArgs;

#define P(v) ((void *)(intptr_t)(v))

static int64_t row_argmax(const ArgmaxArgs *a, int64_t r) {
    float buf[ATB_BLOCK];
    float mx = -INFINITY;
    int nan = 0;
    for (int64_t j = 0; j < a->n && !nan; j += ATB_BLOCK) {
        int64_t m = a->n - j < ATB_BLOCK ? a->n - j : ATB_BLOCK;
        const float *v = atb_load(P(a->x), (int)a->dt, r * a->x_stride + j, m, buf);
        float bm = -INFINITY;
        int bn = 0;
#pragma omp simd reduction(max : bm) reduction(| : bn)
        for (int64_t i = 0; i < m; ++i) {
            bm = v[i] > bm ? v[i] : bm;
            bn |= v[i] != v[i];
        }
        mx = bm > mx ? bm : mx;
        nan = bn;
    }
    for (int64_t j = 0; j < a->n; j += ATB_BLOCK) {
        int64_t m = a->n - j < ATB_BLOCK ? a->n - j : ATB_BLOCK;
        const float *v = atb_load(P(a->x), (int)a->dt, r * a->x_stride + j, m, buf);
        for (int64_t i = 0; i < m; ++i)
            if (nan ? v[i] != v[i] : v[i] == mx) return j + i;
    }
    return 0; /* every element -inf: the first */
}

static void argmax_rows(void *ctx, int64_t r0, int64_t r1) {
    const ArgmaxArgs *a = (const ArgmaxArgs *)ctx;
    for (int64_t r = r0; r < r1; ++r) ((int64_t *)P(a->out))[r] = row_argmax(a, r);
}

ATB_API int64_t atb_argmax(const void *args) {
    ArgmaxArgs a;
    memcpy(&a, args, sizeof a);
    if (!a.x || !a.out || a.rows < 0 || a.n <= 0 || a.dt < 0 || a.dt > ATB_F16) return ATB_ERR_ARGS;
    atb_parallel_rows(argmax_rows, &a, a.rows, a.rows * a.n, (int)a.threads);
    return 0;
}

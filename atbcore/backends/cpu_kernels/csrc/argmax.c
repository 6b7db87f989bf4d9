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

typedef struct {
    const ArgmaxArgs *a;
    int64_t per;
} ArgmaxJob;

static void argmax_chunk(void *ctx, int64_t c) {
    const ArgmaxJob *j = (const ArgmaxJob *)ctx;
    int64_t r0 = c * j->per, r1 = r0 + j->per < j->a->rows ? r0 + j->per : j->a->rows;
    for (int64_t r = r0; r < r1; ++r) ((int64_t *)P(j->a->out))[r] = row_argmax(j->a, r);
}

ATB_API int64_t atb_argmax(const void *args) {
    ArgmaxArgs a;
    memcpy(&a, args, sizeof a);
    if (!a.x || !a.out || a.rows < 0 || a.n <= 0 || a.dt < 0 || a.dt > ATB_F16) return ATB_ERR_ARGS;
    int nth = a.threads > 1 && a.rows > 1 && a.rows * a.n >= (64 << 10) ? (int)a.threads : 1;
    ArgmaxJob j = {&a, nth > 1 ? (a.rows + nth - 1) / nth : a.rows};
    if (a.rows == 0) return 0;
    atb_parallel_chunks(argmax_chunk, &j, (a.rows + j.per - 1) / j.per, nth);
    return 0;
}

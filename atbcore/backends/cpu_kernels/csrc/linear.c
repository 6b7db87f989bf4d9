/* Few-row matmul (decode GEMV):  y[m, n] = (sum_k x[m, k] w[n, k]) * scale[n] + bias[n]  (+ y[m, n] when accumulating)
 *
 * w is [N, K] with unit-stride rows (nn.Linear's layout) in fp32, bf16, fp16 or
 * int8 (int8 with a per-output-channel fp32 scale); x is fp32/bf16/fp16 and is
 * read as fp32 (against int8 weights: as int8 blocks of 32, see panel_q8.c); the sums
 * are fp32 and y is rounded once to its dtype. Decoding
 * reads every weight once per token, so this is memory bound: the rows of w are
 * split across the pool's threads in chunks, each weight row streams once and
 * each of its loads feeds up to 4 activation rows (16 accumulators in registers).
 *
 * AVX-512 (x86-64-v4 build): intrinsics, bf16/int8 widened to fp32 in registers.
 * Other builds: plain loops the compiler vectorises. With LinArgs.packed the
 * weight is in 32-output panels instead and panel.c runs it (at any row count).
 */
#include "act.h"
#include "gemm.h"
#include "linear.h"
#include "norm.h"
#include "pool.h"

/* up to this many x rows every weight row streams alone (bandwidth bound); more
 * rows take the 4 x 4 tiles (compute bound) */
#define ATB_GEMV_ROWS 4
/* the many-row tiles prefetch the weight rows this far ahead (one 4-row group),
 * spread over all the x tiles of a group: 16 rows x the default model's weights
 * streamed from DRAM 11.9 -> 9.5 ms per step (prefetch only during the first x
 * tile: 11.9; 8 rows ahead: 10.0; 24: 11.6; into L2 instead of L1: 10.6-10.9) */
#define ATB_PREFETCH_ROWS 4

#ifdef ATB_LIN_AVX512
/* res[i] = dot(x row i, the weight row wr) for MB activation rows. One weight row
 * at a time: the row streams sequentially (measured here: 20 GB/s from one core,
 * against 11 GB/s when four rows are read side by side), four vectors per step
 * keep four independent FMA chains per activation row. */
static inline __attribute__((always_inline)) void tile(int MB, int wdt, const float *const *xr,
                                                       const uint8_t *wr, int64_t K,
                                                       float res[4]) {
    const int64_t es = wsize(wdt);
    __m512 acc[4][4];
    for (int i = 0; i < MB; ++i)
        for (int u = 0; u < 4; ++u) acc[i][u] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 64 <= K; k += 64) {
        __m512 w0 = loadw(wdt, wr + k * es, 0, 1), w1 = loadw(wdt, wr + (k + 16) * es, 0, 1);
        __m512 w2 = loadw(wdt, wr + (k + 32) * es, 0, 1), w3 = loadw(wdt, wr + (k + 48) * es, 0, 1);
        for (int i = 0; i < MB; ++i) {
            acc[i][0] = _mm512_fmadd_ps(_mm512_loadu_ps(xr[i] + k), w0, acc[i][0]);
            acc[i][1] = _mm512_fmadd_ps(_mm512_loadu_ps(xr[i] + k + 16), w1, acc[i][1]);
            acc[i][2] = _mm512_fmadd_ps(_mm512_loadu_ps(xr[i] + k + 32), w2, acc[i][2]);
            acc[i][3] = _mm512_fmadd_ps(_mm512_loadu_ps(xr[i] + k + 48), w3, acc[i][3]);
        }
    }
    for (; k < K; k += 16) {
        int full = K - k >= 16;
        __mmask16 mk = full ? (__mmask16)0xffff : (__mmask16)((1u << (K - k)) - 1u);
        __m512 w0 = loadw(wdt, wr + k * es, mk, full);
        for (int i = 0; i < MB; ++i)
            acc[i][0] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mk, xr[i] + k), w0, acc[i][0]);
    }
    for (int i = 0; i < MB; ++i)
        res[i] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[i][0], acc[i][1]),
                                                    _mm512_add_ps(acc[i][2], acc[i][3])));
}

/* res[i * 4 + j] = dot(x row i, weight row j) for MB x rows and 4 weight rows: the
 * many-row tile (batched decoding), compute rather than bandwidth bound: 16
 * accumulators, 8 loads per 16 FMAs, the weight rows re-read from L1 by the
 * next x rows. */
static inline __attribute__((always_inline)) void tile4(int MB, int wdt, const float *const *xr,
                                                        const uint8_t *const *wr, int64_t K,
                                                        const uint8_t *pf, int64_t pfs, int npf,
                                                        float res[16]) {
    const int64_t es = wsize(wdt);
    __m512 acc[16];
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        /* weight rows further on, one cache line each per step, while these compute */
        for (int j = 0; j < npf; ++j) _mm_prefetch((const char *)pf + j * pfs + k * es, _MM_HINT_T0);
        __m512 w0 = loadw(wdt, wr[0] + k * es, 0, 1), w1 = loadw(wdt, wr[1] + k * es, 0, 1);
        __m512 w2 = loadw(wdt, wr[2] + k * es, 0, 1), w3 = loadw(wdt, wr[3] + k * es, 0, 1);
        for (int i = 0; i < MB; ++i) {
            __m512 xv = _mm512_loadu_ps(xr[i] + k);
            acc[i * 4 + 0] = _mm512_fmadd_ps(xv, w0, acc[i * 4 + 0]);
            acc[i * 4 + 1] = _mm512_fmadd_ps(xv, w1, acc[i * 4 + 1]);
            acc[i * 4 + 2] = _mm512_fmadd_ps(xv, w2, acc[i * 4 + 2]);
            acc[i * 4 + 3] = _mm512_fmadd_ps(xv, w3, acc[i * 4 + 3]);
        }
    }
    if (k < K) {
        __mmask16 mk = (__mmask16)((1u << (K - k)) - 1u);
        __m512 w0 = loadw(wdt, wr[0] + k * es, mk, 0), w1 = loadw(wdt, wr[1] + k * es, mk, 0);
        __m512 w2 = loadw(wdt, wr[2] + k * es, mk, 0), w3 = loadw(wdt, wr[3] + k * es, mk, 0);
        for (int i = 0; i < MB; ++i) {
            __m512 xv = _mm512_maskz_loadu_ps(mk, xr[i] + k);
            acc[i * 4 + 0] = _mm512_fmadd_ps(xv, w0, acc[i * 4 + 0]);
            acc[i * 4 + 1] = _mm512_fmadd_ps(xv, w1, acc[i * 4 + 1]);
            acc[i * 4 + 2] = _mm512_fmadd_ps(xv, w2, acc[i * 4 + 2]);
            acc[i * 4 + 3] = _mm512_fmadd_ps(xv, w3, acc[i * 4 + 3]);
        }
    }
    __m512 v[16];
    for (int i = 0; i < 16; ++i) v[i] = acc[i];
    _mm512_storeu_ps(res, atb_reduce16(v));
}
#else
static inline __attribute__((always_inline)) void tile(int MB, int wdt, const float *const *xr,
                                                       const uint8_t *wr, int64_t K,
                                                       float res[4]) {
    for (int i = 0; i < MB; ++i) {
        const float *x = xr[i];
        float s = 0.0f;
#pragma omp simd reduction(+ : s)
        for (int64_t k = 0; k < K; ++k) s += x[k] * wval(wdt, wr, k);
        res[i] = s;
    }
}

static inline __attribute__((always_inline)) void tile4(int MB, int wdt, const float *const *xr,
                                                        const uint8_t *const *wr, int64_t K,
                                                        const uint8_t *pf, int64_t pfs, int npf,
                                                        float res[16]) {
    (void)pf;
    (void)pfs;
    (void)npf;
    for (int j = 0; j < 4; ++j) {
        float r[4];
        tile(MB, wdt, xr, wr[j], K, r);
        for (int i = 0; i < MB; ++i) res[i * 4 + j] = r[i];
    }
}
#endif

#define ATB_BY_MB_WDT(CALL)                                          \
    switch (mb) {                                                    \
    case 1: ATB_BY_WDT(1, CALL) break;                               \
    case 2: ATB_BY_WDT(2, CALL) break;                               \
    case 3: ATB_BY_WDT(3, CALL) break;                               \
    default: ATB_BY_WDT(4, CALL) break;                              \
    }

static void tile_rt(int mb, int wdt, const float *const *xr, const uint8_t *wr, int64_t K,
                    float res[4]) {
#define ATB_TILE(MB, W) tile(MB, W, xr, wr, K, res)
    ATB_BY_MB_WDT(ATB_TILE)
#undef ATB_TILE
}

static void tile4_rt(int mb, int wdt, const float *const *xr, const uint8_t *const *wr,
                     int64_t K, const uint8_t *pf, int64_t pfs, int npf, float res[16]) {
#define ATB_TILE4(MB, W) tile4(MB, W, xr, wr, K, pf, pfs, npf, res)
    ATB_BY_MB_WDT(ATB_TILE4)
#undef ATB_TILE4
}

/* the 4 x 4 tile res[i * 4 + j] into y[m + i, n + j]: fp32 outputs (and bias)
 * four at a time, else element by element */
static inline void emit4(const LinArgs *a, int64_t m, int64_t n, int mb, const float res[16]) {
    if (a->y_dt != ATB_F32 || (a->bias && a->bias_dt != ATB_F32) ||
        (a->res && a->res_dt != ATB_F32)) {
        for (int i = 0; i < mb; ++i)
            for (int j = 0; j < 4; ++j) emit(a, m + i, n + j, res[i * 4 + j]);
        return;
    }
    const float *sc = a->scale ? (const float *)P(a->scale) + n : NULL;
    const float *bi = a->bias ? (const float *)P(a->bias) + n : NULL;
    for (int i = 0; i < mb; ++i) {
        float *y = (float *)P(a->y) + (m + i) * a->y_stride + n;
        const float *r = a->res ? (const float *)P(a->res) + (m + i) * a->res_stride + n
                                : (a->accumulate ? y : NULL);
        float v[4];
        for (int j = 0; j < 4; ++j) {
            v[j] = res[i * 4 + j];
            if (sc) v[j] *= sc[j];
            if (bi) v[j] += bi[j];
            if (r) v[j] += r[j];
        }
        memcpy(y, v, sizeof v);
    }
}

/* y[0, n0..n1) for one x row: no per-row dispatch, fp32 stores direct */
static inline __attribute__((always_inline)) void gemv1(int wdt, const LinArgs *a,
                                                        const float *x, const uint8_t *w,
                                                        int64_t wrow, int64_t K, int64_t n0,
                                                        int64_t n1) {
    const float *xr[4] = {x, x, x, x};
    const int fast = a->y_dt == ATB_F32 && !a->accumulate && !a->bias && !a->res;
    const float *sc = (const float *)P(a->scale);
    float *y = (float *)P(a->y);
    for (int64_t n = n0; n < n1; ++n) {
        float r[4];
        tile(1, wdt, xr, w + n * wrow, K, r);
        if (fast)
            y[n] = sc ? r[0] * sc[n] : r[0];
        else
            emit(a, 0, n, r[0]);
    }
}

static void run_rows(void *ctx, int64_t chunk) {
    const Job *job = (const Job *)ctx;
    const LinArgs *a = job->a;
    const int64_t N = a->n, K = a->k, M = a->m;
    int64_t n0 = chunk * job->chunk_rows;
    int64_t n1 = n0 + job->chunk_rows < N ? n0 + job->chunk_rows : N;
    const int wdt = (int)a->w_dt;
    const int64_t wrow = a->w_stride * wsize(wdt);
    const uint8_t *w = (const uint8_t *)P(a->w);
    int64_t n = n0;
    if (M > ATB_GEMV_ROWS) { /* many rows: 4 x 4 tiles, weight rows re-read from L1 */
        const int passes = (int)((M + 3) / 4);
        for (; n + 4 <= n1; n += 4) {
            const uint8_t *wr[4] = {w + n * wrow, w + (n + 1) * wrow, w + (n + 2) * wrow,
                                    w + (n + 3) * wrow};
            for (int64_t m = 0; m < M; m += 4) {
                int mb = M - m < 4 ? (int)(M - m) : 4;
                const float *xr[4];
                for (int i = 0; i < 4; ++i) xr[i] = job->xf + (m + (i < mb ? i : mb - 1)) * job->xs;
                float res[16];
                /* the x tiles share the prefetch of the weight rows ATB_PREFETCH_ROWS further on
                 * (the tiles after the first re-read these rows from L1) */
                int per = (4 + passes - 1) / passes, first = (int)(m / 4) * per;
                int npf = first >= 4 ? 0 : (4 - first < per ? 4 - first : per);
                if (n + ATB_PREFETCH_ROWS + first + npf > N) npf = 0;
                tile4_rt(mb, wdt, xr, wr, K, npf ? wr[0] + (ATB_PREFETCH_ROWS + first) * wrow : NULL, wrow, npf, res);
                emit4(a, m, n, mb, res);
            }
        }
    }
    if (M == 1) { /* batch-1 decode: the row loop specialised per weight dtype */
        switch (wdt) {
        case W_F32: gemv1(W_F32, a, job->xf, w, wrow, K, n, n1); break;
        case W_BF16: gemv1(W_BF16, a, job->xf, w, wrow, K, n, n1); break;
        case W_F16: gemv1(W_F16, a, job->xf, w, wrow, K, n, n1); break;
        default: gemv1(W_I8, a, job->xf, w, wrow, K, n, n1); break;
        }
        return;
    }
    for (; n < n1; ++n) { /* few rows (decode): one weight row streams at a time */
        for (int64_t m = 0; m < M; m += 4) {
            int mb = M - m < 4 ? (int)(M - m) : 4;
            const float *xr[4];
            for (int i = 0; i < 4; ++i) xr[i] = job->xf + (m + (i < mb ? i : mb - 1)) * job->xs;
            float res[4];
            tile_rt(mb, wdt, xr, w + n * wrow, K, res);
            for (int i = 0; i < mb; ++i) emit(a, m + i, n, res[i]);
        }
    }
}

/* rows [r0, r1) of the RmsNorm'd copy of x (LinArgs.norm) */
typedef struct {
    const LinArgs *a;
    const void *x;
    int64_t xs;
    void *normed; /* [m, k] at x's dtype */
} NormJob;

static void norm_rows(void *ctx, int64_t r0, int64_t r1) {
    const NormJob *j = (const NormJob *)ctx;
    const LinArgs *a = j->a;
    atb_rms_norm_rows(j->x, NULL, NULL, j->normed, P(a->norm_w), (int)a->x_dt, (int)a->norm_w_dt,
                      r0, r1, a->k, j->xs, 0, 0, a->k, (float)a->norm_eps, (float)a->norm_offset);
}

/* Returns 0, ATB_ERR_ARGS for a bad call, ATB_ERR_NOMEM when x cannot be widened. */
ATB_API int64_t atb_linear_rows(const LinArgs *a) {
    if (!a || a->m < 0 || a->k <= 0 || a->n <= 0 || !a->x || !a->w || !a->y) return ATB_ERR_ARGS;
    if (a->w_dt != W_F32 && a->w_dt != W_BF16 && a->w_dt != W_F16 && a->w_dt != W_I8)
        return ATB_ERR_ARGS;
    if (a->x_dt < 0 || a->x_dt > ATB_F16 || a->y_dt < 0 || a->y_dt > ATB_F16) return ATB_ERR_ARGS;
    if (a->res && (a->accumulate || a->res_dt < 0 || a->res_dt > ATB_F16)) return ATB_ERR_ARGS;
    /* gated (act(gate) * up in the epilogue): float panels of 2n outputs, n whole panels,
     * no other addend */
    if (a->gated && (a->gated < 0 || !a->packed || a->w_dt == W_I8 || a->scale || a->res ||
                     a->accumulate || a->n != 32 * a->gated || a->act < 0 || a->act > ACT_NONE))
        return ATB_ERR_ARGS;
    if (a->m == 0) return 0;
    Job job = {a, NULL, a->x_stride, 0};
    float *tmp = NULL;
    const void *x = P(a->x);
    int64_t xs = a->x_stride;
    void *normed = NULL;
    int nth = (int)(a->threads > 0 ? a->threads : 1);
    if (a->norm) { /* RmsNorm rows stored at x's dtype, as the separate kernel would */
        normed = malloc((size_t)(a->m * a->k * atb_dt_size((int)a->x_dt)));
        if (!normed) return ATB_ERR_NOMEM;
        /* over the pool: a prefill's rows (thousands) on one thread left the other
         * cores idle for milliseconds before every normed matmul */
        NormJob nj = {a, x, xs, normed};
        atb_parallel_rows(norm_rows, &nj, a->m, a->m * a->k, nth);
        x = normed;
        xs = a->k;
        job.xs = xs;
    }
    int64_t bytes = a->n * a->k * wsize((int)a->w_dt) * ((a->m + 3) / 4);
    if (bytes < (64 << 10)) nth = 1;
    /* a bf16 prefill GEMM on bf16 panels: VDPBF16PS where the CPU has it (gemm_bf16.c) */
    if (a->m > ATB_GEMM_MBLOCK && atb_linear_bf16(a, x, xs, nth) == 0) {
        free(normed);
        return 0;
    }
    if (a->x_dt == ATB_F32) {
        job.xf = (const float *)x;
    } else {
        tmp = (float *)malloc((size_t)(a->m * a->k) * sizeof(float));
        if (!tmp) {
            free(normed);
            return ATB_ERR_NOMEM;
        }
        for (int64_t m = 0; m < a->m; ++m) atb_load(x, (int)a->x_dt, m * xs, a->k, tmp + m * a->k);
        job.xf = tmp;
        job.xs = a->k;
    }
    if (a->w_dt == W_I8 && !a->packed) { /* w8 reads x as int8 blocks of 32 (panel_q8.c) */
        float *xr = (float *)malloc((size_t)(a->m * a->k) * sizeof(float));
        if (!xr) {
            free(tmp);
            free(normed);
            return ATB_ERR_NOMEM;
        }
        for (int64_t m = 0; m < a->m; ++m) atb_q8_round_row(job.xf + m * job.xs, a->k, xr + m * a->k);
        free(tmp);
        tmp = xr;
        job.xf = xr;
        job.xs = a->k;
    }
    /* chunks of >= 16 rows (whole cache lines of y), about 8 per thread so a late
     * or busy thread's share is picked up by the others; one chunk when the
     * whole matmul is small (waking a worker costs a few microseconds) */
    if (a->packed && a->w_dt == W_I8) { /* int8 activations: panel_q8.c */
        const int rc = atb_linear_panels_q8(a, job.xf, job.xs, nth);
        free(tmp);
        free(normed);
        return rc;
    }
    if (a->packed) { /* 32-output panels: panel.c */
        atb_linear_panels(&job, nth);
        free(tmp);
        free(normed);
        return 0;
    }
    int64_t per = (a->n + 8 * nth - 1) / (8 * nth);
    job.chunk_rows = (per < 16 ? 16 : (per + 15) / 16 * 16);
    atb_parallel_chunks(run_rows, &job, (a->n + job.chunk_rows - 1) / job.chunk_rows, nth);
    free(tmp);
    free(normed);
    return 0;
}

/* Few-row (and many-row) matmul on panel-packed weights: see linear.h and the
 * layout note below. fp32, bf16 and fp16 panels only: int8 panels (w8) read their
 * activations as int8 blocks (panel_q8.c), so no tile here widens int8 weights. */
#include "act.h"
#include "gemm.h"
#include "linear.h"
#include "pool.h"

/* Panel-packed weights (``packed``, any weight dtype): w holds ceil(N / 32) panels,
 * panel p the [K, 32] block w[k, j] = W[32 p + j, k] (zeros past N). Each x element is broadcast
 * against two vectors of a panel row, so a tile is 8 x rows by 32 outputs in 16
 * accumulators, with no horizontal sums and the panel read sequentially from
 * memory (one core, 16 x 32000 x 512 from DRAM: 105 GF/s against 74 for the 4 x 4
 * tiles on [N, K] rows; in L2 116 against 80, this machine's FMA peak). */
#define ATB_PANEL 32

/* x rows per chunk of a many-row matmul (64 x K fp32 stays in L2 for K up to ~4000) */
#define ATB_PANEL_MBLOCK 64

#ifdef ATB_LIN_AVX512
/* res[i * 32 + j] = x row i . panel column j for MB rows; a panel row is 32 weights
 * of dtype WDT, widened to fp32 in registers */
static inline __attribute__((always_inline)) void panel_tile(int MB, int WDT, const float *x,
                                                             int64_t xs, const uint8_t *w,
                                                             int64_t K, float *res) {
    const int64_t es = wsize(WDT);
    __m512 acc[16];
    for (int64_t k0 = 0; k0 < K; k0 += ATB_PANEL_KB) {
        const int64_t k1 = K - k0 < ATB_PANEL_KB ? K : k0 + ATB_PANEL_KB;
        for (int i = 0; i < 2 * MB; ++i) acc[i] = _mm512_setzero_ps();
        for (int64_t k = k0; k < k1; ++k) {
            const __m512 w0 = loadw(WDT, w + k * ATB_PANEL * es, 0, 1);
            const __m512 w1 = loadw(WDT, w + (k * ATB_PANEL + 16) * es, 0, 1);
            for (int i = 0; i < MB; ++i) {
                const __m512 xb = _mm512_set1_ps(x[i * xs + k]);
                acc[2 * i] = _mm512_fmadd_ps(xb, w0, acc[2 * i]);
                acc[2 * i + 1] = _mm512_fmadd_ps(xb, w1, acc[2 * i + 1]);
            }
        }
        for (int i = 0; i < 2 * MB; ++i) {
            __m512 v = acc[i];
            if (k0) v = _mm512_add_ps(v, _mm512_loadu_ps(res + i * 16));
            _mm512_storeu_ps(res + i * 16, v);
        }
    }
}

/* the float weight dtypes of panel.c (W_F16 the default: int8 panels never come here) */
#define PANEL_BY_WDT(MB, CALL)                                       \
    switch (wdt) {                                                   \
    case W_F32: CALL(MB, W_F32); break;                              \
    case W_BF16: CALL(MB, W_BF16); break;                            \
    default: CALL(MB, W_F16); break;                                 \
    }

static void panel_tile_rt(int mb, int wdt, const float *x, int64_t xs, const uint8_t *w,
                          int64_t K, int pf, float *res) {
    (void)pf;
#define ATB_PT(MB, W) panel_tile(MB, W, x, xs, w, K, res)
    switch (mb) {
    case 1: PANEL_BY_WDT(1, ATB_PT) break;
    case 2: PANEL_BY_WDT(2, ATB_PT) break;
    case 3: PANEL_BY_WDT(3, ATB_PT) break;
    case 4: PANEL_BY_WDT(4, ATB_PT) break;
    case 5: PANEL_BY_WDT(5, ATB_PT) break;
    case 6: PANEL_BY_WDT(6, ATB_PT) break;
    case 7: PANEL_BY_WDT(7, ATB_PT) break;
    default: PANEL_BY_WDT(8, ATB_PT) break;
    }
#undef ATB_PT
}
#elif defined(ATB_AVX2)
#define panel_tile_rt atb_panel_tile_avx2 /* panel_avx2.c */
#define panel_row2_rt atb_panel_row2_avx2
#define ATB_PANEL_ROW2 1
#else
static void panel_tile_rt(int mb, int wdt, const float *x, int64_t xs, const uint8_t *w,
                          int64_t K, int pf, float *res) {
    (void)pf;
    memset(res, 0, (size_t)mb * ATB_PANEL * sizeof(float));
    for (int64_t k0 = 0; k0 < K; k0 += ATB_PANEL_KB) {
        const int64_t k1 = K - k0 < ATB_PANEL_KB ? K : k0 + ATB_PANEL_KB;
        float part[8 * ATB_PANEL] = {0}, wk[ATB_PANEL];
        for (int64_t k = k0; k < k1; ++k) {
            for (int j = 0; j < ATB_PANEL; ++j) wk[j] = wval(wdt, w, k * ATB_PANEL + j);
            for (int i = 0; i < mb; ++i) {
                const float xv = x[i * xs + k];
                float *r = part + i * ATB_PANEL;
#pragma omp simd
                for (int j = 0; j < ATB_PANEL; ++j) r[j] += xv * wk[j];
            }
        }
        for (int j = 0; j < mb * ATB_PANEL; ++j) res[j] += part[j];
    }
}
#endif

/* y[m .. m+mb, n .. n+32) of one panel (res: mb rows of 32 sums): per-channel scale,
 * bias and the residual in fp32 over a row at a time, then one rounding each (fp32
 * rows and biases are read and written in place by atb_load / atb_store) */
void atb_panel_emit(const LinArgs *a, int64_t m, int64_t n, int mb, const float *res) {
    const int64_t nv = a->n - n < ATB_PANEL ? a->n - n : ATB_PANEL;
    const float *sc = a->scale ? (const float *)P(a->scale) + n : NULL;
    float bb[ATB_PANEL], yy[ATB_PANEL], v[ATB_PANEL];
    int adt;
    int64_t as;
    const void *add = lin_addend(a, &adt, &as);
    const float *bi = a->bias ? atb_load(P(a->bias), (int)a->bias_dt, n, nv, bb) : NULL;
    for (int i = 0; i < mb; ++i) {
        const float *r = res + i * ATB_PANEL;
        const int64_t off = (m + i) * a->y_stride + n;
        if (!sc && !bi && !add) {
            atb_store((void *)P(a->y), (int)a->y_dt, off, nv, r);
            continue;
        }
        const float *acc = add ? atb_load(add, adt, (m + i) * as + n, nv, yy) : NULL;
        /* one branch-free loop per term, so each vectorises (the same sums in the
         * same order as r * sc + bi + acc element by element) */
        if (sc) {
#pragma omp simd
            for (int64_t j = 0; j < nv; ++j) v[j] = r[j] * sc[j];
        } else {
            memcpy(v, r, (size_t)nv * sizeof(float));
        }
        if (bi) {
#pragma omp simd
            for (int64_t j = 0; j < nv; ++j) v[j] += bi[j];
        }
        if (acc) {
#pragma omp simd
            for (int64_t j = 0; j < nv; ++j) v[j] += acc[j];
        }
        atb_store((void *)P(a->y), (int)a->y_dt, off, nv, v);
    }
}

/* y[m .. m+mb, n .. n+32) of a gated call (LinArgs.gated): rg / ru the gate and up
 * panels' sums (mb rows of 32 each). Each plus its bias as the plain call would store
 * it in fp32, then act(gate) * up as the activation kernel computes it (act.c), one
 * rounding to y's dtype: the bits of the matmul into an fp32 buffer and the
 * activation kernel after it. */
void atb_panel_emit_gated(const LinArgs *a, int64_t m, int64_t n, int mb, const float *rg,
                          const float *ru) {
    const int64_t nv = a->n - n < ATB_PANEL ? a->n - n : ATB_PANEL;
    float bg[ATB_PANEL], bu[ATB_PANEL], g[ATB_PANEL], h[ATB_PANEL];
    const float *big = a->bias ? atb_load(P(a->bias), (int)a->bias_dt, n, nv, bg) : NULL;
    const float *biu = a->bias ? atb_load(P(a->bias), (int)a->bias_dt, a->n + n, nv, bu) : NULL;
    for (int i = 0; i < mb; ++i) {
        const float *r = rg + i * ATB_PANEL, *u = ru + i * ATB_PANEL;
        if (big) {
#pragma omp simd
            for (int64_t j = 0; j < nv; ++j) g[j] = r[j] + big[j];
            r = g;
        }
        atb_act_apply((int)a->act, nv, r, h);
        if (biu) {
#pragma omp simd
            for (int64_t j = 0; j < nv; ++j) h[j] *= u[j] + biu[j];
        } else {
#pragma omp simd
            for (int64_t j = 0; j < nv; ++j) h[j] *= u[j];
        }
        atb_store((void *)P(a->y), (int)a->y_dt, (m + i) * a->y_stride + n, nv, h);
    }
}

/* Decode rows (one block of rows): chunk sizes fall with the panels left, each about
 * left / guide (rounded up to whole units: pairs of panels for one row), so the first
 * chunks are long weight streams and the last ones short enough that the threads finish
 * together. Returns the chunk count; for chunk c (when c >= 0) its panels [*p0, *p1). */
static int64_t guided_chunk(int64_t np, int64_t guide, int64_t unit, int64_t c, int64_t *p0,
                            int64_t *p1) {
    int64_t start = 0, i = 0;
    for (; start < np; ++i) {
        int64_t size = ((np - start + guide - 1) / guide + unit - 1) / unit * unit;
        if (size > np - start) size = np - start;
        if (i == c) {
            *p0 = start;
            *p1 = start + size;
        }
        start += size;
    }
    return i;
}

/* panels per unit of work in a one-row call: pairs (panel_row2), except gated calls,
 * whose gate panel and up panel are the pair */
static int64_t pair_unit(const LinArgs *a) { return a->m == 1 && !a->gated ? 2 : 1; }

/* chunk: panels [p0, p1) against x rows [m0, m1) (one block of rows); gated: gate
 * panels, each with its up panel */
static void run_panels(void *ctx, int64_t chunk) {
    const Job *job = (const Job *)ctx;
    const LinArgs *a = job->a;
    const int wdt = (int)a->w_dt;
    const int64_t K = a->k, np = (a->n + ATB_PANEL - 1) / ATB_PANEL;
    const int64_t pc = chunk % job->pchunks, m0 = chunk / job->pchunks * job->mblock;
    const int64_t M = m0 + job->mblock < a->m ? m0 + job->mblock : a->m;
    int64_t p0 = pc * job->chunk_rows, p1 = p0 + job->chunk_rows < np ? p0 + job->chunk_rows : np;
    if (job->guide) guided_chunk(np, job->guide, pair_unit(a), chunk, &p0, &p1);
    const uint8_t *w = (const uint8_t *)P(a->w);
    const int64_t ps = K * ATB_PANEL * wsize(wdt); /* bytes per panel */
    /* gated: panel p is a gate panel, its up panel gated panels on */
    const int64_t up = a->gated * ps;
    for (int64_t p = p0; p < p1; ++p) {
        const uint8_t *wp = w + p * ps;
#ifdef ATB_PANEL_ROW2
        if (M - m0 == 1 && up) { /* one row: the gate panel and its up panel at a time */
            float res2[2 * ATB_PANEL];
            panel_row2_rt(wdt, job->xf + m0 * job->xs, wp, up, K, res2);
            atb_panel_emit_gated(a, m0, p * ATB_PANEL, 1, res2, res2 + ATB_PANEL);
            continue;
        }
        if (M - m0 == 1 && p + 1 < p1) { /* one row: two panels at a time */
            float res2[2 * ATB_PANEL];
            panel_row2_rt(wdt, job->xf + m0 * job->xs, wp, ps, K, res2);
            atb_panel_emit(a, m0, p * ATB_PANEL, 1, res2);
            atb_panel_emit(a, m0, (p + 1) * ATB_PANEL, 1, res2 + ATB_PANEL);
            ++p;
            continue;
        }
#endif
        /* the block's rows in groups of ATB_PANEL_MT, but at least 6 left for the last
         * (20 rows: 14 + 6, not 18 + 2); the first group prefetches the weights on */
        for (int64_t m = m0; m < M;) {
            const int64_t left = M - m;
            const int mb = (int)(left <= ATB_PANEL_MT ? left
                                 : left - ATB_PANEL_MT >= 6 ? ATB_PANEL_MT : left - 6);
            float res[ATB_PANEL_MT * ATB_PANEL];
            panel_tile_rt(mb, wdt, job->xf + m * job->xs, job->xs, wp, K, m == m0, res);
            if (up) {
                float resu[ATB_PANEL_MT * ATB_PANEL];
                panel_tile_rt(mb, wdt, job->xf + m * job->xs, job->xs, wp + up, K, m == m0,
                              resu);
                atb_panel_emit_gated(a, m, p * ATB_PANEL, mb, res, resu);
            } else {
                atb_panel_emit(a, m, p * ATB_PANEL, mb, res);
            }
            m += mb;
        }
    }
}

void atb_linear_panels(Job *job, int nth) {
    /* chunks of (rows, panels), about 8 per thread: decode rows are one block; many
     * rows (a prefill GEMM) go in blocks of ATB_PANEL_MBLOCK, each kept in L2 while
     * its chunk's panels stream past, on torch's OpenMP team (see
     * atb_parallel_chunks_big): 4224 x 2752 x 512 on one core 114 GF/s against 101
     * for torch.mm (MKL) */
    const LinArgs *a = job->a;
    const int64_t np = (a->n + ATB_PANEL - 1) / ATB_PANEL;
    const int big = a->m > ATB_PANEL_MBLOCK;
    job->mblock = big ? ATB_PANEL_MBLOCK : a->m;
    const int64_t nmb = (a->m + job->mblock - 1) / job->mblock;
    const int64_t per_block = (8 * nth + nmb - 1) / nmb;   /* panel chunks a block needs */
    job->chunk_rows = (np + per_block - 1) / per_block;
    if (pair_unit(a) == 2 && job->chunk_rows % 2 && job->chunk_rows < np)
        ++job->chunk_rows; /* whole pairs of panels (panel_row2) */
    job->pchunks = (np + job->chunk_rows - 1) / job->chunk_rows;
    job->guide = 0;
    if (big) {
        atb_parallel_chunks_big(run_panels, job, nmb * job->pchunks, nth);
        return;
    }
    /* decode rows: guided chunks (equal ones left the threads up to a chunk apart at
     * the end of each matmul, and each chunk start is a new weight stream) */
    job->guide = 2 * (int64_t)nth;
    job->pchunks = guided_chunk(np, job->guide, pair_unit(a), -1, NULL, NULL);
    atb_parallel_chunks(run_panels, job, job->pchunks, nth);
}

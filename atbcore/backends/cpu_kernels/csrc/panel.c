/* Few-row (and many-row) matmul on panel-packed weights: see linear.h and the
 * layout note below. fp32, bf16 and fp16 panels only: int8 panels (w8) read their
 * activations as int8 blocks (panel_q8.c), so no tile here widens int8 weights. */
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

/* sums over K in blocks of this many, added up in res: fp32 error ~ (block + K / block)
 * roundings instead of K (16 x 768 x 512 against float64: 9e-5 -> 2e-5, as the 4 x 4
 * tiles' split sums) */
#define ATB_PANEL_KB 128
/* x rows per chunk of a many-row matmul (64 x K fp32 stays in L2 for K up to ~4000) */
#define ATB_PANEL_MBLOCK 64
/* x rows per call of a tile (the AVX2 tile runs them as two sixes) */
#ifdef ATB_AVX2
#define ATB_PANEL_MT 12
#else
#define ATB_PANEL_MT 8
#endif

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
                          int64_t K, float *res) {
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
/* rows 0..MB (MB 1 or 2) of x against panel rows [k0, k1): 8 accumulators, each
 * output's sum in k order as the AVX-512 tile's (fp32 FMAs), added into res */
static inline __attribute__((always_inline)) void panel_pair(int MB, int WDT, const float *x,
                                                             int64_t xs, const uint8_t *w,
                                                             int64_t k0, int64_t k1, float *res) {
    const int64_t es = wsize(WDT);
    __m256 acc[8];
    for (int i = 0; i < 4 * MB; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t k = k0; k < k1; ++k) {
        const uint8_t *wk = w + k * ATB_PANEL * es;
        const __m256 w0 = loadw8(WDT, wk), w1 = loadw8(WDT, wk + 8 * es);
        const __m256 w2 = loadw8(WDT, wk + 16 * es), w3 = loadw8(WDT, wk + 24 * es);
        for (int i = 0; i < MB; ++i) {
            const __m256 xb = _mm256_broadcast_ss(x + i * xs + k);
            acc[4 * i] = _mm256_fmadd_ps(xb, w0, acc[4 * i]);
            acc[4 * i + 1] = _mm256_fmadd_ps(xb, w1, acc[4 * i + 1]);
            acc[4 * i + 2] = _mm256_fmadd_ps(xb, w2, acc[4 * i + 2]);
            acc[4 * i + 3] = _mm256_fmadd_ps(xb, w3, acc[4 * i + 3]);
        }
    }
    for (int i = 0; i < 4 * MB; ++i) {
        __m256 v = acc[i];
        if (k0) v = _mm256_add_ps(v, _mm256_loadu_ps(res + i * 8));
        _mm256_storeu_ps(res + i * 8, v);
    }
}

/* panel_pair for bf16 weights: a 32-bit lane of a bf16 panel row holds outputs 2i and
 * 2i + 1, so a shift (even outputs) and a mask (odd ones) widen 16 weights in two
 * single-uop ops (VPMOVZXWD + VPSLLD took four, two of them on the shuffle ports); the
 * sums, in k order per output, are panel_pair's to the bit, put back in output order
 * once per block of K */
static inline __attribute__((always_inline)) void panel_pair_bf16(int MB, const float *x,
                                                                  int64_t xs, const uint8_t *w,
                                                                  int64_t k0, int64_t k1,
                                                                  float *res) {
    const __m256i hi = _mm256_set1_epi32((int)0xFFFF0000u);
    __m256 acc[8];
    for (int i = 0; i < 4 * MB; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t k = k0; k < k1; ++k) {
        const uint8_t *wk = w + k * ATB_PANEL * 2;
        const __m256i v0 = _mm256_loadu_si256((const __m256i *)wk);
        const __m256i v1 = _mm256_loadu_si256((const __m256i *)(wk + 32));
        const __m256 e0 = _mm256_castsi256_ps(_mm256_slli_epi32(v0, 16));
        const __m256 o0 = _mm256_castsi256_ps(_mm256_and_si256(v0, hi));
        const __m256 e1 = _mm256_castsi256_ps(_mm256_slli_epi32(v1, 16));
        const __m256 o1 = _mm256_castsi256_ps(_mm256_and_si256(v1, hi));
        for (int i = 0; i < MB; ++i) {
            const __m256 xb = _mm256_broadcast_ss(x + i * xs + k);
            acc[4 * i] = _mm256_fmadd_ps(xb, e0, acc[4 * i]);
            acc[4 * i + 1] = _mm256_fmadd_ps(xb, o0, acc[4 * i + 1]);
            acc[4 * i + 2] = _mm256_fmadd_ps(xb, e1, acc[4 * i + 2]);
            acc[4 * i + 3] = _mm256_fmadd_ps(xb, o1, acc[4 * i + 3]);
        }
    }
    for (int i = 0; i < MB; ++i)
        for (int h = 0; h < 2; ++h) {
            const __m256 e = acc[4 * i + 2 * h], o = acc[4 * i + 2 * h + 1];
            /* lanes (e0 o0 e1 o1 | e4 o4 e5 o5) and (e2 o2 e3 o3 | e6 o6 e7 o7) */
            const __m256 lo = _mm256_unpacklo_ps(e, o), up = _mm256_unpackhi_ps(e, o);
            float *r = res + i * ATB_PANEL + 16 * h;
            __m256 a = _mm256_permute2f128_ps(lo, up, 0x20), b = _mm256_permute2f128_ps(lo, up, 0x31);
            if (k0) {
                a = _mm256_add_ps(a, _mm256_loadu_ps(r));
                b = _mm256_add_ps(b, _mm256_loadu_ps(r + 8));
            }
            _mm256_storeu_ps(r, a);
            _mm256_storeu_ps(r + 8, b);
        }
}

/* one row against two panels (w and w + ps bytes) over panel rows [k0, k1): 8
 * accumulators where one panel has 4, so two FMAs a cycle rather than one FMA chain's
 * latency set the pace (one row, one panel: 4 FMAs per 4-cycle FMA latency); each
 * output's sum is panel_pair's (panel_pair_bf16's) to the bit; res: 64 sums */
static inline __attribute__((always_inline)) void panel_row2(int WDT, const float *x,
                                                             const uint8_t *w, int64_t ps,
                                                             int64_t k0, int64_t k1, float *res) {
    const int64_t es = wsize(WDT);
    const __m256i hi = _mm256_set1_epi32((int)0xFFFF0000u);
    __m256 acc[8];
    for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t k = k0; k < k1; ++k) {
        const __m256 xb = _mm256_broadcast_ss(x + k);
        for (int q = 0; q < 2; ++q) {
            const uint8_t *wk = w + q * ps + k * ATB_PANEL * es;
            __m256 v[4];
            if (WDT == W_BF16) { /* even outputs, odd outputs of each half */
                const __m256i h0 = _mm256_loadu_si256((const __m256i *)wk);
                const __m256i h1 = _mm256_loadu_si256((const __m256i *)(wk + 32));
                v[0] = _mm256_castsi256_ps(_mm256_slli_epi32(h0, 16));
                v[1] = _mm256_castsi256_ps(_mm256_and_si256(h0, hi));
                v[2] = _mm256_castsi256_ps(_mm256_slli_epi32(h1, 16));
                v[3] = _mm256_castsi256_ps(_mm256_and_si256(h1, hi));
            } else {
                for (int u = 0; u < 4; ++u) v[u] = loadw8(WDT, wk + 8 * u * es);
            }
            for (int u = 0; u < 4; ++u) acc[4 * q + u] = _mm256_fmadd_ps(xb, v[u], acc[4 * q + u]);
        }
    }
    for (int q = 0; q < 2; ++q)
        for (int h = 0; h < 2; ++h) {
            float *r = res + q * ATB_PANEL + 16 * h;
            __m256 a = acc[4 * q + 2 * h], b = acc[4 * q + 2 * h + 1];
            if (WDT == W_BF16) { /* back to output order, as panel_pair_bf16 */
                const __m256 lo = _mm256_unpacklo_ps(a, b), up = _mm256_unpackhi_ps(a, b);
                a = _mm256_permute2f128_ps(lo, up, 0x20);
                b = _mm256_permute2f128_ps(lo, up, 0x31);
            }
            if (k0) {
                a = _mm256_add_ps(a, _mm256_loadu_ps(r));
                b = _mm256_add_ps(b, _mm256_loadu_ps(r + 8));
            }
            _mm256_storeu_ps(r, a);
            _mm256_storeu_ps(r + 8, b);
        }
}

static void panel_row2_rt(int wdt, const float *x, const uint8_t *w, int64_t ps, int64_t K,
                          float *res) {
    for (int64_t k0 = 0; k0 < K; k0 += ATB_PANEL_KB) {
        const int64_t k1 = K - k0 < ATB_PANEL_KB ? K : k0 + ATB_PANEL_KB;
        switch (wdt) {
        case W_F32: panel_row2(W_F32, x, w, ps, k0, k1, res); break;
        case W_BF16: panel_row2(W_BF16, x, w, ps, k0, k1, res); break;
        default: panel_row2(W_F16, x, w, ps, k0, k1, res); break; /* no int8 panels here */
        }
    }
}
#define ATB_PANEL_ROW2 1

/* six rows against one half (16 outputs) of the panel rows [k0, k1): the many-row
 * tile, 12 accumulators, each weight vector (widened once) feeding six FMAs; the same
 * sums in the same order as panel_pair's */
static inline __attribute__((always_inline)) void panel_six(int WDT, const float *x, int64_t xs,
                                                            const uint8_t *w, int64_t k0,
                                                            int64_t k1, float *res) {
    const int64_t es = wsize(WDT);
    __m256 acc[12];
    for (int i = 0; i < 12; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t k = k0; k < k1; ++k) {
        const uint8_t *wk = w + k * ATB_PANEL * es;
        __m256 w0 = loadw8(WDT, wk), w1 = loadw8(WDT, wk + 8 * es);
        /* in registers: GCC otherwise folds an fp32 load into each of the six FMAs (three
         * loads per two FMAs, load-port bound) */
        __asm__("" : "+x"(w0), "+x"(w1));
        for (int i = 0; i < 6; ++i) {
            const __m256 xb = _mm256_broadcast_ss(x + i * xs + k);
            acc[2 * i] = _mm256_fmadd_ps(xb, w0, acc[2 * i]);
            acc[2 * i + 1] = _mm256_fmadd_ps(xb, w1, acc[2 * i + 1]);
        }
    }
    for (int i = 0; i < 6; ++i)
        for (int u = 0; u < 2; ++u) {
            __m256 v = acc[2 * i + u];
            if (k0) v = _mm256_add_ps(v, _mm256_loadu_ps(res + i * ATB_PANEL + 8 * u));
            _mm256_storeu_ps(res + i * ATB_PANEL + 8 * u, v);
        }
}

/* mb rows: sixes on each half of the panel, the rest in pairs (16 registers hold two
 * rows' 32 sums), each block of K across all rows while it is in L1 */
static inline __attribute__((always_inline)) void panel_rows(int WDT, int mb, const float *x,
                                                             int64_t xs, const uint8_t *w,
                                                             int64_t K, float *res) {
    const int64_t es = wsize(WDT);
    for (int64_t k0 = 0; k0 < K; k0 += ATB_PANEL_KB) {
        const int64_t k1 = K - k0 < ATB_PANEL_KB ? K : k0 + ATB_PANEL_KB;
        int i = 0;
        for (; i + 6 <= mb; i += 6)
            for (int h = 0; h < 2; ++h)
                panel_six(WDT, x + i * xs, xs, w + 16 * h * es, k0, k1, res + i * ATB_PANEL + 16 * h);
        if (WDT == W_BF16) {
            for (; i + 2 <= mb; i += 2) panel_pair_bf16(2, x + i * xs, xs, w, k0, k1, res + i * ATB_PANEL);
            if (i < mb) panel_pair_bf16(1, x + i * xs, xs, w, k0, k1, res + i * ATB_PANEL);
            continue;
        }
        for (; i + 2 <= mb; i += 2) panel_pair(2, WDT, x + i * xs, xs, w, k0, k1, res + i * ATB_PANEL);
        if (i < mb) panel_pair(1, WDT, x + i * xs, xs, w, k0, k1, res + i * ATB_PANEL);
    }
}

static void panel_tile_rt(int mb, int wdt, const float *x, int64_t xs, const uint8_t *w,
                          int64_t K, float *res) {
    switch (wdt) {
    case W_F32: panel_rows(W_F32, mb, x, xs, w, K, res); break;
    case W_BF16: panel_rows(W_BF16, mb, x, xs, w, K, res); break;
    default: panel_rows(W_F16, mb, x, xs, w, K, res); break; /* no int8 panels here */
    }
}
#else
static void panel_tile_rt(int mb, int wdt, const float *x, int64_t xs, const uint8_t *w,
                          int64_t K, float *res) {
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

/* chunk: panels [p0, p1) against x rows [m0, m1) (one block of rows) */
static void run_panels(void *ctx, int64_t chunk) {
    const Job *job = (const Job *)ctx;
    const LinArgs *a = job->a;
    const int wdt = (int)a->w_dt;
    const int64_t K = a->k, np = (a->n + ATB_PANEL - 1) / ATB_PANEL;
    const int64_t pc = chunk % job->pchunks, m0 = chunk / job->pchunks * job->mblock;
    const int64_t M = m0 + job->mblock < a->m ? m0 + job->mblock : a->m;
    const int64_t p0 = pc * job->chunk_rows, p1 = p0 + job->chunk_rows < np ? p0 + job->chunk_rows : np;
    const uint8_t *w = (const uint8_t *)P(a->w);
    const int64_t ps = K * ATB_PANEL * wsize(wdt); /* bytes per panel */
    for (int64_t p = p0; p < p1; ++p) {
        const uint8_t *wp = w + p * ps;
#ifdef ATB_PANEL_ROW2
        if (M - m0 == 1 && p + 1 < p1) { /* one row: two panels at a time */
            float res2[2 * ATB_PANEL];
            panel_row2_rt(wdt, job->xf + m0 * job->xs, wp, ps, K, res2);
            atb_panel_emit(a, m0, p * ATB_PANEL, 1, res2);
            atb_panel_emit(a, m0, (p + 1) * ATB_PANEL, 1, res2 + ATB_PANEL);
            ++p;
            continue;
        }
#endif
        for (int64_t m = m0; m < M; m += ATB_PANEL_MT) {
            const int mb = M - m < ATB_PANEL_MT ? (int)(M - m) : ATB_PANEL_MT;
            float res[ATB_PANEL_MT * ATB_PANEL];
            panel_tile_rt(mb, wdt, job->xf + m * job->xs, job->xs, wp, K, res);
            atb_panel_emit(a, m, p * ATB_PANEL, mb, res);
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
    if (a->m == 1 && job->chunk_rows % 2 && job->chunk_rows < np)
        ++job->chunk_rows; /* whole pairs of panels (panel_row2) */
    job->pchunks = (np + job->chunk_rows - 1) / job->chunk_rows;
    if (big)
        atb_parallel_chunks_big(run_panels, job, nmb * job->pchunks, nth);
    else
        atb_parallel_chunks(run_panels, job, job->pchunks, nth);
}

/* panel.c's register tiles for x86-64-v3 builds (AVX2 + FMA, 16 vector registers): rows
 * of x against 32-output weight panels (layout: panel.c), each output's sum over a block
 * of K in k order by fp32 FMAs, added into res once per block -- the same sums in the
 * same order in every tile, so a row's outputs do not depend on the tile it lands in.
 *
 * The tiles: a half tile (R = 3..6 rows x 16 outputs, 2R accumulators, each weight
 * vector widened once and fed to R FMAs), a pair (1 or 2 rows x all 32 outputs) and a
 * one-row tile on two panels at once (8 accumulators where one panel has 4). An FMA
 * has 4 cycles of latency and two issue a cycle, so a tile needs 8 independent sums
 * in flight: a group of rows is split into half tiles of 4..6 rows (a pair or a 3-row
 * half tile for what is left), never into one-row tiles.
 *
 * Prefetch: in a decode step the weights come from DRAM (a 16-row step of the default
 * fp32 model reads 167 MB), and compute and the weight stream must overlap: while the
 * tiles run over one block of K, every FMA step of every pass also prefetches a slice
 * of the next block (panel_rows), so the stream is spread evenly over the block's time.
 * Only the first group of rows over a panel prefetches; later groups re-read it. */
#include "gemm.h"
#include "linear.h"

#ifdef ATB_AVX2
static inline __attribute__((always_inline)) void prefetch(const uint8_t *p) {
    _mm_prefetch((const char *)p, _MM_HINT_T0);
}

/* a block's sums v (8 outputs) into r: stored at the first block, added after */
static inline __attribute__((always_inline)) void put8(float *r, __m256 v, int64_t k0) {
    if (k0) v = _mm256_add_ps(v, _mm256_loadu_ps(r));
    _mm256_storeu_ps(r, v);
}

/* the 16 widened weights of a bf16 panel row half (32 bytes): a 32-bit lane holds
 * outputs 2j and 2j + 1, so a shift gives the even outputs and a mask the odd ones
 * (two single-uop ops; VPMOVZXWD + VPSLLD take four, two on the shuffle ports) */
static inline __attribute__((always_inline)) void bf16_even_odd(const uint8_t *p, __m256 *e,
                                                                __m256 *o) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)p);
    *e = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    *o = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xFFFF0000u)));
}

/* sums held as (even outputs, odd outputs) of 16 back in output order, into r */
static inline __attribute__((always_inline)) void put16_even_odd(float *r, __m256 e, __m256 o,
                                                                 int64_t k0) {
    /* lanes (e0 o0 e1 o1 | e4 o4 e5 o5) and (e2 o2 e3 o3 | e6 o6 e7 o7) */
    const __m256 lo = _mm256_unpacklo_ps(e, o), up = _mm256_unpackhi_ps(e, o);
    put8(r, _mm256_permute2f128_ps(lo, up, 0x20), k0);
    put8(r + 8, _mm256_permute2f128_ps(lo, up, 0x31), k0);
}

/* R rows (R <= 6) against one half (16 outputs) of the panel rows [k0, k1). Every loop
 * runs to a constant with R as a guard, so each unrolls before R is known: a loop to
 * 2R left the accumulators an array in memory, zeroed by a memset (rep stos, slow to
 * start on AMD) before each block. */
static inline __attribute__((always_inline)) void panel_half(int R, int WDT, int PF,
                                                             const float *x, int64_t xs,
                                                             const uint8_t *w, int64_t k0,
                                                             int64_t k1, const uint8_t *pf,
                                                             int64_t pstep, float *res) {
    const int64_t es = wsize(WDT);
    __m256 acc[12];
    for (int i = 0; i < 12; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t k = k0; k < k1; ++k) {
        const uint8_t *wk = w + k * ATB_GEMM_PANEL * es;
        if (PF) prefetch(pf + (k - k0) * pstep);
        __m256 w0, w1; /* bf16: even and odd outputs */
        if (WDT == W_BF16) {
            bf16_even_odd(wk, &w0, &w1);
        } else {
            w0 = loadw8(WDT, wk);
            w1 = loadw8(WDT, wk + 8 * es);
        }
        /* in registers: GCC otherwise folds an fp32 load into each of the R FMAs (three
         * loads per two FMAs, load-port bound) */
        __asm__("" : "+x"(w0), "+x"(w1));
        for (int i = 0; i < 6; ++i)
            if (i < R) {
                const __m256 xb = _mm256_broadcast_ss(x + i * xs + k);
                acc[2 * i] = _mm256_fmadd_ps(xb, w0, acc[2 * i]);
                acc[2 * i + 1] = _mm256_fmadd_ps(xb, w1, acc[2 * i + 1]);
            }
    }
    for (int i = 0; i < 6; ++i)
        if (i < R) {
            float *r = res + i * ATB_GEMM_PANEL;
            if (WDT == W_BF16) {
                put16_even_odd(r, acc[2 * i], acc[2 * i + 1], k0);
            } else {
                put8(r, acc[2 * i], k0);
                put8(r + 8, acc[2 * i + 1], k0);
            }
        }
}

/* rows 0..MB (MB 1 or 2) of x against all 32 outputs of panel rows [k0, k1): 4MB
 * accumulators (bf16 as even/odd outputs, put back in order once per block) */
static inline __attribute__((always_inline)) void panel_pair(int MB, int WDT, int PF,
                                                             const float *x, int64_t xs,
                                                             const uint8_t *w, int64_t k0,
                                                             int64_t k1, const uint8_t *pf,
                                                             int64_t pstep, float *res) {
    const int64_t es = wsize(WDT);
    __m256 acc[8]; /* loops to constants, MB a guard: see panel_half */
    for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t k = k0; k < k1; ++k) {
        const uint8_t *wk = w + k * ATB_GEMM_PANEL * es;
        if (PF) prefetch(pf + (k - k0) * pstep);
        __m256 v[4];
        if (WDT == W_BF16) {
            bf16_even_odd(wk, &v[0], &v[1]);
            bf16_even_odd(wk + 32, &v[2], &v[3]);
        } else {
            for (int u = 0; u < 4; ++u) v[u] = loadw8(WDT, wk + 8 * u * es);
        }
        __asm__("" : "+x"(v[0]), "+x"(v[1]), "+x"(v[2]), "+x"(v[3])); /* see panel_half */
        for (int i = 0; i < 2; ++i)
            if (i < MB) {
                const __m256 xb = _mm256_broadcast_ss(x + i * xs + k);
                for (int u = 0; u < 4; ++u) acc[4 * i + u] = _mm256_fmadd_ps(xb, v[u], acc[4 * i + u]);
            }
    }
    for (int i = 0; i < 2; ++i)
        if (i < MB) {
            float *r = res + i * ATB_GEMM_PANEL;
            if (WDT == W_BF16) {
                put16_even_odd(r, acc[4 * i], acc[4 * i + 1], k0);
                put16_even_odd(r + 16, acc[4 * i + 2], acc[4 * i + 3], k0);
            } else {
                for (int u = 0; u < 4; ++u) put8(r + 8 * u, acc[4 * i + u], k0);
            }
        }
}

/* one row against two panels (w and w + ps bytes) over panel rows [k0, k1): 8
 * accumulators where one panel has 4, so two FMAs a cycle rather than one FMA chain's
 * latency set the pace; res: 64 sums */
static inline __attribute__((always_inline)) void panel_row2(int WDT, const float *x,
                                                             const uint8_t *w, int64_t ps,
                                                             int64_t k0, int64_t k1, float *res) {
    const int64_t es = wsize(WDT);
    __m256 acc[8];
    for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t k = k0; k < k1; ++k) {
        const __m256 xb = _mm256_broadcast_ss(x + k);
        for (int q = 0; q < 2; ++q) {
            const uint8_t *wk = w + q * ps + k * ATB_GEMM_PANEL * es;
            __m256 v[4];
            if (WDT == W_BF16) {
                bf16_even_odd(wk, &v[0], &v[1]);
                bf16_even_odd(wk + 32, &v[2], &v[3]);
            } else {
                for (int u = 0; u < 4; ++u) v[u] = loadw8(WDT, wk + 8 * u * es);
            }
            for (int u = 0; u < 4; ++u) acc[4 * q + u] = _mm256_fmadd_ps(xb, v[u], acc[4 * q + u]);
        }
    }
    for (int q = 0; q < 2; ++q) {
        float *r = res + q * ATB_GEMM_PANEL;
        if (WDT == W_BF16) {
            put16_even_odd(r, acc[4 * q], acc[4 * q + 1], k0);
            put16_even_odd(r + 16, acc[4 * q + 2], acc[4 * q + 3], k0);
        } else {
            for (int u = 0; u < 4; ++u) put8(r + 8 * u, acc[4 * q + u], k0);
        }
    }
}

void atb_panel_row2_avx2(int wdt, const float *x, const uint8_t *w, int64_t ps, int64_t K,
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

/* rows [0, r) of x (r <= 6) against the panel rows [k0, k1): a pair for 1 or 2 rows,
 * else a half tile on each half of the panel (two passes over the block); PF: each
 * pass's iteration t prefetches pf + t * pstep (the second half's pass goes on from
 * where the first stopped) */
static inline __attribute__((always_inline)) void panel_part(int WDT, int PF, int r,
                                                             const float *x, int64_t xs,
                                                             const uint8_t *w, int64_t k0,
                                                             int64_t k1, const uint8_t *pf,
                                                             int64_t pstep, float *res) {
    const int64_t es = wsize(WDT);
#define PA_HALVES(R)                                                                      \
    for (int h = 0; h < 2; ++h)                                                           \
        panel_half(R, WDT, PF, x, xs, w + 16 * h * es, k0, k1, pf + h * (k1 - k0) * pstep, \
                   pstep, res + 16 * h);                                                  \
    break
    switch (r) {
    case 1: panel_pair(1, WDT, PF, x, xs, w, k0, k1, pf, pstep, res); break;
    case 2: panel_pair(2, WDT, PF, x, xs, w, k0, k1, pf, pstep, res); break;
    case 3: PA_HALVES(3);
    case 4: PA_HALVES(4);
    case 5: PA_HALVES(5);
    default: PA_HALVES(6);
    }
#undef PA_HALVES
}

/* mb rows (mb <= ATB_PANEL_MT) in parts of six, the rest as one part of 2..5 rows, or as
 * 5 + 4 (for 3 left) or 5 + 2 (for 1 left), so no part is a lone row beside others;
 * each block of K across all parts while it is in L1. With pf, the passes over a block
 * prefetch the next block of weights (the next panel's first after the last) evenly
 * spread over all of them: one prefetch per FMA step, not a burst from the first pass
 * (which filled the L1's miss buffers and stalled the FMAs). One or two rows (a lone
 * pair) do not: their block is over too soon for a block's distance to run ahead of
 * the hardware prefetcher, which alone streams them at the read bandwidth. */
static inline __attribute__((always_inline)) void panel_rows(int WDT, int mb, const float *x,
                                                             int64_t xs, const uint8_t *w,
                                                             int64_t K, int pf, float *res) {
    const int64_t es = wsize(WDT);
    int parts[ATB_PANEL_MT], np = 0, left = mb, passes = 0;
    while (left > 6 && !(left == 7 || left == 9)) {
        parts[np++] = 6;
        left -= 6;
    }
    if (left == 7) { parts[np++] = 5; left = 2; }
    if (left == 9) { parts[np++] = 5; left = 4; }
    parts[np++] = left;
    for (int p = 0; p < np; ++p) passes += parts[p] > 2 ? 2 : 1;
    /* bytes per FMA step so that the passes cover a panel row's bytes per k */
    const int64_t pstep = (ATB_GEMM_PANEL * es + passes - 1) / passes;
    for (int64_t k0 = 0; k0 < K; k0 += ATB_PANEL_KB) {
        const int64_t k1 = K - k0 < ATB_PANEL_KB ? K : k0 + ATB_PANEL_KB;
        const uint8_t *next = w + k1 * ATB_GEMM_PANEL * es;
        for (int p = 0, i = 0; p < np; i += parts[p++]) {
            float *r = res + i * ATB_GEMM_PANEL;
            if (pf && passes > 1)
                panel_part(WDT, 1, parts[p], x + i * xs, xs, w, k0, k1, next, pstep, r);
            else
                panel_part(WDT, 0, parts[p], x + i * xs, xs, w, k0, k1, next, 0, r);
            next += (parts[p] > 2 ? 2 : 1) * (k1 - k0) * pstep;
        }
    }
}

void atb_panel_tile_avx2(int mb, int wdt, const float *x, int64_t xs, const uint8_t *w,
                         int64_t K, int pf, float *res) {
    switch (wdt) {
    case W_F32: panel_rows(W_F32, mb, x, xs, w, K, pf, res); break;
    case W_BF16: panel_rows(W_BF16, mb, x, xs, w, K, pf, res); break;
    default: panel_rows(W_F16, mb, x, xs, w, K, pf, res); break; /* no int8 panels here */
    }
}
#else
typedef int atb_panel_avx2_unused; /* (ISO C: no empty translation unit) */
#endif

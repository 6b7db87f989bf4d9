/* Many-row matmul of bf16 activations on bf16 panel weights (a bf16 model's prefill
 * GEMMs) with VDPBF16PS, which multiplies pairs of bf16 and adds both products to
 * an fp32 lane: twice the multiply-adds of an fp32 FMA per instruction, and no
 * widening of either operand.
 *
 * The panels are panel.c's (panel p: [K, 32], row k the 32 outputs' weights at k).
 * VDPBF16PS wants each lane's pair to be (k, k+1) of one output, so two panel rows
 * are interleaved in registers (VPUNPCKL/HWD: lane 4L+t of the low half holds
 * output 8L+t, of the high half output 8L+4+t, L the 128-bit lane), and the x pair
 * (x[k], x[k+1]) is one 32-bit broadcast. The outputs come out in that interleaved
 * order and are put back in order once per K block. Products of two bf16 are exact
 * in fp32; sums are fp32 in K blocks of 128 (as panel.c's), so the results differ
 * from the fp32 path only by the order of the roundings of the sums.
 *
 * The instructions need AVX512_BF16, which x86-64-v4 does not include: the kernel
 * is compiled for it by a target attribute and runs only where cpuid says so. */
#include "gemm.h"
#include "pool.h"

#define ATB_BF16_KB 128 /* K block (even: pairs never straddle two blocks) */

int atb_cpu_bf16(void) {
#if defined(__x86_64__) && defined(__GNUC__)
    static int have = -1;
    if (have < 0) {
        __builtin_cpu_init();
        have = __builtin_cpu_supports("avx512bf16") ? 1 : 0;
    }
    return have;
#else
    return 0;
#endif
}

#if defined(ATB_LIN_AVX512) && defined(__GNUC__)
#define ATB_HAVE_BF16_KERNEL 1
#define ATB_BF16_TARGET __attribute__((target("avx512bf16")))

typedef struct {
    const LinArgs *a;
    const uint16_t *x;
    int64_t xs;
    int64_t chunk_panels, pchunks, mblock;
} Bf16Job;

/* res[i * 32 + j] = x row i . panel column j for MB rows (bf16 x, bf16 panel) */
static inline ATB_BF16_TARGET __attribute__((always_inline)) void bf16_tile(
    int MB, const uint16_t *x, int64_t xs, const uint16_t *w, int64_t K, float *res) {
    const __m512i ord0 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i ord1 = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29,
                                           30, 31);
    __m512 lo[8], hi[8];
    for (int64_t k0 = 0; k0 < K; k0 += ATB_BF16_KB) {
        const int64_t k1 = K - k0 < ATB_BF16_KB ? K : k0 + ATB_BF16_KB;
        for (int i = 0; i < MB; ++i) lo[i] = hi[i] = _mm512_setzero_ps();
        int64_t k = k0;
        for (; k + 1 < k1; k += 2) {
            const __m512i r0 = _mm512_loadu_si512(w + k * ATB_GEMM_PANEL);
            const __m512i r1 = _mm512_loadu_si512(w + (k + 1) * ATB_GEMM_PANEL);
            const __m512bh wl = (__m512bh)_mm512_unpacklo_epi16(r0, r1);
            const __m512bh wh = (__m512bh)_mm512_unpackhi_epi16(r0, r1);
            for (int i = 0; i < MB; ++i) {
                int32_t pair;
                memcpy(&pair, x + i * xs + k, sizeof pair);
                const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
                lo[i] = _mm512_dpbf16_ps(lo[i], xb, wl);
                hi[i] = _mm512_dpbf16_ps(hi[i], xb, wh);
            }
        }
        if (k < k1) { /* odd K: the last row pairs with zeros */
            const __m512i r0 = _mm512_loadu_si512(w + k * ATB_GEMM_PANEL);
            const __m512i z = _mm512_setzero_si512();
            const __m512bh wl = (__m512bh)_mm512_unpacklo_epi16(r0, z);
            const __m512bh wh = (__m512bh)_mm512_unpackhi_epi16(r0, z);
            for (int i = 0; i < MB; ++i) {
                const __m512bh xb = (__m512bh)_mm512_set1_epi32((int32_t)x[i * xs + k]);
                lo[i] = _mm512_dpbf16_ps(lo[i], xb, wl);
                hi[i] = _mm512_dpbf16_ps(hi[i], xb, wh);
            }
        }
        for (int i = 0; i < MB; ++i) {
            __m512 v0 = _mm512_permutex2var_ps(lo[i], ord0, hi[i]);
            __m512 v1 = _mm512_permutex2var_ps(lo[i], ord1, hi[i]);
            if (k0) {
                v0 = _mm512_add_ps(v0, _mm512_loadu_ps(res + i * 32));
                v1 = _mm512_add_ps(v1, _mm512_loadu_ps(res + i * 32 + 16));
            }
            _mm512_storeu_ps(res + i * 32, v0);
            _mm512_storeu_ps(res + i * 32 + 16, v1);
        }
    }
}

static ATB_BF16_TARGET void bf16_tile_rt(int mb, const uint16_t *x, int64_t xs, const uint16_t *w,
                                         int64_t K, float *res) {
    switch (mb) {
    case 1: bf16_tile(1, x, xs, w, K, res); break;
    case 2: bf16_tile(2, x, xs, w, K, res); break;
    case 3: bf16_tile(3, x, xs, w, K, res); break;
    case 4: bf16_tile(4, x, xs, w, K, res); break;
    case 5: bf16_tile(5, x, xs, w, K, res); break;
    case 6: bf16_tile(6, x, xs, w, K, res); break;
    case 7: bf16_tile(7, x, xs, w, K, res); break;
    default: bf16_tile(8, x, xs, w, K, res); break;
    }
}

/* chunk: panels [p0, p1) against x rows [m0, m1) (one block of rows) */
static void run_bf16(void *ctx, int64_t chunk) {
    const Bf16Job *job = (const Bf16Job *)ctx;
    const LinArgs *a = job->a;
    const int64_t K = a->k, np = (a->n + ATB_GEMM_PANEL - 1) / ATB_GEMM_PANEL;
    const int64_t m0 = chunk / job->pchunks * job->mblock;
    const int64_t m1 = m0 + job->mblock < a->m ? m0 + job->mblock : a->m;
    const int64_t p0 = chunk % job->pchunks * job->chunk_panels;
    const int64_t p1 = p0 + job->chunk_panels < np ? p0 + job->chunk_panels : np;
    const uint16_t *w = (const uint16_t *)P(a->w);
    const int64_t up = a->gated * K * ATB_GEMM_PANEL; /* gated: a gate panel's up panel */
    for (int64_t p = p0; p < p1; ++p)
        for (int64_t m = m0; m < m1; m += 8) {
            const int mb = m1 - m < 8 ? (int)(m1 - m) : 8;
            float res[8 * ATB_GEMM_PANEL];
            const uint16_t *wp = w + p * K * ATB_GEMM_PANEL;
            bf16_tile_rt(mb, job->x + m * job->xs, job->xs, wp, K, res);
            if (up) {
                float resu[8 * ATB_GEMM_PANEL];
                bf16_tile_rt(mb, job->x + m * job->xs, job->xs, wp + up, K, resu);
                atb_panel_emit_gated(a, m, p * ATB_GEMM_PANEL, mb, res, resu);
            } else {
                atb_panel_emit(a, m, p * ATB_GEMM_PANEL, mb, res);
            }
        }
}
#endif

int atb_linear_bf16(const LinArgs *a, const void *x, int64_t xs, int nth) {
#ifdef ATB_HAVE_BF16_KERNEL
    if (!a->packed || a->w_dt != W_BF16 || a->x_dt != ATB_BF16 || !atb_cpu_bf16()) return -1;
    Bf16Job job = {a, (const uint16_t *)x, xs, 0, 0, ATB_GEMM_MBLOCK};
    /* about 8 chunks per thread, as panel.c's many-row split */
    const int64_t np = (a->n + ATB_GEMM_PANEL - 1) / ATB_GEMM_PANEL;
    const int64_t nmb = (a->m + job.mblock - 1) / job.mblock;
    const int64_t per_block = (8 * nth + nmb - 1) / nmb;
    job.chunk_panels = (np + per_block - 1) / per_block;
    job.pchunks = (np + job.chunk_panels - 1) / job.chunk_panels;
    atb_parallel_chunks_big(run_bf16, &job, nmb * job.pchunks, nth);
    return 0;
#else
    (void)a;
    (void)x;
    (void)xs;
    (void)nth;
    return -1;
#endif
}

/* The matmul on int8 panels (w8) with int8 activations: each row is quantized per
 * block of 32 inputs, as llama.cpp quantizes its Q8_0 activations,
 *
 *   dx[b] = max |x[32 b .. 32 b + 32)| / 127,  q[k] = rint(x[k] * (127 / max |x|)),
 *   y[n] = (sum over blocks b, in order, of fp32 (sum_k q[k] w[n, k]) * dx[b]) * scale[n]
 *
 * (each block's sum an exact int32, added in fp32 by one FMA per block). Widening every
 * weight to fp32 kept a 1-row matmul compute bound (3 uops per weight vector of 8 plus
 * an FMA); here 4 weight rows become the [32 outputs x 4 k] byte quads VPMADDUBSW reads
 * with 8 in-lane shuffles per 128 bytes, and one VPMADDUBSW multiplies 32 weights.
 *
 * The panels are panel.c's (LinArgs.packed: [K, 32] per 32 outputs). Every row count
 * runs this way, so a row's result does not depend on the rows decoded beside it.
 * Exact integer sums and the same FMA order in every build: the AVX2 tile and the plain
 * loop give the same bits at any thread count. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "gemm.h"
#include "linear.h"
#include "pool.h"

#define Q8_BLOCK 32

typedef struct {
    const LinArgs *a;
    const int8_t *xq;  /* [M, nblk * 32], zeros past K */
    const float *dx;   /* [M, nblk] */
    int64_t nblk, chunk_panels;
} Q8Job;

/* one block of kn <= 32 inputs -> q[0 .. 32) (zeros past kn), its dx and sum of q */
static float q8_block_scalar(const float *x, int64_t kn, int8_t *q, int32_t *qsum) {
    float amax = 0.f;
    for (int64_t t = 0; t < kn; ++t) {
        const float v = fabsf(x[t]);
        amax = v > amax ? v : amax;
    }
    const float id = amax > 0.f ? 127.f / amax : 0.f;
    int32_t s = 0;
    for (int64_t t = 0; t < Q8_BLOCK; ++t) {
        int32_t v = 0;
        if (t < kn) {
            v = (int32_t)nearbyintf(x[t] * id);
            v = v > 127 ? 127 : (v < -127 ? -127 : v);
        }
        q[t] = (int8_t)v;
        s += v;
    }
    *qsum = s;
    return amax / 127.f;
}

#if defined(__AVX2__)
#include <immintrin.h>
/* a whole block: q8_block_scalar's bits (VCVTPS2DQ rounds to nearest even, as nearbyintf
 * in the default rounding mode; the max is exact; the clamp is the packs' saturation and
 * a max with -127) */
static float q8_block_avx2(const float *x, int8_t *q, int32_t *qsum) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 v[4], m;
    for (int u = 0; u < 4; ++u) v[u] = _mm256_loadu_ps(x + 8 * u);
    m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                      _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    const float amax = _mm_cvtss_f32(h);
    const __m256 id = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    __m256i i[4];
    for (int u = 0; u < 4; ++u) i[u] = _mm256_cvtps_epi32(_mm256_mul_ps(v[u], id));
    /* packs interleave the 128-bit lanes: [0 1 4 5 | 2 3 6 7] of the 8-wide groups,
     * put back in order by one cross-lane permute */
    const __m256i w = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
    const __m256i b = _mm256_max_epi8(_mm256_permutevar8x32_epi32(w, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)),
                                      _mm256_set1_epi8(-127));
    _mm256_storeu_si256((__m256i *)q, b);
    /* the sum: bytes widened to pairs (VPMADDUBSW by ones is signed x unsigned: ones
     * unsigned), then to int32 */
    const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), b),
                                        _mm256_set1_epi16(1));
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(p), _mm256_extracti128_si256(p, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1));
    *qsum = _mm_cvtsi128_si32(t);
    return amax / 127.f;
}
#endif

void atb_q8_quantize_row(const float *x, int64_t K, int64_t nblk, int8_t *xq, float *dx,
                         int32_t *xsum) {
    for (int64_t b = 0; b < nblk; ++b) {
        const int64_t k0 = b * Q8_BLOCK;
        const int64_t kn = K - k0 < Q8_BLOCK ? (K > k0 ? K - k0 : 0) : Q8_BLOCK;
        int32_t s;
#if defined(__AVX2__)
        if (kn == Q8_BLOCK)
            dx[b] = q8_block_avx2(x + k0, xq + k0, &s);
        else
#endif
            dx[b] = q8_block_scalar(x + k0, kn, xq + k0, &s);
        if (xsum) xsum[b] = s;
    }
}

/* x (fp32, K) as the panels read it: each block quantized, then q * dx in fp32 (the
 * [N, K] rows of linear.c take this copy, so both layouts compute the same product) */
void atb_q8_round_row(const float *x, int64_t K, float *out) {
    int8_t q[Q8_BLOCK];
    float d;
    for (int64_t k0 = 0; k0 < K; k0 += Q8_BLOCK) {
        const int64_t kn = K - k0 < Q8_BLOCK ? K - k0 : Q8_BLOCK;
        atb_q8_quantize_row(x + k0, kn, 1, q, &d, NULL);
        for (int64_t t = 0; t < kn; ++t) out[k0 + t] = (float)q[t] * d;
    }
}

#if defined(__AVX2__)

/* weight row k of the panel (32 bytes), zeros past K */
static inline __m256i q8_row(const int8_t *w, int64_t k, int64_t K) {
    return k < K ? _mm256_loadu_si256((const __m256i *)(w + k * 32)) : _mm256_setzero_si256();
}

/* |w| . (x with w's sign) for byte pairs: VPMADDUBSW's signed 8 x 8 bits, exact at the
 * int8 extremes (|w|, |x| <= 127: a pair sums to <= 32258) */
static inline __m256i q8_pairs(__m256i wv, __m256i xb) {
    return _mm256_maddubs_epi16(_mm256_abs_epi8(wv), _mm256_sign_epi8(xb, wv));
}

/* res[0 .. 32) = the fp32 block sums of one panel (w: [K, 32] bytes) */
static void q8_panel(const int8_t *w, int64_t K, const int8_t *xq, const float *dx, int64_t nblk,
                     float *res) {
    const __m256i ones = _mm256_set1_epi16(1);
    /* accumulators by output: a0 [0-3 | 16-19], a1 [4-7 | 20-23], a2 [8-11 | 24-27],
     * a3 [12-15 | 28-31] (the in-lane unpacks keep 128-bit halves apart) */
    __m256 f0 = _mm256_setzero_ps(), f1 = f0, f2 = f0, f3 = f0;
    for (int64_t b = 0; b < nblk; ++b) {
        __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
        const int64_t k1 = (b + 1) * Q8_BLOCK < K ? (b + 1) * Q8_BLOCK : K;
        for (int64_t k = b * Q8_BLOCK; k < k1; k += 4) {
            _mm_prefetch((const char *)(w + (k + 64) * 32), _MM_HINT_T0);
            _mm_prefetch((const char *)(w + (k + 66) * 32), _MM_HINT_T0);
            const __m256i r0 = q8_row(w, k, K), r1 = q8_row(w, k + 1, K);
            const __m256i r2 = q8_row(w, k + 2, K), r3 = q8_row(w, k + 3, K);
            int16_t x01, x23;
            memcpy(&x01, xq + k, 2);
            memcpy(&x23, xq + k + 2, 2);
            const __m256i xa = _mm256_set1_epi16(x01), xb = _mm256_set1_epi16(x23);
            /* int16 sums over (k, k+1) and (k+2, k+3) of outputs [0-7 | 16-23], [8-15 | 24-31] */
            const __m256i plo = q8_pairs(_mm256_unpacklo_epi8(r0, r1), xa);
            const __m256i phi = q8_pairs(_mm256_unpackhi_epi8(r0, r1), xa);
            const __m256i qlo = q8_pairs(_mm256_unpacklo_epi8(r2, r3), xb);
            const __m256i qhi = q8_pairs(_mm256_unpackhi_epi8(r2, r3), xb);
            a0 = _mm256_add_epi32(a0, _mm256_madd_epi16(_mm256_unpacklo_epi16(plo, qlo), ones));
            a1 = _mm256_add_epi32(a1, _mm256_madd_epi16(_mm256_unpackhi_epi16(plo, qlo), ones));
            a2 = _mm256_add_epi32(a2, _mm256_madd_epi16(_mm256_unpacklo_epi16(phi, qhi), ones));
            a3 = _mm256_add_epi32(a3, _mm256_madd_epi16(_mm256_unpackhi_epi16(phi, qhi), ones));
        }
        const __m256 d = _mm256_set1_ps(dx[b]);
        f0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a0), d, f0);
        f1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a1), d, f1);
        f2 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a2), d, f2);
        f3 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a3), d, f3);
    }
    _mm256_storeu_ps(res, _mm256_permute2f128_ps(f0, f1, 0x20));
    _mm256_storeu_ps(res + 8, _mm256_permute2f128_ps(f2, f3, 0x20));
    _mm256_storeu_ps(res + 16, _mm256_permute2f128_ps(f0, f1, 0x31));
    _mm256_storeu_ps(res + 24, _mm256_permute2f128_ps(f2, f3, 0x31));
}

/* rows 0 and 1 (xq0/dx0, xq1/dx1) against one panel: q8_panel's sums for each, bit for bit,
 * with the weight interleave and |w| made once for both rows (the many-row case: prefill
 * and batched decode); the fp32 sums live in res0/res1 (L1), one FMA per block each */
static void q8_panel2(const int8_t *w, int64_t K, const int8_t *xq0, const float *dx0,
                      const int8_t *xq1, const float *dx1, int64_t nblk, float *res0,
                      float *res1) {
    const __m256i ones = _mm256_set1_epi16(1);
    float f[2][32] = {{0}};
    for (int64_t b = 0; b < nblk; ++b) {
        __m256i a[2][4];
        for (int r = 0; r < 2; ++r)
            for (int u = 0; u < 4; ++u) a[r][u] = _mm256_setzero_si256();
        const int64_t k1 = (b + 1) * Q8_BLOCK < K ? (b + 1) * Q8_BLOCK : K;
        for (int64_t k = b * Q8_BLOCK; k < k1; k += 4) {
            const __m256i r0 = q8_row(w, k, K), r1 = q8_row(w, k + 1, K);
            const __m256i r2 = q8_row(w, k + 2, K), r3 = q8_row(w, k + 3, K);
            __m256i xa[2], xb[2];
            for (int r = 0; r < 2; ++r) {
                int16_t x01, x23;
                memcpy(&x01, (r ? xq1 : xq0) + k, 2);
                memcpy(&x23, (r ? xq1 : xq0) + k + 2, 2);
                xa[r] = _mm256_set1_epi16(x01);
                xb[r] = _mm256_set1_epi16(x23);
            }
            for (int h = 0; h < 2; ++h) { /* outputs [0-7 | 16-23], then [8-15 | 24-31] */
                const __m256i p = h ? _mm256_unpackhi_epi8(r0, r1) : _mm256_unpacklo_epi8(r0, r1);
                const __m256i q = h ? _mm256_unpackhi_epi8(r2, r3) : _mm256_unpacklo_epi8(r2, r3);
                const __m256i pa = _mm256_abs_epi8(p), qa = _mm256_abs_epi8(q);
                for (int r = 0; r < 2; ++r) {
                    const __m256i ps = _mm256_maddubs_epi16(pa, _mm256_sign_epi8(xa[r], p));
                    const __m256i qs = _mm256_maddubs_epi16(qa, _mm256_sign_epi8(xb[r], q));
                    a[r][2 * h] = _mm256_add_epi32(
                        a[r][2 * h], _mm256_madd_epi16(_mm256_unpacklo_epi16(ps, qs), ones));
                    a[r][2 * h + 1] = _mm256_add_epi32(
                        a[r][2 * h + 1], _mm256_madd_epi16(_mm256_unpackhi_epi16(ps, qs), ones));
                }
            }
        }
        for (int r = 0; r < 2; ++r) {
            const __m256 d = _mm256_set1_ps((r ? dx1 : dx0)[b]);
            for (int u = 0; u < 4; ++u)
                _mm256_storeu_ps(f[r] + 8 * u, _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[r][u]), d,
                                                               _mm256_loadu_ps(f[r] + 8 * u)));
        }
    }
    for (int r = 0; r < 2; ++r) { /* back to output order, as q8_panel */
        float *res = r ? res1 : res0;
        const __m256 f0 = _mm256_loadu_ps(f[r]), f1 = _mm256_loadu_ps(f[r] + 8);
        const __m256 f2 = _mm256_loadu_ps(f[r] + 16), f3 = _mm256_loadu_ps(f[r] + 24);
        _mm256_storeu_ps(res, _mm256_permute2f128_ps(f0, f1, 0x20));
        _mm256_storeu_ps(res + 8, _mm256_permute2f128_ps(f2, f3, 0x20));
        _mm256_storeu_ps(res + 16, _mm256_permute2f128_ps(f0, f1, 0x31));
        _mm256_storeu_ps(res + 24, _mm256_permute2f128_ps(f2, f3, 0x31));
    }
}
#define Q8_PANEL2 1
#else
/* the same sums in plain C: exact integers per block, the same fp32 FMAs in block order */
static void q8_panel(const int8_t *w, int64_t K, const int8_t *xq, const float *dx, int64_t nblk,
                     float *res) {
    for (int j = 0; j < 32; ++j) res[j] = 0.f;
    for (int64_t b = 0; b < nblk; ++b) {
        int32_t acc[32] = {0};
        const int64_t k1 = (b + 1) * Q8_BLOCK < K ? (b + 1) * Q8_BLOCK : K;
        for (int64_t k = b * Q8_BLOCK; k < k1; ++k)
            for (int j = 0; j < 32; ++j) acc[j] += (int32_t)xq[k] * w[k * 32 + j];
        for (int j = 0; j < 32; ++j) res[j] = fmaf((float)acc[j], dx[b], res[j]);
    }
}
#endif

/* chunk: panels [p0, p1), every row against each panel while it is in L1/L2 (each row's
 * sums are the one-row sums: a row's result does not depend on the rows beside it) */
static void run_q8(void *ctx, int64_t chunk) {
    const Q8Job *job = (const Q8Job *)ctx;
    const LinArgs *a = job->a;
    const int64_t K = a->k, np = (a->n + 31) / 32, kp = job->nblk * Q8_BLOCK;
    const int64_t p0 = chunk * job->chunk_panels;
    const int64_t p1 = p0 + job->chunk_panels < np ? p0 + job->chunk_panels : np;
    const int8_t *w = (const int8_t *)P(a->w);
    for (int64_t p = p0; p < p1; ++p) {
        const int8_t *wp = w + p * K * 32;
        int64_t m = 0;
#ifdef Q8_PANEL2
        for (; m + 2 <= a->m; m += 2) {
            float res[64];
            q8_panel2(wp, K, job->xq + m * kp, job->dx + m * job->nblk, job->xq + (m + 1) * kp,
                      job->dx + (m + 1) * job->nblk, job->nblk, res, res + 32);
            atb_panel_emit(a, m, p * 32, 2, res);
        }
#endif
        for (; m < a->m; ++m) {
            float res[32];
            q8_panel(wp, K, job->xq + m * kp, job->dx + m * job->nblk, job->nblk, res);
            atb_panel_emit(a, m, p * 32, 1, res);
        }
    }
}

int atb_linear_panels_q8(const LinArgs *a, const float *x, int64_t xs, int nth) {
    const int64_t M = a->m, K = a->k, nblk = (K + Q8_BLOCK - 1) / Q8_BLOCK, kp = nblk * Q8_BLOCK;
    int8_t xq_stack[4096];
    float dx_stack[4096 / Q8_BLOCK];
    int8_t *xq = xq_stack;
    float *dx = dx_stack;
    if (M * kp > (int64_t)sizeof xq_stack) { /* long or many rows: on the heap */
        xq = (int8_t *)malloc((size_t)(M * kp));
        dx = (float *)malloc((size_t)(M * nblk) * sizeof(float));
        if (!xq || !dx) {
            free(xq);
            free(dx);
            return ATB_ERR_NOMEM;
        }
    }
    for (int64_t m = 0; m < M; ++m)
        atb_q8_quantize_row(x + m * xs, K, nblk, xq + m * kp, dx + m * nblk, NULL);
    const int64_t np = (a->n + 31) / 32;
    Q8Job job = {a, xq, dx, nblk, (np + 8 * nth - 1) / (8 * nth)};
    const int64_t chunks = (np + job.chunk_panels - 1) / job.chunk_panels;
    if (M > ATB_GEMM_MBLOCK) /* prefill-sized: torch's OpenMP team, as the other GEMMs */
        atb_parallel_chunks_big(run_q8, &job, chunks, nth);
    else
        atb_parallel_chunks(run_q8, &job, chunks, nth);
    if (xq != xq_stack) {
        free(xq);
        free(dx);
    }
    return 0;
}

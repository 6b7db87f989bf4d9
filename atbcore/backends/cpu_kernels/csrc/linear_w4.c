/* Matmul on group-wise 4-bit weights (w4): y = x W^T (+ bias), W stored as 4-bit codes
 * q in [0, 15] with a scale s and a zero point z per output and group of G inputs
 * (W[n, k] = s (q - z)); z = 8 for every group when no zero points are given (the
 * symmetric form, Q4_0's information content), one per group otherwise (GPTQ/AWQ).
 *
 * Layout (packed by torch_linear_w4.pack_w4): outputs in 32-wide panels, K in blocks
 * of 32 (K padded to a multiple of G with codes whose x is zero). A block of a panel
 * is 512 bytes, 8 sub-blocks of 4 k; in sub-block kk, byte 4 j + t holds the code of
 * output j (low nibble) and output j + 16 (high nibble) at k = 4 kk + t, so one 64-byte
 * load masked and shifted gives the u8 operands of two VPDPBUSD (16 outputs x 4 k
 * each). Scales are fp16 [P, K/G, 32], zero points u8 [P, K/G, 32].
 *
 * The activations are quantized per row and block of 32 to int8 with an fp32 scale
 * (dx = absmax / 127, x_q = rint(x * 127 / absmax)), as llama.cpp does for Q4_0
 * (Q8_0 activations): the block's dot product is an exact int32 sum, the zero point
 * enters as z * sum(x_q), and each block adds s * dx * (sum - z sum(x_q)) in fp32. */
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "norm.h"
#include "pool.h"
#include "simd.h"

#define W4_PANEL 32
#define W4_BLOCK 32
#define W4_BLOCK_BYTES 512
#define W4_MB 4 /* x rows per tile */
#define W4_MBLOCK 64 /* x rows per chunk of a many-row matmul */

typedef struct {
    int64_t x, x_dt, x_stride, m, k, n;
    int64_t w, scales, zeros, group;   /* zeros 0: symmetric (z = 8) */
    int64_t bias, bias_dt;             /* bias 0: none */
    int64_t y, y_dt, y_stride, accumulate;
    int64_t norm, norm_w, norm_w_dt;   /* norm 1: RmsNorm x first (weight optional) */
    int64_t threads;
    double norm_eps;
} W4Args;

typedef struct {
    const W4Args *a;
    const int8_t *xq;  /* [m, nblk * 32] */
    const float *dx;   /* [m, nblk] */
    const int32_t *xsum; /* [m, nblk] */
    int64_t nblk, chunk_panels, pchunks, mblock;
} W4Job;

#define PTR(v) ((const void *)(intptr_t)(v))

static inline float w4_half(uint16_t h) { return atb_f16_to_f32(h); }

/* row m's blocks quantized: xq (zeros past K), dx, xsum */
static void quant_row(const float *x, int64_t K, int64_t nblk, int8_t *xq, float *dx,
                      int32_t *xsum) {
    for (int64_t b = 0; b < nblk; ++b) {
        const int64_t k0 = b * W4_BLOCK, kn = K - k0 < W4_BLOCK ? (K - k0 > 0 ? K - k0 : 0) : W4_BLOCK;
        float amax = 0.f;
        for (int64_t t = 0; t < kn; ++t) {
            const float v = x[k0 + t] < 0 ? -x[k0 + t] : x[k0 + t];
            amax = v > amax ? v : amax;
        }
        const float id = amax > 0.f ? 127.f / amax : 0.f;
        int32_t s = 0;
        for (int64_t t = 0; t < W4_BLOCK; ++t) {
            int32_t q = 0;
            if (t < kn) {
                q = (int32_t)nearbyintf(x[k0 + t] * id);
                q = q > 127 ? 127 : (q < -127 ? -127 : q);
            }
            xq[k0 + t] = (int8_t)q;
            s += q;
        }
        dx[b] = amax / 127.f;
        xsum[b] = s;
    }
}

/* y[m, n0 .. n0+nv) from the fp32 sums r (bias, accumulate, one rounding); NV a
 * constant for whole panels, so that r (just stored by the tile) is read back by
 * whole-vector loads, which the store forwards to (masked loads of a variable count
 * waited for the stores to retire: two thirds of a small matmul's time) */
static inline __attribute__((always_inline)) void emit_n(const W4Args *a, int64_t m, int64_t n0,
                                                         const float *r, int64_t NV) {
    float v[W4_PANEL], bb[W4_PANEL], yy[W4_PANEL];
    const float *bi = a->bias ? atb_load(PTR(a->bias), (int)a->bias_dt, n0, NV, bb) : NULL;
    const int64_t off = m * a->y_stride + n0;
    const float *acc = a->accumulate ? atb_load(PTR(a->y), (int)a->y_dt, off, NV, yy) : NULL;
    for (int64_t j = 0; j < NV; ++j) {
        float t = r[j];
        if (bi) t += bi[j];
        v[j] = acc ? acc[j] + t : t;
    }
    if (a->y_dt == ATB_F32) {
        float *d = (float *)PTR(a->y) + off;
        for (int64_t j = 0; j < NV; ++j) d[j] = v[j];
    } else {
        atb_store((void *)PTR(a->y), (int)a->y_dt, off, NV, v);
    }
}

static void w4_emit(const W4Args *a, int64_t m, int64_t n0, const float *r) {
    const int64_t nv = a->n - n0 < W4_PANEL ? a->n - n0 : W4_PANEL;
    if (nv == W4_PANEL)
        emit_n(a, m, n0, r, W4_PANEL);
    else
        emit_n(a, m, n0, r, nv);
}

/* sums of MB rows against one panel, generic C (the same integer math) */
static void tile_scalar(const W4Job *job, int mb, const uint8_t *wp, const uint16_t *sp,
                        const uint8_t *zp, int64_t m, float *res) {
    const W4Args *a = job->a;
    const int64_t nblk = job->nblk, kp = nblk * W4_BLOCK, bpg = a->group / W4_BLOCK;
    memset(res, 0, sizeof(float) * (size_t)mb * W4_PANEL);
    for (int64_t b = 0; b < nblk; ++b) {
        const uint8_t *blk = wp + b * W4_BLOCK_BYTES;
        const int64_t g = b / bpg;
        for (int i = 0; i < mb; ++i) {
            const int8_t *xq = job->xq + (m + i) * kp + b * W4_BLOCK;
            const float dx = job->dx[(m + i) * nblk + b];
            const int32_t xs = job->xsum[(m + i) * nblk + b];
            for (int j = 0; j < W4_PANEL; ++j) {
                int32_t s = 0;
                for (int kk = 0; kk < 8; ++kk)
                    for (int t = 0; t < 4; ++t) {
                        const uint8_t byte = blk[kk * 64 + (j & 15) * 4 + t];
                        const int32_t q = j < 16 ? (byte & 15) : (byte >> 4);
                        s += q * xq[kk * 4 + t];
                    }
                const int32_t z = zp ? zp[g * W4_PANEL + j] : 8;
                const float sc = w4_half(sp[g * W4_PANEL + j]);
                res[i * W4_PANEL + j] += (float)(s - z * xs) * (sc * dx);
            }
        }
    }
}

#if defined(ATB_AVX512) && (defined(__GNUC__) || defined(__clang__))
#define W4_VNNI 1
#define W4_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))

/* sums of MB rows (a constant) against one panel: per block 8 x 2 VPDPBUSD per row, then
 * the fp32 epilogue s * dx * (sum - z * xsum) */
static inline __attribute__((always_inline)) W4_TARGET void
tile_vnni(const W4Job *job, int MB, const uint8_t *wp, const uint16_t *sp, const uint8_t *zp,
          int64_t m, float *res) {
    const W4Args *a = job->a;
    const int64_t nblk = job->nblk, kp = nblk * W4_BLOCK, bpg = a->group / W4_BLOCK;
    /* the high nibbles are summed in place (16 q, masked, not shifted: one op less per
     * 4 k), so their sums, zero term and scale carry a factor 16 (exact: a power of 2) */
    const __m512i low = _mm512_set1_epi8(0x0F), high = _mm512_set1_epi8((char)0xF0);
    __m512 f[2 * W4_MB];
    for (int i = 0; i < 2 * MB; ++i) f[i] = _mm512_setzero_ps();
    __m512 s0 = _mm512_setzero_ps(), s1 = s0;
    __m512i z0 = _mm512_set1_epi32(8), z1 = _mm512_set1_epi32(8 * 16);
    int64_t g = -1, in_group = bpg - 1; /* counters, not a division per block */
    for (int64_t b = 0; b < nblk; ++b) {
        const uint8_t *blk = wp + b * W4_BLOCK_BYTES;
        if (++in_group == bpg) { /* a new weight group: its scales and zero points */
            in_group = 0;
            ++g;
            s0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sp + g * W4_PANEL)));
            s1 = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256(
                                   (const __m256i *)(sp + g * W4_PANEL + 16))),
                               _mm512_set1_ps(1.f / 16.f));
            if (zp) {
                z0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(zp + g * W4_PANEL)));
                z1 = _mm512_slli_epi32(_mm512_cvtepu8_epi32(
                                           _mm_loadu_si128((const __m128i *)(zp + g * W4_PANEL + 16))), 4);
            }
        }
        /* few rows: even and odd sub-blocks in separate sums, so that more VPDPBUSD
         * chains run at once (one row's two chains alone wait on its latency) */
        enum { SPLIT = 2 };
        __m512i acc[2 * W4_MB * SPLIT];
        const int chains = MB <= 2 ? SPLIT : 1;
        for (int i = 0; i < 2 * MB * chains; ++i) acc[i] = _mm512_setzero_si512();
        _mm_prefetch((const char *)(blk + 8 * W4_BLOCK_BYTES), _MM_HINT_T0);
        for (int kk = 0; kk < 8; ++kk) {
            const __m512i v = _mm512_loadu_si512((const void *)(blk + kk * 64));
            const __m512i lo = _mm512_and_si512(v, low);
            const __m512i hi = _mm512_and_si512(v, high);
            const int c = chains > 1 ? (kk & 1) * 2 * MB : 0;
            for (int i = 0; i < MB; ++i) {
                int32_t x4;
                memcpy(&x4, job->xq + (m + i) * kp + b * W4_BLOCK + kk * 4, 4);
                const __m512i xb = _mm512_set1_epi32(x4);
                acc[c + 2 * i] = _mm512_dpbusd_epi32(acc[c + 2 * i], lo, xb);
                acc[c + 2 * i + 1] = _mm512_dpbusd_epi32(acc[c + 2 * i + 1], hi, xb);
            }
        }
        if (chains > 1)
            for (int i = 0; i < 2 * MB; ++i) acc[i] = _mm512_add_epi32(acc[i], acc[2 * MB + i]);
        for (int i = 0; i < MB; ++i) {
            const int32_t x_sum = job->xsum[(m + i) * nblk + b];
            const __m512 dx = _mm512_set1_ps(job->dx[(m + i) * nblk + b]);
            __m512i d0, d1;
            if (zp) {
                const __m512i xs = _mm512_set1_epi32(x_sum);
                d0 = _mm512_sub_epi32(acc[2 * i], _mm512_mullo_epi32(z0, xs));
                d1 = _mm512_sub_epi32(acc[2 * i + 1], _mm512_mullo_epi32(z1, xs));
            } else { /* z = 8 everywhere: the zero term is one number */
                d0 = _mm512_sub_epi32(acc[2 * i], _mm512_set1_epi32(8 * x_sum));
                d1 = _mm512_sub_epi32(acc[2 * i + 1], _mm512_set1_epi32(8 * 16 * x_sum));
            }
            f[2 * i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d0), _mm512_mul_ps(s0, dx), f[2 * i]);
            f[2 * i + 1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d1), _mm512_mul_ps(s1, dx),
                                           f[2 * i + 1]);
        }
    }
    for (int i = 0; i < MB; ++i) {
        _mm512_storeu_ps(res + i * W4_PANEL, f[2 * i]);
        _mm512_storeu_ps(res + i * W4_PANEL + 16, f[2 * i + 1]);
    }
}

static W4_TARGET void tile_vnni_rt(const W4Job *job, int mb, const uint8_t *wp,
                                   const uint16_t *sp, const uint8_t *zp, int64_t m,
                                   float *res) {
    switch (mb) {
    case 1: tile_vnni(job, 1, wp, sp, zp, m, res); break;
    case 2: tile_vnni(job, 2, wp, sp, zp, m, res); break;
    case 3: tile_vnni(job, 3, wp, sp, zp, m, res); break;
    default: tile_vnni(job, 4, wp, sp, zp, m, res); break;
    }
}

static int have_vnni(void) {
    static int known = -1;
    if (known < 0) known = __builtin_cpu_supports("avx512vnni") ? 1 : 0;
    return known;
}
#endif

/* chunk: panels [p0, p1) against x rows [m0, m0 + mblock) */
static void run_w4(void *ctx, int64_t chunk) {
    const W4Job *job = (const W4Job *)ctx;
    const W4Args *a = job->a;
    const int64_t np = (a->n + W4_PANEL - 1) / W4_PANEL, ng = job->nblk * W4_BLOCK / a->group;
    const int64_t pc = chunk % job->pchunks, m0 = chunk / job->pchunks * job->mblock;
    const int64_t M = m0 + job->mblock < a->m ? m0 + job->mblock : a->m;
    const int64_t p0 = pc * job->chunk_panels;
    const int64_t p1 = p0 + job->chunk_panels < np ? p0 + job->chunk_panels : np;
    const uint8_t *w = (const uint8_t *)PTR(a->w);
    const uint16_t *sc = (const uint16_t *)PTR(a->scales);
    const uint8_t *zs = (const uint8_t *)PTR(a->zeros);
    for (int64_t p = p0; p < p1; ++p) {
        const uint8_t *wp = w + p * job->nblk * W4_BLOCK_BYTES;
        const uint16_t *sp = sc + p * ng * W4_PANEL;
        const uint8_t *zp = zs ? zs + p * ng * W4_PANEL : NULL;
        for (int64_t m = m0; m < M; m += W4_MB) {
            const int mb = M - m < W4_MB ? (int)(M - m) : W4_MB;
            float res[W4_MB * W4_PANEL];
#ifdef W4_VNNI
            if (have_vnni())
                tile_vnni_rt(job, mb, wp, sp, zp, m, res);
            else
#endif
                tile_scalar(job, mb, wp, sp, zp, m, res);
            for (int i = 0; i < mb; ++i) w4_emit(a, m + i, p * W4_PANEL, res + i * W4_PANEL);
        }
    }
}

typedef struct {
    const W4Args *a;
    const void *x;
    int64_t xs, nblk;
    float *xf;
    int8_t *xq;
    float *dx;
    int32_t *xsum;
} QuantJob;

static void quant_rows(void *ctx, int64_t r0, int64_t r1) {
    const QuantJob *q = (const QuantJob *)ctx;
    const int64_t K = q->a->k, kp = q->nblk * W4_BLOCK;
    for (int64_t m = r0; m < r1; ++m) {
        float *row = q->xf + m * K;
        const float *xr = atb_load(q->x, (int)q->a->x_dt, m * q->xs, K, row);
        quant_row(xr, K, q->nblk, q->xq + m * kp, q->dx + m * q->nblk, q->xsum + m * q->nblk);
    }
}

/* Returns 0, ATB_ERR_ARGS for a bad call, ATB_ERR_NOMEM when the scratch fails. */
ATB_API int64_t atb_linear_w4(const W4Args *a) {
    if (!a || a->m < 0 || a->k <= 0 || a->n <= 0 || !a->x || !a->w || !a->scales || !a->y)
        return ATB_ERR_ARGS;
    if (a->group < W4_BLOCK || a->group % W4_BLOCK) return ATB_ERR_ARGS;
    if (a->x_dt < 0 || a->x_dt > ATB_F16 || a->y_dt < 0 || a->y_dt > ATB_F16) return ATB_ERR_ARGS;
    if (a->bias && (a->bias_dt < 0 || a->bias_dt > ATB_F16)) return ATB_ERR_ARGS;
    if (a->m == 0) return 0;
    const int64_t M = a->m, K = a->k;
    const int64_t nblk = (K + a->group - 1) / a->group * (a->group / W4_BLOCK);
    const int64_t kp = nblk * W4_BLOCK;
    void *normed = NULL;
    const void *x = PTR(a->x);
    int64_t xs = a->x_stride;
    if (a->norm) { /* RmsNorm rows stored at x's dtype, as the separate kernel would */
        normed = malloc((size_t)(M * K * atb_dt_size((int)a->x_dt)));
        if (!normed) return ATB_ERR_NOMEM;
        atb_rms_norm_rows(x, NULL, NULL, normed, PTR(a->norm_w), (int)a->x_dt, (int)a->norm_w_dt, 0,
                          M, K, xs, 0, 0, K, (float)a->norm_eps, 0.f);
        x = normed;
        xs = K;
    }
    float *xf = (float *)malloc((size_t)(M * K) * sizeof(float));
    int8_t *xq = (int8_t *)malloc((size_t)(M * kp));
    float *dx = (float *)malloc((size_t)(M * nblk) * sizeof(float));
    int32_t *xsum = (int32_t *)malloc((size_t)(M * nblk) * sizeof(int32_t));
    int64_t rc = 0;
    if (!xf || !xq || !dx || !xsum) {
        rc = ATB_ERR_NOMEM;
        goto done;
    }
    int nth = (int)(a->threads > 0 ? a->threads : 1);
    {
        QuantJob qj = {a, x, xs, nblk, xf, xq, dx, xsum};
        atb_parallel_rows(quant_rows, &qj, M, M * K, nth);
    }
    W4Job job = {a, xq, dx, xsum, nblk, 0, 0, 0};
    const int64_t np = (a->n + W4_PANEL - 1) / W4_PANEL;
    if (np * nblk * W4_BLOCK_BYTES * ((M + W4_MB - 1) / W4_MB) < (64 << 10)) nth = 1;
    const int big = M > W4_MBLOCK;
    job.mblock = big ? W4_MBLOCK : M;
    const int64_t nmb = (M + job.mblock - 1) / job.mblock;
    const int64_t per_block = (8 * nth + nmb - 1) / nmb;
    job.chunk_panels = (np + per_block - 1) / per_block;
    job.pchunks = (np + job.chunk_panels - 1) / job.chunk_panels;
    if (big)
        atb_parallel_chunks_big(run_w4, &job, nmb * job.pchunks, nth);
    else
        atb_parallel_chunks(run_w4, &job, job.pchunks, nth);
done:
    free(xf);
    free(xq);
    free(dx);
    free(xsum);
    free(normed);
    return rc;
}

/* flash.c's lane loops outside AVX-512 builds (see flash_lanes.h): the AVX2 score and
 * value tiles, R rows (keys, or value columns) x 16 lanes in 2R accumulators, R = 6, 3
 * or 1; the online softmax in plain C. */
#include <math.h>

#include "common.h"
#include "flash_lanes.h"
#include "simd.h"

#ifdef ATB_AVX2
#define FL2_UNROLL _Pragma("GCC unroll 8")

/* St[r][c..c+16) = sum_d kr[r][d] Qt[d][c..] for R keys */
static inline __attribute__((always_inline)) void score_tile(int R, const float *const *kr,
                                                             const float *Qt, float *St,
                                                             int64_t c, int64_t Mp, int64_t D) {
    __m256 acc[6][2];
    FL2_UNROLL
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; ++d) {
        const __m256 q0 = _mm256_loadu_ps(Qt + d * Mp + c), q1 = _mm256_loadu_ps(Qt + d * Mp + c + 8);
        FL2_UNROLL
        for (int r = 0; r < R; ++r) {
            const __m256 kb = _mm256_broadcast_ss(kr[r] + d);
            acc[r][0] = _mm256_fmadd_ps(kb, q0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(kb, q1, acc[r][1]);
        }
    }
    FL2_UNROLL
    for (int r = 0; r < R; ++r) {
        _mm256_storeu_ps(St + r * Mp + c, acc[r][0]);
        _mm256_storeu_ps(St + r * Mp + c + 8, acc[r][1]);
    }
}

/* Ot[d0 + r][c..c+16) += sum_j vr[j][d0 + r] St[j][c..] for R value columns */
static inline __attribute__((always_inline)) void pv_tile(int R, const float *const *vr,
                                                          const float *St, float *Ot, int64_t d0,
                                                          int64_t c, int64_t Mp, int nk) {
    __m256 acc[6][2];
    FL2_UNROLL
    for (int r = 0; r < R; ++r) {
        acc[r][0] = _mm256_loadu_ps(Ot + (d0 + r) * Mp + c);
        acc[r][1] = _mm256_loadu_ps(Ot + (d0 + r) * Mp + c + 8);
    }
    for (int j = 0; j < nk; ++j) {
        const __m256 p0 = _mm256_loadu_ps(St + j * Mp + c), p1 = _mm256_loadu_ps(St + j * Mp + c + 8);
        FL2_UNROLL
        for (int r = 0; r < R; ++r) {
            const __m256 vb = _mm256_broadcast_ss(vr[j] + d0 + r);
            acc[r][0] = _mm256_fmadd_ps(vb, p0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(vb, p1, acc[r][1]);
        }
    }
    FL2_UNROLL
    for (int r = 0; r < R; ++r) {
        _mm256_storeu_ps(Ot + (d0 + r) * Mp + c, acc[r][0]);
        _mm256_storeu_ps(Ot + (d0 + r) * Mp + c + 8, acc[r][1]);
    }
}

/* 8 elements of type dt at p, widened to fp32 (exact) */
static inline __m256 load8(const void *p, int dt) {
    if (dt == ATB_F32) return _mm256_loadu_ps((const float *)p);
    const __m128i h = _mm_loadu_si128((const __m128i *)p);
    if (dt == ATB_F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

void atb_flash_fill_q8(const void *const *src, int dt, float *Qt, int64_t m0, int64_t Mp,
                       int64_t D, float scale) {
    const __m256 sc = _mm256_set1_ps(scale);
    const int64_t es = atb_dt_size(dt);
    int64_t d = 0;
    for (; d + 8 <= D; d += 8) {   /* an 8 x 8 transpose: lane i's d0..d0+8 -> column i */
        __m256 r[8], t[8], u[8];
        for (int i = 0; i < 8; ++i) r[i] = load8((const char *)src[i] + d * es, dt);
        for (int i = 0; i < 8; i += 2) {
            t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
            t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
        }
        for (int i = 0; i < 8; i += 4) {
            u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
            u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
            u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
            u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
        }
        for (int j = 0; j < 4; ++j) {
            _mm256_storeu_ps(Qt + (d + j) * Mp + m0,
                             _mm256_mul_ps(_mm256_permute2f128_ps(u[j], u[j + 4], 0x20), sc));
            _mm256_storeu_ps(Qt + (d + j + 4) * Mp + m0,
                             _mm256_mul_ps(_mm256_permute2f128_ps(u[j], u[j + 4], 0x31), sc));
        }
    }
    if (d < D) {                   /* the head dim's tail, lane by lane */
        float row[8];
        for (int i = 0; i < 8; ++i) {
            const float *v = atb_load(src[i], dt, d, D - d, row);
            for (int64_t e = d; e < D; ++e) Qt[e * Mp + m0 + i] = v[e - d] * scale;
        }
    }
}

void atb_flash_scores_lanes(const float *const *kr, const float *Qt, float *St, int64_t Mp,
                            int64_t D, int nk) {
    for (int64_t c = 0; c < Mp; c += 16) {
        int j = 0;
        for (; j + 6 <= nk; j += 6) score_tile(6, kr + j, Qt, St + j * Mp, c, Mp, D);
        for (; j + 3 <= nk; j += 3) score_tile(3, kr + j, Qt, St + j * Mp, c, Mp, D);
        for (; j < nk; ++j) score_tile(1, kr + j, Qt, St + j * Mp, c, Mp, D);
    }
}

void atb_flash_accumulate_lanes(const float *const *vr, const float *St, float *Ot,
                                int64_t Mp, int64_t D, int nk) {
    for (int64_t c = 0; c < Mp; c += 16) {
        int64_t d = 0;
        for (; d + 6 <= D; d += 6) pv_tile(6, vr, St, Ot, d, c, Mp, nk);
        for (; d + 3 <= D; d += 3) pv_tile(3, vr, St, Ot, d, c, Mp, nk);
        for (; d < D; ++d) pv_tile(1, vr, St, Ot, d, c, Mp, nk);
    }
}
#endif

void atb_flash_softmax_lanes(float *St, float *Ot, float *mx, float *sum, const int32_t *pos,
                             int64_t Mp, int64_t D, int64_t j0, int nk, int causal,
                             int64_t window) {
    /* 16 lanes at a time, lanes innermost: each loop over l vectorises (lane l sees key
     * j0 + j when lo[l] < j0 + j <= hi[l]; a padding lane none) */
    for (int64_t c = 0; c < Mp; c += 16) {
        int32_t lo[16], hi[16];
        float bm[16], mnew[16], corr[16], ps[16];
        for (int l = 0; l < 16; ++l) {
            const int64_t p = pos[c + l];
            const int64_t low = window > 0 ? p - window : INT32_MIN;
            hi[l] = p == FL_NONE ? INT32_MIN : (causal ? (int32_t)p : INT32_MAX);
            lo[l] = (int32_t)(low < INT32_MIN ? INT32_MIN : low);
            bm[l] = -INFINITY;
            ps[l] = 0.0f;
        }
        for (int j = 0; j < nk; ++j) {
            const int32_t kj = (int32_t)(j0 + j);
            const float *s = St + j * Mp + c;
#pragma omp simd
            for (int l = 0; l < 16; ++l)
                bm[l] = (kj <= hi[l] && kj > lo[l] && s[l] > bm[l]) ? s[l] : bm[l];
        }
        int rescale = 0;
#pragma omp simd reduction(| : rescale)
        for (int l = 0; l < 16; ++l) {
            const float m0 = mx[c + l];
            mnew[l] = bm[l] > m0 ? bm[l] : m0;
            corr[l] = mnew[l] == -INFINITY ? 1.0f : atb_expf(m0 - mnew[l]);
            rescale |= corr[l] != 1.0f;
        }
        for (int j = 0; j < nk; ++j) {
            const int32_t kj = (int32_t)(j0 + j);
            float *s = St + j * Mp + c;
#pragma omp simd
            for (int l = 0; l < 16; ++l) {
                const float p = (kj <= hi[l] && kj > lo[l]) ? atb_expf(s[l] - mnew[l]) : 0.0f;
                s[l] = p;
                ps[l] += p;
            }
        }
        for (int l = 0; l < 16; ++l) {
            sum[c + l] = sum[c + l] * corr[l] + ps[l];
            mx[c + l] = mnew[l];
        }
        if (rescale)
            for (int64_t d = 0; d < D; ++d)
#pragma omp simd
                for (int l = 0; l < 16; ++l) Ot[d * Mp + c + l] *= corr[l];
    }
}

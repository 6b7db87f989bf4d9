/* flash.c's lane loops outside AVX-512 builds (see flash_lanes.h): on AVX2 one key
 * block's whole walk per 16-lane slice (score tiles, the online softmax in base 2, value
 * tiles; R rows (keys, or value columns) x 16 lanes in 2R accumulators, R = 6, 4, 2, 1);
 * elsewhere the online softmax in plain C. */
#include <math.h>

#include "common.h"
#include "flash_lanes.h"
#include "simd.h"

#ifdef ATB_AVX2
#define FL2_UNROLL _Pragma("GCC unroll 8")

/* Ss[r][0..16) = sum_d kr[r][d] Qs[d][0..16) for R keys (one slice's scores), and bm
 * their running max (a NaN score leaves it: maxps returns its second operand) */
static inline __attribute__((always_inline)) void score_tile(int R, const float *const *kr,
                                                             const float *Qs, float *Ss,
                                                             int64_t D, __m256 bm[2]) {
    __m256 acc[6][2];
    FL2_UNROLL
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; ++d) {
        const __m256 q0 = _mm256_load_ps(Qs + 16 * d), q1 = _mm256_load_ps(Qs + 16 * d + 8);
        FL2_UNROLL
        for (int r = 0; r < R; ++r) {
            const __m256 kb = _mm256_broadcast_ss(kr[r] + d);
            acc[r][0] = _mm256_fmadd_ps(kb, q0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(kb, q1, acc[r][1]);
        }
    }
    FL2_UNROLL
    for (int r = 0; r < R; ++r) {
        _mm256_store_ps(Ss + 16 * r, acc[r][0]);
        _mm256_store_ps(Ss + 16 * r + 8, acc[r][1]);
        bm[0] = _mm256_max_ps(acc[r][0], bm[0]);
        bm[1] = _mm256_max_ps(acc[r][1], bm[1]);
    }
}

/* Os[d0 + r][0..16) = Os[d0 + r][..] * corr + sum_j vr[j][d0 + r] Ss[j][..] for R value
 * columns (the online softmax's rescale rides on the load: times 1 leaves the bits) */
static inline __attribute__((always_inline)) void pv_tile(int R, const float *const *vr,
                                                          const float *Ss, float *Os, int64_t d0,
                                                          const __m256 corr[2], int nk) {
    __m256 acc[6][2];
    FL2_UNROLL
    for (int r = 0; r < R; ++r) {
        acc[r][0] = _mm256_mul_ps(_mm256_load_ps(Os + 16 * (d0 + r)), corr[0]);
        acc[r][1] = _mm256_mul_ps(_mm256_load_ps(Os + 16 * (d0 + r) + 8), corr[1]);
    }
    for (int j = 0; j < nk; ++j) {
        const __m256 p0 = _mm256_load_ps(Ss + 16 * j), p1 = _mm256_load_ps(Ss + 16 * j + 8);
        const float *v = vr[j] + d0;
        FL2_UNROLL
        for (int r = 0; r < R; ++r) {
            const __m256 vb = _mm256_broadcast_ss(v + r);
            acc[r][0] = _mm256_fmadd_ps(vb, p0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(vb, p1, acc[r][1]);
        }
    }
    FL2_UNROLL
    for (int r = 0; r < R; ++r) {
        _mm256_store_ps(Os + 16 * (d0 + r), acc[r][0]);
        _mm256_store_ps(Os + 16 * (d0 + r) + 8, acc[r][1]);
    }
}

/* TILE over [0, n) in tiles of 6, then one of 4, 2 and 1 as the rest needs (a lone
 * 1-wide tile is latency-bound: 64 = 6 x 10 + 4 runs no 3 + 1 pair) */
#define FL2_TILES(n, TILE, i, ...)                                          \
    do {                                                                    \
        int64_t i = 0;                                                      \
        for (; i + 6 <= (n); i += 6) TILE(6, __VA_ARGS__);                  \
        if (i + 4 <= (n)) { TILE(4, __VA_ARGS__); i += 4; }                 \
        if (i + 2 <= (n)) { TILE(2, __VA_ARGS__); i += 2; }                 \
        if (i < (n)) TILE(1, __VA_ARGS__);                                  \
    } while (0)

/* 2^x for x <= 0 (or NaN, kept): the 2^k split with k = round(x) by the 1.5 * 2^23
 * trick, a degree-6 polynomial for 2^r on [-1/2, 1/2] (about 1 ulp); x below
 * -126.5 gives 0 (the scale's exponent field is k + 127 = 0) */
static inline __attribute__((always_inline)) __m256 exp2_neg(__m256 x) {
    const __m256 magic = _mm256_set1_ps(12582912.0f);
    x = _mm256_max_ps(_mm256_set1_ps(-127.0f), x);   /* a NaN x is the result */
    const __m256 t = _mm256_add_ps(x, magic);
    const __m256 r = _mm256_sub_ps(x, _mm256_sub_ps(t, magic));
    __m256 p = _mm256_set1_ps(1.4990878e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3393086e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(9.6196737e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.5503473e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(2.4022637e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(6.9314718e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    /* t's low mantissa bits hold k: (k + 127) << 23 is 2^k (the magic's bits shift out) */
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_castps_si256(t),
                                                         _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* lanes of key kj's scores that lane positions p see (causal, and the window's
 * low bound lowv = p - window when window > 0) */
static inline __attribute__((always_inline)) __m256 seen(__m256i kj, __m256i p, __m256i lowv,
                                                        int window) {
    __m256i v = _mm256_andnot_si256(_mm256_cmpgt_epi32(kj, p), _mm256_set1_epi32(-1));
    if (window) v = _mm256_and_si256(v, _mm256_cmpgt_epi32(kj, lowv));
    return _mm256_castsi256_ps(v);
}

/* the online softmax of one slice's block of nk scores Ss (log2 units) in place: the
 * running max m2 and sum, corr = 2^(old max - new max) for Os. bm: the scores' max
 * (the score tiles'); blocks whole for every lane skip the masks. */
static inline __attribute__((always_inline)) void softmax_slice(
    float *Ss, float *m2, float *sum, const int32_t *pos, int64_t j0, int nk, int causal,
    int64_t window, __m256 bm[2], __m256 corr[2]) {
    int whole = 1;
    if (causal)
        for (int l = 0; l < 16; ++l)
            if (pos[l] != FL_NONE && (j0 + nk - 1 > pos[l] || (window > 0 && j0 <= pos[l] - window)))
                whole = 0;
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    __m256i pv[2], lowv[2];
    const int32_t w32 = window > INT32_MAX ? INT32_MAX : (int32_t)window;
    for (int h = 0; h < 2; ++h) {
        pv[h] = _mm256_loadu_si256((const __m256i *)(pos + 8 * h));
        lowv[h] = _mm256_sub_epi32(pv[h], _mm256_set1_epi32(w32));
    }
    if (!whole) {   /* the max over the keys each lane sees */
        bm[0] = bm[1] = ninf;
        for (int j = 0; j < nk; ++j) {
            const __m256i kj = _mm256_set1_epi32((int32_t)(j0 + j));
            for (int h = 0; h < 2; ++h)
                bm[h] = _mm256_max_ps(_mm256_blendv_ps(ninf, _mm256_load_ps(Ss + 16 * j + 8 * h),
                                                       seen(kj, pv[h], lowv[h], window > 0)),
                                      bm[h]);
        }
    }
    __m256 mnew[2], ps[2];
    for (int h = 0; h < 2; ++h) {
        const __m256 mold = _mm256_loadu_ps(m2 + 8 * h);
        mnew[h] = _mm256_max_ps(bm[h], mold);
        /* lanes that have seen no key yet keep m2 = -inf and a factor of 1 */
        corr[h] = _mm256_blendv_ps(exp2_neg(_mm256_sub_ps(mold, mnew[h])), _mm256_set1_ps(1.0f),
                                   _mm256_cmp_ps(mnew[h], ninf, _CMP_EQ_OQ));
        ps[h] = _mm256_setzero_ps();
    }
    for (int j = 0; j < nk; ++j) {
        const __m256i kj = _mm256_set1_epi32((int32_t)(j0 + j));
        for (int h = 0; h < 2; ++h) {
            float *s = Ss + 16 * j + 8 * h;
            __m256 p = exp2_neg(_mm256_sub_ps(_mm256_load_ps(s), mnew[h]));
            if (!whole) p = _mm256_and_ps(p, seen(kj, pv[h], lowv[h], window > 0));
            _mm256_store_ps(s, p);
            ps[h] = _mm256_add_ps(ps[h], p);
        }
    }
    for (int h = 0; h < 2; ++h) {
        _mm256_storeu_ps(sum + 8 * h, _mm256_fmadd_ps(_mm256_loadu_ps(sum + 8 * h), corr[h], ps[h]));
        _mm256_storeu_ps(m2 + 8 * h, mnew[h]);
    }
}

#define FL2_SCORE(R, kr, Qs, Ss, D, bm) score_tile(R, kr + j, Qs, Ss + 16 * j, D, bm)
#define FL2_PV(R, vr, Ss, Os, corr, nk) pv_tile(R, vr, Ss, Os, d, corr, nk)

void atb_flash_block_lanes(const float *const *kr, const float *const *vr, const float *Qt,
                           float *Ss, float *Ot, float *m2, float *sum, const int32_t *pos,
                           int64_t Mp, int64_t D, int64_t j0, int nk, int causal,
                           int64_t window) {
    for (int64_t c = 0; c < Mp; c += 16) {
        /* causal: the keys past the slice's last position are no lane's (the block
         * on the diagonal: on average half of it for 16 lanes of 4 rows) */
        int n = nk;
        if (causal) {
            int64_t last = -1;
            for (int l = 0; l < 16; ++l)
                if (pos[c + l] != FL_NONE && pos[c + l] > last) last = pos[c + l];
            if (last - j0 + 1 < n) n = (int)(last - j0 + 1);
            if (n <= 0) continue;   /* (a factor of 1: m2, sum and Os stay) */
        }
        const float *Qs = Qt + c * D;
        float *Os = Ot + c * D;
        __m256 corr[2], bm[2] = {_mm256_set1_ps(-INFINITY), _mm256_set1_ps(-INFINITY)};
        FL2_TILES(n, FL2_SCORE, j, kr, Qs, Ss, D, bm);
        softmax_slice(Ss, m2 + c, sum + c, pos + c, j0, n, causal, window, bm, corr);
        FL2_TILES(D, FL2_PV, d, vr, Ss, Os, corr, n);
    }
}

/* 8 elements of type dt at p, widened to fp32 (exact) */
static inline __m256 load8(const void *p, int dt) {
    if (dt == ATB_F32) return _mm256_loadu_ps((const float *)p);
    const __m128i h = _mm_loadu_si128((const __m128i *)p);
    if (dt == ATB_F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* r[i][j] <- r[j][i] for an 8 x 8 block held as 8 rows */
static inline __attribute__((always_inline)) void transpose8(__m256 r[8]) {
    __m256 t[8], u[8];
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
        r[j] = _mm256_permute2f128_ps(u[j], u[j + 4], 0x20);
        r[j + 4] = _mm256_permute2f128_ps(u[j], u[j + 4], 0x31);
    }
}

void atb_flash_fill_q8(const void *const *src, int dt, float *Qt, int64_t m0, int64_t D,
                       float scale) {
    const __m256 sc = _mm256_set1_ps(scale);
    const int64_t es = atb_dt_size(dt);
    float *Qs = Qt + (m0 & ~(int64_t)15) * D + (m0 & 15);   /* m0's slice, 8-lane half */
    int64_t d = 0;
    for (; d + 8 <= D; d += 8) {   /* an 8 x 8 transpose: lane i's d0..d0+8 -> column i */
        __m256 r[8];
        for (int i = 0; i < 8; ++i) r[i] = load8((const char *)src[i] + d * es, dt);
        transpose8(r);
        for (int j = 0; j < 8; ++j) _mm256_storeu_ps(Qs + 16 * (d + j), _mm256_mul_ps(r[j], sc));
    }
    if (d < D) {                   /* the head dim's tail, lane by lane */
        float row[8];
        for (int i = 0; i < 8; ++i) {
            const float *v = atb_load(src[i], dt, d, D - d, row);
            for (int64_t e = d; e < D; ++e) Qs[16 * e + i] = v[e - d] * scale;
        }
    }
}


void atb_flash_out8(const float *Ot, int64_t m0, int64_t D, const float *inv, float *const *dst) {
    const float *Os = Ot + (m0 & ~(int64_t)15) * D + (m0 & 15);
    int64_t d = 0;
    for (; d + 8 <= D; d += 8) {   /* column i of 8 d rows -> lane i's d0..d0+8 */
        __m256 r[8];
        for (int j = 0; j < 8; ++j) r[j] = _mm256_loadu_ps(Os + 16 * (d + j));
        transpose8(r);
        for (int i = 0; i < 8; ++i)
            _mm256_storeu_ps(dst[i] + d, _mm256_mul_ps(r[i], _mm256_set1_ps(inv[i])));
    }
    for (; d < D; ++d)
        for (int i = 0; i < 8; ++i) dst[i][d] = Os[16 * d + i] * inv[i];
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

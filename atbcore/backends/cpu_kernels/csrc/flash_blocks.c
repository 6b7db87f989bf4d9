/* flash.c's walk of one key block in AVX-512 and plain builds (AVX2 builds walk it in
 * flash_lanes.c): the scores S^T = K Q^T as 6-key x 64-lane register tiles (AVX-512;
 * lanes innermost loops elsewhere), the online softmax across lanes with the causal /
 * window rules as per-lane position masks, then O^T += V^T P^T as 6-row x 64-lane
 * tiles. Qt, Ot [D][Mp], St [64][Mp]. */
#include <math.h>

#include "common.h"
#include "flash_lanes.h"
#include "simd.h"

#ifndef ATB_AVX2

#define FL_R 6       /* keys (scores) or value columns (sums) per register tile */

#ifdef ATB_AVX512
/* the tiles' loops over keys/rows and vectors must unroll completely (their
 * accumulators then live in registers) */
#define FL_UNROLL _Pragma("GCC unroll 8")

/* St[j][c..c+16 NZ) = sum_d kr[j][d] Qt[d][c..] for the R keys kr[0..R) */
static inline __attribute__((always_inline)) void score_tile(int R, int NZ, const float *const *kr,
                                                             const float *Qt, float *St,
                                                             int64_t c, int64_t Mp, int64_t D) {
    __m512 acc[FL_R][4], qv[4];
    FL_UNROLL
    for (int r = 0; r < R; ++r) {
        FL_UNROLL
        for (int u = 0; u < NZ; ++u) acc[r][u] = _mm512_setzero_ps();
    }
    for (int64_t d = 0; d < D; ++d) {
        FL_UNROLL
        for (int u = 0; u < NZ; ++u) qv[u] = _mm512_loadu_ps(Qt + d * Mp + c + 16 * u);
        FL_UNROLL
        for (int r = 0; r < R; ++r) {
            __m512 kb = _mm512_set1_ps(kr[r][d]);
            FL_UNROLL
            for (int u = 0; u < NZ; ++u) acc[r][u] = _mm512_fmadd_ps(kb, qv[u], acc[r][u]);
        }
    }
    FL_UNROLL
    for (int r = 0; r < R; ++r) {
        FL_UNROLL
        for (int u = 0; u < NZ; ++u) _mm512_storeu_ps(St + r * Mp + c + 16 * u, acc[r][u]);
    }
}

/* Ot[d0 + r][c..c+16 NZ) += sum_j vr[j][d0 + r] St[j][c..] for R value columns */
static inline __attribute__((always_inline)) void pv_tile(int R, int NZ, const float *const *vr,
                                                          const float *St, float *Ot, int64_t d0,
                                                          int64_t c, int64_t Mp, int nk) {
    __m512 acc[FL_R][4], pv[4];
    FL_UNROLL
    for (int r = 0; r < R; ++r) {
        FL_UNROLL
        for (int u = 0; u < NZ; ++u) acc[r][u] = _mm512_loadu_ps(Ot + (d0 + r) * Mp + c + 16 * u);
    }
    for (int j = 0; j < nk; ++j) {
        FL_UNROLL
        for (int u = 0; u < NZ; ++u) pv[u] = _mm512_loadu_ps(St + j * Mp + c + 16 * u);
        FL_UNROLL
        for (int r = 0; r < R; ++r) {
            __m512 vb = _mm512_set1_ps(vr[j][d0 + r]);
            FL_UNROLL
            for (int u = 0; u < NZ; ++u) acc[r][u] = _mm512_fmadd_ps(vb, pv[u], acc[r][u]);
        }
    }
    FL_UNROLL
    for (int r = 0; r < R; ++r) {
        FL_UNROLL
        for (int u = 0; u < NZ; ++u) _mm512_storeu_ps(Ot + (d0 + r) * Mp + c + 16 * u, acc[r][u]);
    }
}

/* TILE over rows [0, n) in tiles of 6, 3 and 1, NZ vectors wide */
#define FL_ROW_TILES(n, NZ, TILE, i, ...)                                   \
    do {                                                                    \
        int64_t i = 0;                                                      \
        for (; i + FL_R <= (n); i += FL_R) TILE(FL_R, NZ, __VA_ARGS__);     \
        for (; i + 3 <= (n); i += 3) TILE(3, NZ, __VA_ARGS__);              \
        for (; i < (n); ++i) TILE(1, NZ, __VA_ARGS__);                      \
    } while (0)
#define FL_BY_WIDTH(nz, n, TILE, i, ...)                                    \
    switch (nz) {                                                           \
    case 1: FL_ROW_TILES(n, 1, TILE, i, __VA_ARGS__); break;                \
    case 2: FL_ROW_TILES(n, 2, TILE, i, __VA_ARGS__); break;                \
    case 3: FL_ROW_TILES(n, 3, TILE, i, __VA_ARGS__); break;                \
    default: FL_ROW_TILES(n, 4, TILE, i, __VA_ARGS__); break;               \
    }
/* TILE over rows [0, n) for every 64 lanes c of [0, Mp) (the last ones 16..64 wide) */
#define FL_OVER_LANES(Mp, n, TILE, i, ...)                                  \
    for (int64_t c = 0; c < (Mp); c += 64) {                                \
        const int64_t w = (Mp) - c < 64 ? (Mp) - c : 64;                    \
        FL_BY_WIDTH(w / 16, n, TILE, i, __VA_ARGS__)                        \
    }
#endif

/* St[j][0..Mp) = kr[j] . Qt for the block's nk keys */
void atb_flash_scores(const float *const *kr, const float *Qt, float *St, int64_t Mp, int64_t D,
                      int nk) {
#ifdef ATB_AVX512
    FL_OVER_LANES(Mp, nk, score_tile, j, kr + j, Qt, St + j * Mp, c, Mp, D)
#else
    for (int j = 0; j < nk; ++j) {
        float *s = St + j * Mp;
        for (int64_t m = 0; m < Mp; ++m) s[m] = 0.0f;
        for (int64_t d = 0; d < D; ++d) {
            const float kv = kr[j][d], *qt = Qt + d * Mp;
#pragma omp simd
            for (int64_t m = 0; m < Mp; ++m) s[m] += kv * qt[m];
        }
    }
#endif
}

/* Ot[d][0..Mp) += sum_j vr[j][d] St[j][0..Mp) */
void atb_flash_accumulate(const float *const *vr, const float *St, float *Ot, int64_t Mp, int64_t D,
                          int nk) {
#ifdef ATB_AVX512
    FL_OVER_LANES(Mp, D, pv_tile, d, vr, St, Ot, d, c, Mp, nk)
#else
    for (int64_t d = 0; d < D; ++d) {
        float *o = Ot + d * Mp;
        for (int j = 0; j < nk; ++j) {
            const float vv = vr[j][d], *s = St + j * Mp;
#pragma omp simd
            for (int64_t m = 0; m < Mp; ++m) o[m] += vv * s[m];
        }
    }
#endif
}

/* The online softmax over one key block [j0, j0 + nk) for every lane m: scores of
 * keys a lane does not see become 0, the others exp(s - max); the running max mx,
 * sum and Ot rescale by exp(old max - new max). pos[m]: lane m's position. */
void atb_flash_softmax(float *St, float *Ot, float *mx, float *sum, const int32_t *pos,
                       int64_t Mp, int64_t D, int64_t j0, int nk, int causal, int64_t window) {
#ifdef ATB_AVX512
    for (int64_t c = 0; c < Mp; c += 16) {
        const __m512i pv = _mm512_loadu_si512(pos + c);
        /* positions are int32 lanes: a window past INT32_MAX sees every earlier key
         * anyway, so saturate it rather than let the cast wrap it negative */
        const int32_t w32 = window > INT32_MAX ? INT32_MAX : (int32_t)window;
        const __m512i lowv = _mm512_sub_epi32(pv, _mm512_set1_epi32(w32));
        __mmask16 vis[FL_BK];
        __m512 bm = _mm512_set1_ps(-INFINITY);
        for (int j = 0; j < nk; ++j) {
            const __m512i kj = _mm512_set1_epi32((int32_t)(j0 + j));
            __mmask16 v = causal ? _mm512_cmp_epi32_mask(kj, pv, _MM_CMPINT_LE)
                                 : _mm512_cmp_epi32_mask(pv, _mm512_set1_epi32(FL_NONE),
                                                         _MM_CMPINT_NE);
            if (window > 0) v &= _mm512_cmp_epi32_mask(kj, lowv, _MM_CMPINT_GT);
            vis[j] = v;
            bm = _mm512_mask_max_ps(bm, v, bm, _mm512_loadu_ps(St + j * Mp + c));
        }
        const __m512 mold = _mm512_loadu_ps(mx + c);
        const __m512 mnew = _mm512_max_ps(mold, bm);
        /* lanes that have seen no key yet keep mx = -inf and a factor of 1 */
        const __mmask16 live = _mm512_cmp_ps_mask(mnew, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
        const __m512 corr = _mm512_mask_blend_ps(live, _mm512_set1_ps(1.0f),
                                                 atb_exp16(_mm512_sub_ps(mold, mnew)));
        __m512 ps = _mm512_setzero_ps();
        for (int j = 0; j < nk; ++j) {
            float *s = St + j * Mp + c;
            __m512 z = _mm512_sub_ps(_mm512_loadu_ps(s), mnew);
            __m512 p = _mm512_maskz_mov_ps(vis[j], atb_exp16(z));
            _mm512_storeu_ps(s, p);
            ps = _mm512_add_ps(ps, p);
        }
        _mm512_storeu_ps(sum + c, _mm512_fmadd_ps(_mm512_loadu_ps(sum + c), corr, ps));
        _mm512_storeu_ps(mx + c, mnew);
        if (_mm512_cmp_ps_mask(corr, _mm512_set1_ps(1.0f), _CMP_NEQ_OQ))
            for (int64_t d = 0; d < D; ++d)
                _mm512_storeu_ps(Ot + d * Mp + c,
                                 _mm512_mul_ps(_mm512_loadu_ps(Ot + d * Mp + c), corr));
    }
#else
    atb_flash_softmax_lanes(St, Ot, mx, sum, pos, Mp, D, j0, nk, causal, window);
#endif
}

#endif

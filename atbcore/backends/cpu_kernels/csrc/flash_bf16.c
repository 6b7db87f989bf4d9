/* flash.c's score product for bf16 q and k with VDPBF16PS (see flash_bf16.h): each
 * instruction multiplies a pair of bf16 per lane and adds both products, twice the
 * multiply-adds of flash.c's fp32 FMA tiles, and the keys are read as bf16 rows in
 * place (no widening to fp32). q and k are bf16, so their products are exact and the
 * sums fp32 as in flash.c (the scale applied once per score instead of to q).
 *
 * The value product stays flash.c's fp32 one: with the probabilities rounded to
 * bf16 for VDPBF16PS (GPU FlashAttention's choice) short rows of a bf16 model missed
 * the project's bf16 bound (2.4 % of a seed block's outputs off by 2 ulps). */
#include "flash_bf16.h"

#include <string.h>

#include "common.h"
#include "simd.h"

#define FB_R 6 /* keys per register tile, as flash.c */

int atb_flash_bf16_ready(void) {
#if defined(ATB_AVX512) && defined(__GNUC__) && defined(__x86_64__)
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

void atb_flash_bf16_q(uint32_t *Qp, const uint16_t *q, int64_t m, int64_t Mp, int64_t D) {
    for (int64_t d = 0; d < D; d += 2)
        Qp[(d / 2) * Mp + m] = (uint32_t)q[d] | (d + 1 < D ? (uint32_t)q[d + 1] << 16 : 0u);
}

#if defined(ATB_AVX512) && defined(__GNUC__)
#define FB_TARGET __attribute__((target("avx512bf16")))
#define FB_UNROLL _Pragma("GCC unroll 8")

/* the pair of bf16 at row + d (the second zero past D) */
static inline uint32_t pair_at(const uint16_t *row, int64_t d, int64_t D) {
    if (d + 1 < D) {
        uint32_t p;
        memcpy(&p, row + d, sizeof p);
        return p;
    }
    return row[d];
}

/* St[j][c..c+16 NZ) = scale * sum_d kr[j][d] q[d] for R keys */
static inline FB_TARGET __attribute__((always_inline)) void score_tile(
    int R, int NZ, const uint16_t *const *kr, const uint32_t *Qp, float *St, int64_t c,
    int64_t Mp, int64_t D, float scale) {
    __m512 acc[FB_R][4];
    FB_UNROLL
    for (int r = 0; r < R; ++r) {
        FB_UNROLL
        for (int u = 0; u < NZ; ++u) acc[r][u] = _mm512_setzero_ps();
    }
    for (int64_t d = 0; d < D; d += 2) {
        __m512bh qv[4];
        FB_UNROLL
        for (int u = 0; u < NZ; ++u)
            qv[u] = (__m512bh)_mm512_loadu_si512(Qp + (d / 2) * Mp + c + 16 * u);
        FB_UNROLL
        for (int r = 0; r < R; ++r) {
            const __m512bh kb = (__m512bh)_mm512_set1_epi32((int32_t)pair_at(kr[r], d, D));
            FB_UNROLL
            for (int u = 0; u < NZ; ++u) acc[r][u] = _mm512_dpbf16_ps(acc[r][u], kb, qv[u]);
        }
    }
    const __m512 s = _mm512_set1_ps(scale);
    FB_UNROLL
    for (int r = 0; r < R; ++r) {
        FB_UNROLL
        for (int u = 0; u < NZ; ++u)
            _mm512_storeu_ps(St + r * Mp + c + 16 * u, _mm512_mul_ps(acc[r][u], s));
    }
}

/* TILE over rows [0, n) in tiles of 6, 3 and 1, NZ vectors wide, for every 64
 * lanes c of [0, Mp) (the last ones 16..64 wide): flash.c's walk */
#define FB_ROWS(n, NZ, TILE, i, ...)                                          \
    do {                                                                      \
        int64_t i = 0;                                                        \
        for (; i + FB_R <= (n); i += FB_R) TILE(FB_R, NZ, __VA_ARGS__);       \
        for (; i + 3 <= (n); i += 3) TILE(3, NZ, __VA_ARGS__);                \
        for (; i < (n); ++i) TILE(1, NZ, __VA_ARGS__);                        \
    } while (0)
#define FB_OVER_LANES(Mp, n, TILE, i, ...)                                    \
    for (int64_t c = 0; c < (Mp); c += 64) {                                  \
        const int64_t w = (Mp) - c < 64 ? (Mp) - c : 64;                      \
        switch (w / 16) {                                                     \
        case 1: FB_ROWS(n, 1, TILE, i, __VA_ARGS__); break;                   \
        case 2: FB_ROWS(n, 2, TILE, i, __VA_ARGS__); break;                   \
        case 3: FB_ROWS(n, 3, TILE, i, __VA_ARGS__); break;                   \
        default: FB_ROWS(n, 4, TILE, i, __VA_ARGS__); break;                  \
        }                                                                     \
    }

FB_TARGET void atb_flash_bf16_scores(const uint16_t *const *kr, const uint32_t *Qp, float *St,
                                     int64_t Mp, int64_t D, int nk, float scale) {
    FB_OVER_LANES(Mp, nk, score_tile, j, kr + j, Qp, St + j * Mp, c, Mp, D, scale)
}
#else
void atb_flash_bf16_scores(const uint16_t *const *kr, const uint32_t *Qp, float *St, int64_t Mp,
                           int64_t D, int nk, float scale) {
    (void)kr, (void)Qp, (void)St, (void)Mp, (void)D, (void)nk, (void)scale;
}
#endif

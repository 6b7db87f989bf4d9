/* AVX-512 helpers shared by the kernels that use intrinsics (x86-64-v4 builds). */
#ifndef ATB_SIMD_H
#define ATB_SIMD_H

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define ATB_AVX512 1

/* lane i of the result = the sum of v[i]'s lanes (a transpose-and-add tree: 15 adds
 * for 16 sums, where 16 separate reductions cost ~4x that) */
static inline __attribute__((always_inline)) __m512 atb_reduce16(const __m512 v[16]) {
    __m512 u[8], w[4], g[2];
    for (int i = 0; i < 8; ++i)
        u[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; ++i) {
        __m512d c = _mm512_castps_pd(u[2 * i]), d = _mm512_castps_pd(u[2 * i + 1]);
        w[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(c, d)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(c, d)));
    }
    for (int i = 0; i < 2; ++i)
        g[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(g[0], g[1], 0x88),
                         _mm512_shuffle_f32x4(g[0], g[1], 0xdd));
}
#endif

#endif

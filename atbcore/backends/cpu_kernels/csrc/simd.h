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

/* atb_expf (common.h) on 16 lanes: the same Cephes polynomial after a 2^k split,
 * exp(x < -87.3) = 0 (so exp(-inf) = 0), NaN stays NaN, saturating above 88.7 */
static inline __attribute__((always_inline)) __m512 atb_exp16(__m512 x) {
    const __m512 lo = _mm512_set1_ps(-87.33654022216797f);
    __mmask16 under = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
    /* max/min return their second operand when either is NaN: a NaN x passes */
    __m512 xc = _mm512_min_ps(_mm512_set1_ps(88.72283935546875f), _mm512_max_ps(lo, x));
    __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), xc);
    r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    /* p * 2^k in one instruction (k = 128 near hi still gives a normal float) */
    return _mm512_maskz_mov_ps((__mmask16)~under, _mm512_scalef_ps(p, k));
}
#endif

/* x86-64-v3 builds (AVX2 + FMA, no AVX-512): the few kernels with 256-bit intrinsics */
#if !defined(ATB_AVX512) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define ATB_AVX2 1
#endif

#endif

/* Shared helpers of the atb CPU kernels: dtype codes, fp32 <-> bf16/fp16
 * conversion, block loads/stores and a vectorisable exp.
 *
 * Every kernel computes in fp32 and rounds once when it stores (round to
 * nearest even for both half types). Rows are processed in blocks of
 * ATB_BLOCK floats converted into stack buffers, so one loop body serves every
 * dtype and each inner loop is a plain fp32 loop the compiler vectorises.
 * Plain C11, no headers beyond libc: builds in about a second.
 */
#ifndef ATB_COMMON_H
#define ATB_COMMON_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define ATB_API __attribute__((visibility("default")))
#define ATB_BLOCK 512

/* ATB_I8: int8 codes of a quantized KV cache (read as their integer values; the
 * caller applies the scales) */
enum { ATB_F32 = 0, ATB_BF16 = 1, ATB_F16 = 2, ATB_BOOL = 3, ATB_I8 = 4 };

/* Status codes every entry point returns (0 = done). Positive values are
 * reserved for "grow a table to this many rows and call again" (RoPE). */
#define ATB_ERR_ARGS (-1)
#define ATB_ERR_NEG_POSITION (-2)
#define ATB_ERR_CACHE_OVERFLOW (-3)
#define ATB_ERR_NOMEM (-4)
#define ATB_ERR_NONFINITE (-5)

static inline float atb_bits_to_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint32_t atb_f32_to_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static inline float atb_bf16_to_f32(uint16_t h) { return atb_bits_to_f32((uint32_t)h << 16); }

static inline uint16_t atb_f32_to_bf16(float f) {
    uint32_t u = atb_f32_to_bits(f);
    uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    /* NaN must stay NaN (rounding could carry it into inf) */
    return (uint16_t)(((u & 0x7fffffffu) > 0x7f800000u) ? ((u >> 16) | 0x40u) : rounded);
}

#if defined(__FLT16_MANT_DIG__) && (defined(__x86_64__) || defined(__aarch64__))
/* the compiler's _Float16: F16C / NEON conversions when the target has them */
static inline float atb_f16_to_f32(uint16_t h) {
    _Float16 v;
    memcpy(&v, &h, 2);
    return (float)v;
}
static inline uint16_t atb_f32_to_f16(float f) {
    _Float16 v = (_Float16)f;
    uint16_t h;
    memcpy(&h, &v, 2);
    return h;
}
#else
/* portable bit-level conversions (round to nearest even, subnormals, inf/NaN) */
static inline float atb_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    if (exp == 0x1f) return atb_bits_to_f32(sign | 0x7f800000u | (man << 13));
    if (exp == 0) {
        float v = (float)man * 5.9604644775390625e-8f; /* man * 2^-24 */
        return sign ? -v : v;
    }
    return atb_bits_to_f32(sign | ((exp + 112u) << 23) | (man << 13));
}
static inline uint16_t atb_f32_to_f16(float f) {
    uint32_t u = atb_f32_to_bits(f), sign = (u >> 16) & 0x8000u;
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u);
    if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* rounds to inf */
    if (a < 0x38800000u) {                                   /* subnormal or zero */
        float v = atb_bits_to_f32(a) * 16777216.0f;          /* * 2^24, exact */
        return (uint16_t)(sign | (uint32_t)nearbyintf(v));
    }
    uint32_t r = a - 0x38000000u;                            /* rebias exponent */
    r = (r + 0xfffu + ((r >> 13) & 1u)) >> 13;
    return (uint16_t)(sign | r);
}
#endif

/* dst[0..n) = src[off .. off+n) as fp32 (src of dtype dt). Returns dst, or the
 * source itself for fp32 (no copy). */
static inline const float *atb_load(const void *src, int dt, int64_t off, int64_t n, float *dst) {
    if (dt == ATB_F32) return (const float *)src + off;
    if (dt == ATB_I8) {
        const int8_t *c = (const int8_t *)src + off;
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) dst[i] = (float)c[i];
        return dst;
    }
    const uint16_t *h = (const uint16_t *)src + off;
    if (dt == ATB_BF16) {
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) dst[i] = atb_bf16_to_f32(h[i]);
    } else {
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) dst[i] = atb_f16_to_f32(h[i]);
    }
    return dst;
}

/* dst[off .. off+n) = src[0..n) rounded to dtype dt. */
static inline void atb_store(void *dst, int dt, int64_t off, int64_t n, const float *src) {
    if (dt == ATB_F32) {
        float *d = (float *)dst + off;
        if (d != src) memcpy(d, src, (size_t)n * 4);
        return;
    }
    uint16_t *h = (uint16_t *)dst + off;
    if (dt == ATB_BF16) {
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) h[i] = atb_f32_to_bf16(src[i]);
    } else {
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) h[i] = atb_f32_to_f16(src[i]);
    }
}

/* round-trip through dtype dt: what a value stored in dt reads back as */
static inline void atb_round_trip(int dt, int64_t n, float *v) {
    if (dt == ATB_BF16) {
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) v[i] = atb_bf16_to_f32(atb_f32_to_bf16(v[i]));
    } else if (dt == ATB_F16) {
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) v[i] = atb_f16_to_f32(atb_f32_to_f16(v[i]));
    }
}

static inline int64_t atb_dt_size(int dt) {
    return dt == ATB_F32 ? 4 : (dt == ATB_BOOL || dt == ATB_I8 ? 1 : 2);
}

/* exp(x) in fp32 with ~1 ulp error (Cephes expf polynomial after a 2^k split);
 * branch-free so loops over it vectorise. exp(x < -87.3) = 0 (so exp(-inf) = 0),
 * NaN stays NaN; above 88.7 it saturates at exp(88.7) ~ 3.4e38 rather than
 * overflowing, which no caller here can tell apart (they divide by 1 + exp or
 * only take exp of non-positive numbers). */
static inline float atb_expf(float x) {
    const float hi = 88.72283935546875f, lo = -87.33654022216797f;
    float xc = x < lo ? lo : x;   /* maxps / minps; a NaN x passes through both */
    xc = xc > hi ? hi : xc;
    /* k = round(x / ln2) with the 1.5 * 2^23 trick: no rint call needed */
    float k = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = xc - k * 0.693359375f;
    r = r - k * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    /* p * 2^(k-1) * 2: k = 128 (x near hi) stays a normal float */
    float y = p * atb_bits_to_f32((uint32_t)((int32_t)k + 126) << 23) * 2.0f;
    return x < lo ? 0.0f : y;
}

#endif

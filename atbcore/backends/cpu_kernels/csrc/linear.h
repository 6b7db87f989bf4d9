/* The few-row matmul's argument block and the pieces its two weight layouts share:
 * the [N, K] rows of linear.c and the 32-output panels of panel.c. */
#ifndef ATB_LINEAR_H
#define ATB_LINEAR_H

#include "common.h"
#include "simd.h"

#ifdef ATB_AVX512
#define ATB_LIN_AVX512 1
#endif

enum { W_F32 = 0, W_BF16 = 1, W_F16 = 2, W_I8 = 4 };

typedef struct {
    int64_t x, w, scale, bias, y;               /* addresses; scale/bias 0 = absent */
    int64_t x_dt, w_dt, bias_dt, y_dt;
    int64_t m, k, n;
    int64_t x_stride, w_stride, y_stride;       /* elements between rows */
    int64_t threads;
    int64_t accumulate;                         /* 1: y += result (read at y's dtype) */
    int64_t norm, norm_w, norm_w_dt;            /* norm 1: RmsNorm x first (weight optional) */
    double norm_eps, norm_offset;
    int64_t packed;                             /* 1: w in 32-output panels (see run_panels) */
    int64_t res, res_dt, res_stride;            /* res != 0: y = result + res (a residual read
                                                   from its own rows; accumulate must be 0) */
    int64_t gated, act;                         /* gated > 0 (float panels only): the weight
                                                   is gate | up, each n = 32 gated outputs, and
                                                   y = act(gate) * up (act.h codes), the bias
                                                   (2n: gate's, up's) added to each first */
} LinArgs;

/* the addend of output row m (y itself when accumulating, the residual rows, or none),
 * its dtype and row stride */
static inline const void *lin_addend(const LinArgs *a, int *dt, int64_t *stride) {
    if (a->res) {
        *dt = (int)a->res_dt;
        *stride = a->res_stride;
        return (const void *)(intptr_t)a->res;
    }
    *dt = (int)a->y_dt;
    *stride = a->y_stride;
    return a->accumulate ? (const void *)(intptr_t)a->y : NULL;
}

typedef struct {
    const LinArgs *a;
    const float *xf;   /* x as fp32, rows xs apart */
    int64_t xs;
    int64_t chunk_rows; /* weight rows per pool chunk (a multiple of 16); panels when packed */
    int64_t mblock;     /* packed: x rows per chunk (a block kept in L2 across its panels) */
    int64_t pchunks;    /* packed: panel chunks per block of rows */
    int64_t guide;      /* packed, one block of rows: chunk sizes ~ panels left / guide
                           (panel.c: guided_chunk); 0: chunk_rows panels each */
} Job;

#define P(v) ((const void *)(intptr_t)(v))

static inline int64_t wsize(int wdt) { return wdt == W_F32 ? 4 : (wdt == W_I8 ? 1 : 2); }

#ifdef ATB_LIN_AVX512
static inline __attribute__((always_inline)) __m512 loadw(int wdt, const uint8_t *p,
                                                          __mmask16 mk, int full) {
    switch (wdt) {
    case W_F32:
        return full ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(mk, p);
    case W_BF16: {
        __m256i h = full ? _mm256_loadu_si256((const __m256i *)p) : _mm256_maskz_loadu_epi16(mk, p);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    case W_F16: {
        __m256i h = full ? _mm256_loadu_si256((const __m256i *)p) : _mm256_maskz_loadu_epi16(mk, p);
        return _mm512_cvtph_ps(h);
    }
    default: {
        __m128i b = full ? _mm_loadu_si128((const __m128i *)p) : _mm_maskz_loadu_epi8(mk, p);
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
    }
    }
}
#endif
#ifdef ATB_AVX2
/* 8 weights of dtype wdt at p as fp32 (the AVX2 loadw) */
static inline __attribute__((always_inline)) __m256 loadw8(int wdt, const uint8_t *p) {
    switch (wdt) {
    case W_F32: return _mm256_loadu_ps((const float *)p);
    case W_BF16:
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
    case W_F16: return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    default: return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
    }
}
#endif
#ifndef ATB_LIN_AVX512
static inline float wval(int wdt, const uint8_t *p, int64_t k) {
    switch (wdt) {
    case W_F32: return ((const float *)p)[k];
    case W_BF16: return atb_bf16_to_f32(((const uint16_t *)p)[k]);
    case W_F16: return atb_f16_to_f32(((const uint16_t *)p)[k]);
    default: return (float)((const int8_t *)p)[k];
    }
}
#endif

/* CALL(MB, WDT) for a runtime (mb, wdt) with both as constants, so the compiler
 * unrolls each tile for its row count and weight dtype */
#define ATB_BY_WDT(MB, CALL)                                         \
    switch (wdt) {                                                   \
    case W_F32: CALL(MB, W_F32); break;                              \
    case W_BF16: CALL(MB, W_BF16); break;                            \
    case W_F16: CALL(MB, W_F16); break;                              \
    default: CALL(MB, W_I8); break;                                  \
    }

/* y[m, n] (+)= v * scale[n] + bias[n], rounded once to y's dtype */
static inline void emit(const LinArgs *a, int64_t m, int64_t n, float v) {
    float tmp;
    if (a->scale) v *= ((const float *)P(a->scale))[n];
    if (a->bias) v += *atb_load(P(a->bias), (int)a->bias_dt, n, 1, &tmp);
    int adt;
    int64_t as;
    const void *add = lin_addend(a, &adt, &as);
    if (add) /* the residual add rides in the matmul */
        v += *atb_load(add, adt, m * as + n, 1, &tmp);
    atb_store((void *)P(a->y), (int)a->y_dt, m * a->y_stride + n, 1, &v);
}

/* y = x w^T with w in panels (LinArgs.packed): the job's x rows in 64-row blocks
 * against chunks of panels, on nth threads */
void atb_linear_panels(Job *job, int nth);

#endif

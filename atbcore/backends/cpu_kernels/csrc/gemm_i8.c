/* w8a8 matmul: 8-bit activations (quantized per row, asymmetric, on the fly) times
 * int8 weights (symmetric, one fp32 scale per output channel), int32 sums:
 *
 *   y[m, n] = (sum_k (u[m, k] - z[m]) wq[n, k]) * sx[m] * scale[n] + bias[n]  (+ residual)
 *   lo, hi = min(0, min_k x[m, k]), max(0, max_k x[m, k]);  sx[m] = (hi - lo) / 254
 *   inv = 254 / (hi - lo),  z[m] = 1 - rint(lo inv),  u[m, k] = clamp(rint(x inv) + z, 1, 255)
 *
 * (a row of zeros: sx 0, z 128). The row's range [lo, hi] takes all 255 codes: a skewed
 * row (a GELU's output) gets twice the resolution of max|x| / 127.
 * VPDPBUSD (AVX512_VNNI) multiplies 4 unsigned by 4 signed bytes into an int32 lane,
 * so where it runs x is stored as u and the weights' column sums take the zero point
 * out: sum (u - z) w = sum u w - z sum w. The AVX2 sign tile and the plain loop store
 * u - 128 (in [-127, 127]) and add (128 - z) sum w. The sums are exact integers, so
 * every path and any thread count give the same bits.
 *
 * Weight layout (pack_w8a8 in torch_w8a8.py): panels of 32 outputs, panel p is
 * [K4 + 1, 32, 4] bytes with K4 = ceil(K / 4): byte (q, j, t) = W[32 p + j, 4 q + t]
 * (zeros past N and K), so one 128-byte row is two VPDPBUSD operands (outputs 0-15,
 * 16-31) with no shuffles; the last row holds the 32 outputs' int32 column sums.
 * Each x quad (4 bytes) is one 32-bit broadcast. Decode rows stream each panel once
 * (bandwidth bound: a 128-byte row costs 2 loads, 1 broadcast and 2 VPDPBUSD per
 * x row, where the fp32 w8 kernel widens 4 times as many bytes to fp32 per FMA). */
#include <math.h>

#include "gemm.h"
#include "norm.h"
#include "pool.h"

#define ATB_I8_ROW 128 /* bytes of one panel row: 32 outputs x 4 k */
/* x rows per tile: 12 x 2 accumulators, the two weight vectors and a broadcast fill
 * 27 of the 32 vector registers */
#define ATB_I8_MB 12
#define ATB_I8_U7_ROWS 16 /* x rows from which the AVX2 tile checks for 7-bit weights */

int atb_cpu_vnni(void) {
#if defined(__x86_64__) && defined(__GNUC__)
    static int have = -1;
    if (have < 0) {
        __builtin_cpu_init();
        have = __builtin_cpu_supports("avx512vnni") ? 1 : 0;
    }
    return have;
#else
    return 0;
#endif
}

typedef struct {
    const LinArgs *a;
    const void *x;      /* the float rows (normed into normed first when asked) */
    int64_t xs;         /* their stride */
    void *normed;       /* [M, K] RmsNorm'd rows at x's dtype, or NULL */
    uint8_t *xq;        /* [M, K4 * 4] int8 rows, offset by off */
    int off;            /* 128 for VPDPBUSD and the AVX2 offset tile (unsigned x), else 0 */
    int u7;             /* 1: the AVX2 offset tile (weights within [-64, 64]) */
    float *sx;          /* [M] row scales */
    int32_t *zc;        /* [M] multiples of the column sums to add: -z, or 128 - z */
    int64_t k4;
    int64_t chunk_panels, pchunks, mblock;
} I8Job;

/* rows [r0, r1) of x -> xq, sx */
static void quantize_rows(void *ctx, int64_t r0, int64_t r1) {
    const I8Job *job = (const I8Job *)ctx;
    const int64_t K = job->a->k, KP = job->k4 * 4;
    const int dt = (int)job->a->x_dt, off = job->off;
    const void *x = job->x;
    int64_t xs = job->xs;
    float buf[1024];
    if (job->normed) { /* the RmsNorm of these rows, stored at x's dtype as the separate
                        * kernel would, on this thread (the split's rows) */
        const LinArgs *a = job->a;
        atb_rms_norm_rows(x, NULL, NULL, job->normed, P(a->norm_w), dt, (int)a->norm_w_dt, r0, r1,
                          K, xs, 0, 0, K, (float)a->norm_eps, (float)a->norm_offset);
        x = job->normed;
        xs = K;
    }
    for (int64_t r = r0; r < r1; ++r) {
        uint8_t *q = job->xq + r * KP;
        float lo = 0.0f, hi = 0.0f;
        for (int64_t k0 = 0; k0 < K; k0 += 1024) { /* pass 1: the row's range */
            const int64_t n = K - k0 < 1024 ? K - k0 : 1024;
            const float *v = atb_load(x, dt, r * xs + k0, n, buf);
            /* compares, not fminf/fmaxf: their NaN rule keeps them libm calls */
#pragma omp simd reduction(min : lo) reduction(max : hi)
            for (int64_t i = 0; i < n; ++i) {
                lo = v[i] < lo ? v[i] : lo;
                hi = v[i] > hi ? v[i] : hi;
            }
        }
        const float range = hi - lo, inv = range > 0.0f ? 254.0f / range : 0.0f;
        const int z = range > 0.0f ? 1 - (int)nearbyintf(lo * inv) : 128;
        job->sx[r] = range / 254.0f;
        job->zc[r] = off ? -z : 128 - z;
        const float zf = (float)(z - 128 + off);
        for (int64_t k0 = 0; k0 < K; k0 += 1024) { /* pass 2: round to nearest even */
            const int64_t n = K - k0 < 1024 ? K - k0 : 1024;
            const float *v = atb_load(x, dt, r * xs + k0, n, buf);
#pragma omp simd
            for (int64_t i = 0; i < n; ++i) { /* u (- 128 for signed x), clamped to [1, 255] */
                float t = nearbyintf(v[i] * inv) + zf;
                t = t > 127.0f + off ? 127.0f + off : (t < off - 127.0f ? off - 127.0f : t);
                q[k0 + i] = (uint8_t)((int)t & 255);
            }
        }
        memset(q + K, off, (size_t)(KP - K)); /* past K: weights 0, any x */
    }
}

/* the int32 sums of one x row and one panel, or a tile of rows: res (MB x 32 fp32) =
 * (sum + zc[row] colsum) * sx[row] */
#if defined(ATB_LIN_AVX512) && defined(__GNUC__)
#define ATB_HAVE_VNNI_KERNEL 1
#define ATB_VNNI_TARGET __attribute__((target("avx512vnni")))
/* acc += the u8 x s8 quad dot products of x and w, in place: GCC 12 copies every
 * accumulator of the intrinsic's form once per step in this loop (two register
 * moves per VPDPBUSD, measured ~1.5x slower here) */
#define ATB_DPBUSD(acc, x, w) __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(x), "v"(w))

/* one x row's step: its quad broadcast against both halves of the panel row */
#define ATB_I8_ROW_STEP(i)                                                   \
    if (MB > i) {                                                        \
        int32_t quad;                                                    \
        memcpy(&quad, xq + i * xqs + q * 4, sizeof quad);                \
        const __m512i xb = _mm512_set1_epi32(quad);                      \
        ATB_DPBUSD(lo##i, xb, w0);                                       \
        ATB_DPBUSD(hi##i, xb, w1);                                       \
    }
#define ATB_I8_ROW_OUT(i)                                                    \
    if (MB > i) {                                                        \
        const __m512 s = _mm512_set1_ps(sx[i]);                          \
        const __m512i z = _mm512_set1_epi32(zc[i]);                      \
        lo##i = _mm512_add_epi32(lo##i, _mm512_mullo_epi32(c0, z));      \
        hi##i = _mm512_add_epi32(hi##i, _mm512_mullo_epi32(c1, z));      \
        _mm512_storeu_ps(res + i * 32, _mm512_mul_ps(_mm512_cvtepi32_ps(lo##i), s)); \
        _mm512_storeu_ps(res + i * 32 + 16, _mm512_mul_ps(_mm512_cvtepi32_ps(hi##i), s)); \
    }

/* the accumulators are named variables, not an array: GCC keeps them in registers
 * then (an array of them went through the stack at every step) */
static inline ATB_VNNI_TARGET __attribute__((always_inline)) void i8_tile(
    int MB, const uint8_t *xq, int64_t xqs, const float *sx, const int32_t *zc, const int8_t *w,
    int64_t k4, float *res) {
    __m512i lo0 = _mm512_setzero_si512(), hi0 = lo0, lo1 = lo0, hi1 = lo0, lo2 = lo0, hi2 = lo0,
            lo3 = lo0, hi3 = lo0, lo4 = lo0, hi4 = lo0, lo5 = lo0, hi5 = lo0, lo6 = lo0,
            hi6 = lo0, lo7 = lo0, hi7 = lo0, lo8 = lo0, hi8 = lo0, lo9 = lo0, hi9 = lo0,
            lo10 = lo0, hi10 = lo0, lo11 = lo0, hi11 = lo0;
    for (int64_t q = 0; q < k4; ++q) {
        const __m512i w0 = _mm512_loadu_si512(w + q * ATB_I8_ROW);
        const __m512i w1 = _mm512_loadu_si512(w + q * ATB_I8_ROW + 64);
        ATB_I8_ROW_STEP(0) ATB_I8_ROW_STEP(1) ATB_I8_ROW_STEP(2) ATB_I8_ROW_STEP(3)
        ATB_I8_ROW_STEP(4) ATB_I8_ROW_STEP(5) ATB_I8_ROW_STEP(6) ATB_I8_ROW_STEP(7)
        ATB_I8_ROW_STEP(8) ATB_I8_ROW_STEP(9) ATB_I8_ROW_STEP(10) ATB_I8_ROW_STEP(11)
    }
    const int32_t *cs = (const int32_t *)(w + k4 * ATB_I8_ROW);
    const __m512i c0 = _mm512_loadu_si512(cs), c1 = _mm512_loadu_si512(cs + 16);
    ATB_I8_ROW_OUT(0) ATB_I8_ROW_OUT(1) ATB_I8_ROW_OUT(2) ATB_I8_ROW_OUT(3)
    ATB_I8_ROW_OUT(4) ATB_I8_ROW_OUT(5) ATB_I8_ROW_OUT(6) ATB_I8_ROW_OUT(7)
    ATB_I8_ROW_OUT(8) ATB_I8_ROW_OUT(9) ATB_I8_ROW_OUT(10) ATB_I8_ROW_OUT(11)
}

static ATB_VNNI_TARGET void i8_tile_vnni(int mb, const uint8_t *xq, int64_t xqs, const float *sx,
                                         const int32_t *zc, const int8_t *w, int64_t k4,
                                         float *res) {
#define ATB_I8_VNNI_CASE(n) case n: i8_tile(n, xq, xqs, sx, zc, w, k4, res); break;
    switch (mb) {
    ATB_I8_VNNI_CASE(1) ATB_I8_VNNI_CASE(2) ATB_I8_VNNI_CASE(3) ATB_I8_VNNI_CASE(4)
    ATB_I8_VNNI_CASE(5) ATB_I8_VNNI_CASE(6) ATB_I8_VNNI_CASE(7) ATB_I8_VNNI_CASE(8)
    ATB_I8_VNNI_CASE(9) ATB_I8_VNNI_CASE(10) ATB_I8_VNNI_CASE(11)
    default: i8_tile(12, xq, xqs, sx, zc, w, k4, res); break;
    }
}
#endif

/* the same sums in plain C (CPUs without VNNI or AVX2; x signed): exact integers, the
 * same bits */
__attribute__((unused)) static void i8_tile_plain(int mb, const uint8_t *xq, int64_t xqs,
                                                  const float *sx, const int32_t *zc,
                                                  const int8_t *w, int64_t k4, float *res) {
    for (int i = 0; i < mb; ++i) {
        int32_t acc[32] = {0};
        for (int64_t q = 0; q < k4; ++q) {
            const int8_t *xv = (const int8_t *)(xq + i * xqs + q * 4);
            const int8_t *wr = w + q * ATB_I8_ROW;
#pragma omp simd
            for (int j = 0; j < 32; ++j)
                acc[j] += xv[0] * wr[4 * j] + xv[1] * wr[4 * j + 1] + xv[2] * wr[4 * j + 2] +
                          xv[3] * wr[4 * j + 3];
        }
        const int32_t *cs = (const int32_t *)(w + k4 * ATB_I8_ROW);
        for (int j = 0; j < 32; ++j) res[i * 32 + j] = (float)(acc[j] + zc[i] * cs[j]) * sx[i];
    }
}

#ifdef ATB_AVX2
/* the same sums on AVX2 (no VPDPBUSD), two ways, both exact:
 * - weights within [-64, 64] (w8a8 weights as the models quantize them:
 *   atbcore.ops.linear_quant.quantize_w8a8), many rows: x stored as u <= 255 and
 *   VPMADDUBSW of u and w straight (a pair sum is at most 2 x 255 x 64 = 32640, within
 *   int16), VPMADDWD to int32: 3 vector ops per 32 products;
 * - any int8 weights: VPMADDUBSW of |w| (u8, <= 128) and the x quad stored as u - 128
 *   (|x| <= 127) with w's sign (pair sums <= 32512): 4 ops per 32 products (VPSIGNB
 *   shares the multiply ports here, so this runs ~0.75x the first).
 * Tile: 4 rows (6 the first way: no |w| registers) x 16 outputs (half the panel) in
 * named accumulators (an array of them went through the stack). */
/* acc += u . w (w read from memory) in place: in asm, as the VNNI tile's step, since
 * GCC otherwise keeps accumulator copies and carries some through the stack */
#define ATB_I8_U7(acc, a, wp, xb)                                                     \
    do {                                                                          \
        __m256i t_;                                                               \
        __asm__("vpmaddubsw %[w], %[x], %[t]\n\t"                                  \
                "vpmaddwd %[one], %[t], %[t]\n\t"                                 \
                "vpaddd %[t], %[sum], %[sum]"                                     \
                : [sum] "+x"(acc), [t] "=&x"(t_)                                  \
                : [x] "x"(xb), [one] "x"(ones), [w] "m"(*(const __m256i *)(wp))); \
    } while (0)
#define ATB_I8_SGN(acc, a, wp, xb)                                                    \
    do {                                                                          \
        __m256i t_;                                                               \
        __asm__("vpsignb %[w], %[x], %[t]\n\t"                                    \
                "vpmaddubsw %[t], %[aw], %[t]\n\t"                                 \
                "vpmaddwd %[one], %[t], %[t]\n\t"                                 \
                "vpaddd %[t], %[sum], %[sum]"                                     \
                : [sum] "+x"(acc), [t] "=&x"(t_)                                  \
                : [x] "x"(xb), [aw] "x"(a), [one] "x"(ones),                       \
                  [w] "m"(*(const __m256i *)(wp)));                               \
    } while (0)
#define ATB_I8_AVX2_ROW(i)                                                            \
    if (MB > i) {                                                                 \
        int32_t quad;                                                             \
        memcpy(&quad, xq + i * xqs + q * 4, sizeof quad);                         \
        const __m256i xb = _mm256_set1_epi32(quad);                               \
        if (U7) {                                                                 \
            ATB_I8_U7(l##i, a0, wq, xb);                                          \
            ATB_I8_U7(h##i, a1, wq + 32, xb);                                     \
        } else {                                                                  \
            ATB_I8_SGN(l##i, a0, wq, xb);                                         \
            ATB_I8_SGN(h##i, a1, wq + 32, xb);                                    \
        }                                                                         \
    }
#define ATB_I8_AVX2_OUT(i)                                                            \
    if (MB > i) {                                                                 \
        const __m256 s = _mm256_set1_ps(sx[i]);                                   \
        const __m256i z = _mm256_set1_epi32(zc[i]);                               \
        l##i = _mm256_add_epi32(l##i, _mm256_mullo_epi32(c0, z));                 \
        h##i = _mm256_add_epi32(h##i, _mm256_mullo_epi32(c1, z));                 \
        _mm256_storeu_ps(res + i * 32 + hf * 16, _mm256_mul_ps(_mm256_cvtepi32_ps(l##i), s)); \
        _mm256_storeu_ps(res + i * 32 + hf * 16 + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(h##i), s)); \
    }

static inline __attribute__((always_inline)) void i8_rows_avx2(int MB, int U7, const uint8_t *xq,
                                                               int64_t xqs, const float *sx,
                                                               const int32_t *zc, const int8_t *w,
                                                               int64_t k4, float *res) {
    const __m256i ones = _mm256_set1_epi16(1);
    const int32_t *cs = (const int32_t *)(w + k4 * ATB_I8_ROW);
    for (int hf = 0; hf < 2; ++hf) { /* outputs 0-15, then 16-31 */
        const int8_t *wh = w + hf * 64;
        __m256i l0 = _mm256_setzero_si256(), h0 = l0, l1 = l0, h1 = l0, l2 = l0, h2 = l0, l3 = l0,
                h3 = l0, l4 = l0, h4 = l0, l5 = l0, h5 = l0, a0 = l0, a1 = l0;
        for (int64_t q = 0; q < k4; ++q) {
            const int8_t *wq = wh + q * ATB_I8_ROW;
            if (!U7) {
                a0 = _mm256_abs_epi8(_mm256_loadu_si256((const __m256i *)wq));
                a1 = _mm256_abs_epi8(_mm256_loadu_si256((const __m256i *)(wq + 32)));
            }
            ATB_I8_AVX2_ROW(0) ATB_I8_AVX2_ROW(1) ATB_I8_AVX2_ROW(2) ATB_I8_AVX2_ROW(3)
            ATB_I8_AVX2_ROW(4) ATB_I8_AVX2_ROW(5)
        }
        const __m256i c0 = _mm256_loadu_si256((const __m256i *)(cs + hf * 16));
        const __m256i c1 = _mm256_loadu_si256((const __m256i *)(cs + hf * 16 + 8));
        ATB_I8_AVX2_OUT(0) ATB_I8_AVX2_OUT(1) ATB_I8_AVX2_OUT(2) ATB_I8_AVX2_OUT(3)
        ATB_I8_AVX2_OUT(4) ATB_I8_AVX2_OUT(5)
    }
}

#define ATB_I8_AVX2_RUN(n, u7)                                                        \
    i8_rows_avx2(n, u7, xq + i * xqs, xqs, sx + i, zc + i, w, k4, res + i * 32)
#define ATB_I8_AVX2_TAIL(g, u7)                                                       \
    for (; i + g <= mb; i += g) ATB_I8_AVX2_RUN(g, u7);                               \
    switch (mb - i) {                                                                 \
    case 1: ATB_I8_AVX2_RUN(1, u7); break;  case 2: ATB_I8_AVX2_RUN(2, u7); break;    \
    case 3: ATB_I8_AVX2_RUN(3, u7); break;  case 4: ATB_I8_AVX2_RUN(4, u7); break;    \
    case 5: ATB_I8_AVX2_RUN(5, u7); break;  default: break;                           \
    }

static void i8_tile_avx2(int mb, int u7, const uint8_t *xq, int64_t xqs, const float *sx,
                         const int32_t *zc, const int8_t *w, int64_t k4, float *res) {
    int i = 0;
    if (u7) {
        ATB_I8_AVX2_TAIL(6, 1)
    } else {
        ATB_I8_AVX2_TAIL(4, 0)
    }
}

/* 1 when every weight of the packed panels (not their column sums) is in [-64, 64] */
static int i8_weights_fit_u7(const int8_t *w, int64_t np, int64_t k4) {
    const __m256i lim = _mm256_set1_epi8(64);
    for (int64_t p = 0; p < np; ++p) {
        const int8_t *pw = w + p * (k4 + 1) * ATB_I8_ROW;
        __m256i big = _mm256_setzero_si256();
        for (int64_t i = 0; i < k4 * ATB_I8_ROW; i += 32) /* |w| (|-128| = 128 unsigned) */
            big = _mm256_max_epu8(big, _mm256_abs_epi8(_mm256_loadu_si256((const void *)(pw + i))));
        if (_mm256_movemask_epi8(_mm256_cmpeq_epi8(_mm256_max_epu8(big, lim), lim)) != -1)
            return 0;
    }
    return 1;
}
#endif

/* chunk: panels [p0, p1) against x rows [m0, m1) (one block of rows) */
static void run_i8(void *ctx, int64_t chunk) {
    const I8Job *job = (const I8Job *)ctx;
    const LinArgs *a = job->a;
    const int64_t np = (a->n + ATB_GEMM_PANEL - 1) / ATB_GEMM_PANEL, KP = job->k4 * 4;
    const int64_t m0 = chunk / job->pchunks * job->mblock;
    const int64_t m1 = m0 + job->mblock < a->m ? m0 + job->mblock : a->m;
    const int64_t p0 = chunk % job->pchunks * job->chunk_panels;
    const int64_t p1 = p0 + job->chunk_panels < np ? p0 + job->chunk_panels : np;
    const int8_t *w = (const int8_t *)P(a->w);
    const int64_t pbytes = (job->k4 + 1) * ATB_I8_ROW;
#ifdef ATB_HAVE_VNNI_KERNEL
    const int vnni = atb_cpu_vnni();
#endif
    for (int64_t p = p0; p < p1; ++p)
        for (int64_t m = m0; m < m1; m += ATB_I8_MB) {
            const int mb = m1 - m < ATB_I8_MB ? (int)(m1 - m) : ATB_I8_MB;
            float res[ATB_I8_MB * ATB_GEMM_PANEL];
            const uint8_t *xm = job->xq + m * KP;
            const int8_t *wp = w + p * pbytes;
#ifdef ATB_HAVE_VNNI_KERNEL
            if (vnni)
                i8_tile_vnni(mb, xm, KP, job->sx + m, job->zc + m, wp, job->k4, res);
            else
#endif
#ifdef ATB_AVX2
                i8_tile_avx2(mb, job->u7, xm, KP, job->sx + m, job->zc + m, wp, job->k4, res);
#else
                i8_tile_plain(mb, xm, KP, job->sx + m, job->zc + m, wp, job->k4, res);
#endif
            atb_panel_emit(a, m, p * ATB_GEMM_PANEL, mb, res);
        }
}

/* Returns 0, ATB_ERR_ARGS for a bad call, ATB_ERR_NOMEM when a buffer cannot be had. */
ATB_API int64_t atb_linear_w8a8(const LinArgs *a) {
    if (!a || a->m < 0 || a->k <= 0 || a->n <= 0 || !a->x || !a->w || !a->y || !a->scale ||
        !a->packed || a->w_dt != W_I8)
        return ATB_ERR_ARGS;
    if (a->x_dt < 0 || a->x_dt > ATB_F16 || a->y_dt < 0 || a->y_dt > ATB_F16) return ATB_ERR_ARGS;
    if (a->res && (a->accumulate || a->res_dt < 0 || a->res_dt > ATB_F16)) return ATB_ERR_ARGS;
    if (a->m == 0) return 0;
    I8Job job = {a, P(a->x), a->x_stride, NULL, NULL, 0, 0, NULL, NULL, (a->k + 3) / 4, 0, 0, 0};
#ifdef ATB_HAVE_VNNI_KERNEL
    job.off = atb_cpu_vnni() ? 128 : 0;
#endif
#ifdef ATB_AVX2
    /* the weight scan reads the weights once more: only where many rows share them */
    if (!job.off && a->m >= ATB_I8_U7_ROWS)
        job.u7 = i8_weights_fit_u7((const int8_t *)P(a->w), (a->n + 31) / 32, job.k4);
    if (job.u7) job.off = 128;
#endif
    void *normed = NULL;
    if (a->norm) { /* RmsNorm rows, normed by quantize_rows on the split's threads */
        normed = malloc((size_t)(a->m * a->k * atb_dt_size((int)a->x_dt)));
        if (!normed) return ATB_ERR_NOMEM;
        job.normed = normed;
    }
    job.xq = (uint8_t *)malloc((size_t)(a->m * job.k4 * 4));
    job.sx = (float *)malloc((size_t)a->m * sizeof(float));
    job.zc = (int32_t *)malloc((size_t)a->m * sizeof(int32_t));
    if (!job.xq || !job.sx || !job.zc) {
        free(job.zc);
        free(job.xq);
        free(job.sx);
        free(normed);
        return ATB_ERR_NOMEM;
    }
    int nth = (int)(a->threads > 0 ? a->threads : 1);
    if (a->n * a->k * ((a->m + 7) / 8) < (64 << 10)) nth = 1; /* too small to share */
    atb_parallel_rows(quantize_rows, &job, a->m, a->m * a->k, nth);
    /* chunks of (rows, panels), about 8 per thread, as panel.c's */
    const int64_t np = (a->n + ATB_GEMM_PANEL - 1) / ATB_GEMM_PANEL;
    const int big = a->m > ATB_GEMM_MBLOCK;
    job.mblock = big ? ATB_GEMM_MBLOCK : a->m;
    const int64_t nmb = (a->m + job.mblock - 1) / job.mblock;
    const int64_t per_block = (8 * nth + nmb - 1) / nmb;
    job.chunk_panels = (np + per_block - 1) / per_block;
    job.pchunks = (np + job.chunk_panels - 1) / job.chunk_panels;
    if (big)
        atb_parallel_chunks_big(run_i8, &job, nmb * job.pchunks, nth);
    else
        atb_parallel_chunks(run_i8, &job, job.pchunks, nth);
    free(job.xq);
    free(job.sx);
    free(job.zc);
    free(normed);
    return 0;
}

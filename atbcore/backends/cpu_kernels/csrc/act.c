/* Activations, gated (SwiGLU / GeGLU) or not, with optional biases:
 *   y = act(x + bias) * (up + bias_up)      (up given: gated)
 *   y = act(x + bias)                        (bias+GELU after a GEMM)
 * Rows of n elements; a one-input gated call passes up = x + n with both row
 * strides 2n. fp32 math, one rounding at the store.
 */
#include "act.h"
#include "common.h"
#include "pool.h"

typedef struct {
    int64_t x, up, y, bias, bias_up;  /* addresses; 0 = absent */
    int64_t dt, bias_dt, act, rows, n;
    int64_t x_stride, up_stride, y_stride;
    int64_t threads;                  /* pool threads for big calls (prefill) */
} ActArgs;

#define P(v) ((void *)(intptr_t)(v))

/* erfc(z) = t P(t) exp(-z^2), t = 1 / (1 + p|z|) for z >= 0 (Abramowitz & Stegun
 * 7.1.26, absolute error < 1.5e-7), 2 - erfc(-z) below: branch-free, vectorises. */
static inline float atb_erfcf(float z) {
    float za = fabsf(z);
    float t = 1.0f / (1.0f + 0.3275911f * za);
    float p = 1.061405429f;
    p = p * t - 1.453152027f;
    p = p * t + 1.421413741f;
    p = p * t - 0.284496736f;
    p = p * t + 0.254829592f;
    float r = p * t * atb_expf(-za * za);
    return z >= 0.0f ? r : 2.0f - r;
}

/* v[i] = act(x[i]); x may be v */
void atb_act_apply(int act, int64_t m, const float *x, float *v) {
    switch (act) {
    case ACT_SILU:
#pragma omp simd
        for (int64_t i = 0; i < m; ++i) v[i] = x[i] / (1.0f + atb_expf(-x[i]));
        break;
    case ACT_GELU:
        /* 0.5 x (1 + erf(x / sqrt2)) = 0.5 x erfc(-x / sqrt2): no cancellation for x < 0 */
#pragma omp simd
        for (int64_t i = 0; i < m; ++i) v[i] = 0.5f * x[i] * atb_erfcf(-x[i] * 0.70710678118654752f);
        break;
    case ACT_GELU_TANH:
        /* 0.5 x (1 + tanh(u)) = x * sigmoid(2u) */
#pragma omp simd
        for (int64_t i = 0; i < m; ++i) {
            float u = 0.7978845608028654f * (x[i] + 0.044715f * x[i] * x[i] * x[i]);
            v[i] = x[i] / (1.0f + atb_expf(-2.0f * u));
        }
        break;
    case ACT_QUICK_GELU:
#pragma omp simd
        for (int64_t i = 0; i < m; ++i) v[i] = x[i] / (1.0f + atb_expf(-1.702f * x[i]));
        break;
    case ACT_RELU:
#pragma omp simd
        for (int64_t i = 0; i < m; ++i) v[i] = x[i] < 0.0f ? 0.0f : x[i];
        break;
    default:
        if (v != x) memcpy(v, x, (size_t)m * 4);
        break;
    }
}

static void act_rows(void *ctx, int64_t r0, int64_t r1) {
    const ActArgs a = *(const ActArgs *)ctx;
    const int dt = (int)a.dt, bdt = (int)a.bias_dt;
    float bx[ATB_BLOCK], bu[ATB_BLOCK], bb[ATB_BLOCK];
    for (int64_t r = r0; r < r1; ++r)
        for (int64_t j = 0; j < a.n; j += ATB_BLOCK) {
            int64_t m = a.n - j < ATB_BLOCK ? a.n - j : ATB_BLOCK;
            const float *x = atb_load(P(a.x), dt, r * a.x_stride + j, m, bx);
            if (a.bias) { /* into the scratch: never write the caller's input */
                const float *b = atb_load(P(a.bias), bdt, j, m, bb);
#pragma omp simd
                for (int64_t i = 0; i < m; ++i) bx[i] = x[i] + b[i];
                x = bx;
            }
            /* fp32 output: compute straight into it (elementwise, so y may alias x) */
            float *o = dt == ATB_F32 ? (float *)P(a.y) + r * a.y_stride + j : bx;
            atb_act_apply((int)a.act, m, x, o);
            if (a.up) {
                const float *u = atb_load(P(a.up), dt, r * a.up_stride + j, m, bu);
                if (a.bias_up) {
                    const float *b = atb_load(P(a.bias_up), bdt, j, m, bb);
#pragma omp simd
                    for (int64_t i = 0; i < m; ++i) o[i] *= u[i] + b[i];
                } else {
#pragma omp simd
                    for (int64_t i = 0; i < m; ++i) o[i] *= u[i];
                }
            }
            if (dt != ATB_F32) atb_store(P(a.y), dt, r * a.y_stride + j, m, o);
        }
}

ATB_API int64_t atb_activation(const void *args) {
    ActArgs a;
    memcpy(&a, args, sizeof a);
    if (!a.x || !a.y || a.n < 0 || a.rows < 0 || a.act < 0 || a.act > ACT_NONE)
        return ATB_ERR_ARGS;
    atb_parallel_rows(act_rows, &a, a.rows, a.rows * a.n, (int)a.threads);
    return 0;
}
